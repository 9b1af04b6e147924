"""GPU paths: device selection, MJP forward/gradients, AMP training, LPIPS and batched attacks on CUDA.

Every test but the first needs CUDA and is skipped without it; the first checks the CPU-only answer.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import attacks
from fedmjp.devices import resolve_device
from fedmjp.factory import normalize
from fedmjp.models import MJPVisionTransformer
from helpers import make_imagefolder

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
TINY = dict(img_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, num_classes=10)


@pytest.mark.skipif(HAS_CUDA, reason="checks the answer on machines without CUDA")
def test_cuda_request_without_cuda_is_a_clear_error():
    assert resolve_device("auto").type == "cpu"
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


@pytest.mark.cuda
@cuda
def test_auto_device_picks_cuda():
    # A torchrun rank passes its local rank: ``auto`` and ``cuda`` both name that GPU.
    assert resolve_device("auto") == torch.device("cuda", 0)
    last = torch.cuda.device_count() - 1
    assert resolve_device("auto", last) == resolve_device("cuda", last) == torch.device("cuda", last)


@pytest.mark.cuda
@cuda
def test_mjp_forward_and_unk_gradient_match_cpu():
    torch.manual_seed(0)
    cpu = MJPVisionTransformer(variant="mjp", **TINY).eval()
    gpu = MJPVisionTransformer(variant="mjp", **TINY).eval()
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    x = torch.rand(4, 3, 32, 32)
    plan = cpu.draw_plan(4, gamma=0.4, seed=1, per_sample=True)
    for model, inp in ((cpu, x), (gpu, x.cuda())):
        model.zero_grad()
        model(inp, plan=plan.to(inp.device)).logsumexp(-1).sum().backward()
    assert torch.allclose(gpu.unk_embed.grad.cpu(), cpu.unk_embed.grad, atol=1e-4)
    shuffled_everywhere = plan.mask.all(0)
    assert torch.count_nonzero(gpu.pos_embed.grad[0, 1:][shuffled_everywhere.cuda()]) == 0
    out = gpu.train().forward_mjp(x.cuda())
    assert out.logits.is_cuda and out.dal_loss.is_cuda


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_training_with_amp_on_cuda(tmp_path, amp):
    from fedmjp.train import run_training
    from fedmjp.trainconfig import TrainConfig
    from fedmjp.trainutils import load_checkpoint_state

    cfg = TrainConfig(
        model="mjp_vit_cifar_patch4_32", model_kwargs={"depth": 1, "embed_dim": 48, "num_heads": 3},
        variant="mjp", gamma=0.5, shuffle_prob=1.0, shuffle_start_epoch=0, img_size=32,
        data_path=str(make_imagefolder(tmp_path / "data")), batch_size=4, num_workers=0, epochs=1,
        warmup_epochs=0, lr=1e-3, output_dir=str(tmp_path / "out"), threads=1, device="cuda", amp=amp,
    )
    result = run_training(cfg, progress=False)
    assert np.isfinite(result.metrics["loss"])
    assert (load_checkpoint_state(result.checkpoint)["scaler"] is not None) == (amp == "fp16")


@pytest.mark.cuda
@cuda
def test_lpips_on_cuda_matches_cpu(alexnet_features: Path):
    import metrics

    torch.manual_seed(0)
    a, b = torch.rand(3, 3, 64, 64), torch.rand(3, 3, 64, 64)
    on_cpu = metrics.lpips(a, b, model=metrics.get_lpips_model("cpu", backbone_path=alexnet_features))
    on_gpu = metrics.lpips(a.cuda(), b.cuda(), model=metrics.get_lpips_model("cuda", backbone_path=alexnet_features))
    assert torch.allclose(on_gpu.cpu(), on_cpu, atol=1e-4)


@pytest.mark.cuda
@cuda
def test_batched_inverting_gradients_on_cuda_lowers_objective():
    torch.manual_seed(0)
    model = MJPVisionTransformer(variant="plain", **TINY).eval()
    images, labels = torch.rand(2, 3, 32, 32), torch.tensor([1, 7])
    updates = [attacks.compute_update(model, normalize(images[i:i + 1], (0.5,) * 3, (0.25,) * 3), labels[i:i + 1])
               for i in range(2)]
    metas = [dict(num_images=1, mean=(0.5,) * 3, std=(0.25,) * 3, labels=labels[i:i + 1], image_size=(3, 32, 32))
             for i in range(2)]
    attack = attacks.create_attack("invertinggradients_batched", iterations=20, device="cuda")
    results = attack.reconstruct_many(model, updates, metas)
    for result in results:
        assert not result.failed, result.reason
        stats = result.stats[0]
        assert stats["objective_min"] < stats["objective_first"]


@pytest.mark.cuda
@cuda
def test_april_closed_form_exact_with_cuda_victims():
    torch.manual_seed(0)
    model = MJPVisionTransformer(variant="plain", first_block="april", **{**TINY, "embed_dim": 96})
    model = model.eval().double().cuda()  # T = 65 <= D = 96, 3p^2 = 48 <= D
    x = torch.rand(1, 3, 32, 32, dtype=torch.float64, device="cuda")
    update = attacks.compute_update(model, x, torch.tensor([3], device="cuda"))
    result = attacks.create_attack("april_analytic").reconstruct(
        model, update, dict(num_images=1, mean=(0.0,) * 3, std=(1.0,) * 3, image_size=(3, 32, 32)))
    assert not result.failed, result.reason
    mse = ((result.images.double() - x.cpu()) ** 2).mean()
    assert 10 * torch.log10(1 / mse) > 60  # float32 images returned; the solve itself is float64


@pytest.mark.cuda
@cuda
def test_benchmark_runs_on_cuda(tmp_path):
    from run_benchmark import main

    code = main(["--setting", "c", "--device", "cuda", "--num-images", "4", "--rounds", "1",
                 "--no-progress", "--output", str(tmp_path / "run")])
    assert code == 0 and (tmp_path / "run" / "table.csv").is_file()

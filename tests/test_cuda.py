"""GPU paths: device selection, MJP forward/gradients, AMP training, LPIPS and the attacks on CUDA.

Every ``cuda``-marked test needs CUDA and is skipped without it; one attack of each family runs on
CUDA and is compared with the same attack on the CPU. The unmarked tests check the CPU-only answer
and that the benchmark builds its attacks on the run's device.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import attacks
from fedmjp.devices import resolve_device
from fedmjp.factory import normalize as normalize_with
from fedmjp.models import MJPVisionTransformer
from helpers import MD, bundled_images, make_imagefolder, normalize, psnr, tiny_config

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
    updates = [attacks.compute_update(model, normalize_with(images[i:i + 1], (0.5,) * 3, (0.25,) * 3), labels[i:i + 1])
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


# ------------------------------------------------------------------------ the attacks on the device


def _design_a(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return MJPVisionTransformer(variant="plain", first_block="april", **{**TINY, "embed_dim": 96}).eval().to(dtype)


def _case(dtype: torch.dtype = torch.float64, defence: dict | None = None):
    """A 32 px design-A ViT, one real image's batch-1 update (optionally defended) and its metadata."""
    from defences import apply_update_defence, validate_defence

    model = _design_a(dtype)
    x = bundled_images(1, 32, start=2)
    update = attacks.compute_update(model, normalize(x).to(dtype), torch.tensor([3]))
    if defence is not None:
        update = apply_update_defence(update, validate_defence(defence), torch.Generator().manual_seed(0))
    meta = dict(MD, num_images=1, image_size=(3, 32, 32), labels=torch.tensor([3]))
    return model, x, update, meta


def _on_cuda(model: torch.nn.Module, update: dict) -> tuple[torch.nn.Module, dict]:
    import copy

    return copy.deepcopy(model).cuda(), {k: v.cuda() if torch.is_tensor(v) else v for k, v in update.items()}


@pytest.mark.cuda
@cuda
def test_closed_form_on_cuda_victims_equals_the_cpu_result():
    """pe_closed_form solves in float64 on the CPU whatever the victims' device: same image."""
    model, x, update, meta = _case()
    attack = attacks.create_attack("pe_closed_form")
    on_cpu = attack.reconstruct(model, update, meta)
    on_gpu = attack.reconstruct(*_on_cuda(model, update), meta)
    assert not on_cpu.failed and not on_gpu.failed, (on_cpu.reason, on_gpu.reason)
    assert psnr(on_cpu.images, x) > 60
    assert psnr(on_gpu.images, on_cpu.images) > 60


@pytest.mark.cuda
@cuda
def test_april_robust_on_cuda_equals_the_cpu_result():
    """The whole solve (CG x-steps, G-steps) on CUDA in float64: the CPU's image to float rounding."""
    model, x, update, meta = _case(defence=dict(name="quantize", bits=8))
    opts = dict(iterations=3, known_defence=False)
    on_cpu = attacks.create_attack("april_robust", device="cpu", **opts).reconstruct(model, update, meta)
    on_gpu = attacks.create_attack("april_robust", device="cuda", **opts).reconstruct(*_on_cuda(model, update), meta)
    assert not on_cpu.failed and not on_gpu.failed, (on_cpu.reason, on_gpu.reason)
    assert on_cpu.stats[0]["cg_iterations"] > 0  # the iterative path, not the consistent update's lstsq
    assert psnr(on_gpu.images, on_cpu.images) > 50


@pytest.mark.cuda
@cuda
def test_mjp_adaptive_on_cuda_equals_the_cpu_result():
    """The priors, the span fit and its Levenberg-Marquardt stage on CUDA in float64 (the reduction
    and the random draws on the CPU): the CPU's estimate to float64 rounding."""
    torch.manual_seed(0)
    model = MJPVisionTransformer(variant="mjp", first_block="april", **{**TINY, "embed_dim": 96}).eval().double()
    x = bundled_images(1, 32, start=2)
    plan = model.draw_plan(1, gamma=0.27, seed=3)
    update = attacks.compute_update(model, normalize(model.shuffle_images(x, plan)).double(), torch.tensor([3]),
                                    unk_mask=plan.mask)
    meta = dict(MD, num_images=1, image_size=(3, 32, 32), labels=torch.tensor([3]))
    opts = dict(refine="span", span_iterations=10, starts=2, probe_iterations=3, lm_jacobians=1, reuse=False,
                min_device_cost=0)  # a 32 px model: on the device all the same
    on_cpu = attacks.create_attack("mjp_adaptive", device="cpu", **opts).reconstruct(model, update, meta)
    on_gpu = attacks.create_attack("mjp_adaptive", device="cuda", **opts).reconstruct(*_on_cuda(model, update), meta)
    assert not on_cpu.failed and not on_gpu.failed, (on_cpu.reason, on_gpu.reason)
    assert on_gpu.stats[0]["lm_jacobians"] == on_cpu.stats[0]["lm_jacobians"] == 1
    assert psnr(on_gpu.images, on_cpu.images) > 60


@pytest.mark.cuda
@cuda
def test_ig_closed_start_on_cuda_follows_the_cpu_run():
    """Cosine matching from the closed-form start (float32, start drawn on the CPU): a few steps on
    CUDA end where the CPU's do, to float32 rounding."""
    model, x, update, meta = _case(defence=dict(name="local_dp", clip=1.0, sigma=1e-4))
    opts = dict(iterations=5, converge_window=5, restarts=1)
    on_cpu = attacks.create_attack("ig_closed_start", device="cpu", **opts).reconstruct(model, update, meta)
    on_gpu = attacks.create_attack("ig_closed_start", device="cuda", **opts).reconstruct(*_on_cuda(model, update), meta)
    assert not on_cpu.failed and not on_gpu.failed, (on_cpu.reason, on_gpu.reason)
    assert psnr(on_gpu.images, on_cpu.images) > 40


@pytest.mark.cuda
@cuda
def test_ig_closed_start_cuda_graph_replays_the_eager_steps():
    """Each converging step recorded once as a CUDA graph and replayed: the eager run's steps and
    image to float32 rounding, and the result says the graph ran."""
    model, x, update, meta = _case(defence=dict(name="quantize", bits=8))
    opts = dict(iterations=8, converge_window=8, restarts=1, start_attacks=["pe_closed_form"], device="cuda")
    gpu_model, gpu_update = _on_cuda(model, update)
    eager = attacks.create_attack("ig_closed_start", cuda_graph=False, **opts).reconstruct(gpu_model, gpu_update, meta)
    default = attacks.create_attack("ig_closed_start", **opts)
    assert default.cuda_graph  # on by default on a CUDA device
    graphed = default.reconstruct(gpu_model, gpu_update, meta)
    assert not eager.failed and not graphed.failed, (eager.reason, graphed.reason)
    assert graphed.stats[0]["steps_run_as"].startswith("CUDA graph: 1 recorded"), graphed.stats[0]["steps_run_as"]
    assert graphed.stats[0]["iterations"] == eager.stats[0]["iterations"]
    assert psnr(graphed.images, eager.images) > 40


@pytest.mark.cuda
@cuda
def test_batch_match_on_cuda_follows_the_cpu_run():
    """batch_match (float64, start drawn on the CPU) at B = 2: the CUDA run ends where the CPU's does."""
    torch.manual_seed(0)
    model = MJPVisionTransformer(variant="plain", **TINY).eval().double()
    x, y = bundled_images(2, 32), torch.tensor([2, 6])
    update = attacks.compute_update(model, normalize(x), y)
    meta = dict(MD, num_images=2, image_size=(3, 32, 32))
    on_cpu = attacks.create_attack("batch_match", iterations=10, device="cpu").reconstruct(model, update, meta)
    on_gpu = attacks.create_attack("batch_match", iterations=10, device="cuda").reconstruct(
        *_on_cuda(model, update), meta)
    assert not on_cpu.failed and not on_gpu.failed, (on_cpu.reason, on_gpu.reason)
    assert on_gpu.labels.tolist() == on_cpu.labels.tolist()
    assert psnr(on_gpu.images, on_cpu.images) > 40


@pytest.mark.cuda
@cuda
def test_breaching_attack_on_cuda_lowers_its_objective_as_on_cpu():
    """breaching draws its start on the attack's device (CUDA's random stream is not the CPU's), so
    the runs differ image for image: both must run the same iterations and lower the objective."""
    torch.manual_seed(0)
    model = MJPVisionTransformer(variant="plain", **{**TINY, "img_size": 16, "depth": 1}).eval()
    x, y = bundled_images(1, 16).float(), torch.tensor([4])
    update = attacks.compute_update(model, normalize(x).float(), y)
    meta = dict(MD, labels=y)
    for device in ("cpu", "cuda"):
        attack = attacks.create_attack("invertinggradients", iterations=6, raise_errors=True, device=device)
        res = attack.reconstruct(model, update, meta)
        assert not res.failed, res.reason
        assert res.stats[0]["iterations"] == 6
        assert res.stats[0]["objective_min"] < res.stats[0]["objective_first"]


# --------------------------------------------------------------- the benchmark's device for attacks


def test_attacks_get_the_run_device_unless_their_entry_sets_one():
    from benchmark.entries import LabelledAttack
    from benchmark.pipeline import attack_options_on

    def entry(name: str, **options) -> LabelledAttack:
        return LabelledAttack(name=name, options=options, label=name)

    gpu1 = torch.device("cuda", 1)  # a device object needs no CUDA: only its name is passed on
    assert attack_options_on(entry("april_robust", iterations=2), gpu1) == dict(iterations=2, device="cuda:1")
    assert attack_options_on(entry("ig_closed_start"), gpu1, remote=True) == dict(device="cuda")  # Ray's GPU
    assert attack_options_on(entry("invertinggradients"), torch.device("cpu")) == dict(device="cpu")
    assert attack_options_on(entry("batch_match", device="cpu"), gpu1) == dict(device="cpu")  # the entry wins
    assert attack_options_on(entry("mjp_adaptive"), gpu1) == dict(device="cuda:1")
    assert attack_options_on(entry("pe_closed_form"), gpu1) == {}  # no device option: none passed


def test_prepare_builds_every_device_attack_with_the_run_device():
    from benchmark.pipeline import prepare
    from benchmark.validation import validate

    cfg = validate(tiny_config(attacks=[{"name": "april_analytic"}, {"name": "april_robust"},
                                        {"name": "batch_match", "options": {"device": "cpu"}}]))
    attackers = {a.label: a.attack for a in prepare(cfg).attackers}
    assert "device" in attackers["april_robust"].options.model_fields_set  # set by the pipeline, not defaulted
    assert attackers["april_robust"].device == torch.device("cpu")
    assert not hasattr(attackers["april_analytic"].options, "device")


def test_mjp_adaptive_keeps_small_models_on_the_cpu_with_a_note():
    """A 32 px model's many small solves are slower on a GPU (docs/speed.md): below
    ``min_device_cost`` they stay on the CPU and the result says so; 0 asks for the device always.
    No CUDA needed: only the choice is checked, nothing is allocated on the device."""
    from attacks.optimization.mjp_adaptive import MJPAdaptive

    model = MJPVisionTransformer(variant="mjp", first_block="april", **{**TINY, "embed_dim": 96})
    shuffled = torch.zeros(64, dtype=torch.bool)
    attack = MJPAdaptive()
    assert attack.device_for(model, shuffled) == (torch.device("cpu"), None)
    attack.device = torch.device("cuda", 0)  # as resolve_device("cuda") gives on a GPU machine
    dev, note = attack.device_for(model, shuffled)
    assert dev == torch.device("cpu") and "min_device_cost" in note and "cuda:0" in note
    attack.min_device_cost = 0.0
    assert attack.device_for(model, shuffled) == (torch.device("cuda", 0), None)

"""Batch updates (B > 1): the assignment that pairs reconstructions with images, the per-layer span
identity a batch leaves, label counts read off the head's update, and ``batch_match``.

All on real photographs (scikit-image's bundled ones) and the shipped CIFAR DeiT checkpoint."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import timm
import torch

import attacks
import fedmjp  # noqa: F401  (registers the models)
from attacks.labels import recover_label_counts, round_counts
from benchmark.scoring import label_accuracy, pair_reconstructions
from fedmjp.checkpoint import load_checkpoint
from tests.helpers import MEAN, STD, bundled_images

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "cifar_deit.safetensors"


def _deit() -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="april", depth=4)
    load_checkpoint(model, CHECKPOINT)
    model = model.eval().double()
    for blk in model.blocks:
        blk.attn.fused_attn = False
    return model


def _inputs(n: int, start: int = 0) -> torch.Tensor:
    x = bundled_images(n, 32, start)
    return (x - MEAN.double()[:, None, None]) / STD.double()[:, None, None]


@pytest.mark.parametrize("B", [2, 3, 4, 5])
def test_assignment_equals_brute_force(B: int) -> None:
    """linear_sum_assignment on per-pair MSE finds the permutation of least total MSE (all B!)."""
    gen = torch.Generator().manual_seed(B)
    x = bundled_images(B, 32).float()
    # reconstructions: the images shuffled, noised heavily enough that the pairing is not obvious
    perm = torch.randperm(B, generator=gen)
    rec = (x[perm] + 0.35 * torch.randn(x.shape, generator=gen)).clamp(0, 1)
    order = pair_reconstructions(rec, x)
    cost = ((x[:, None] - rec[None]) ** 2).flatten(2).mean(2)  # [reference, reconstruction]
    brute = min(itertools.permutations(range(B)), key=lambda p: float(sum(cost[b, p[b]] for b in range(B))))
    total = float(sum(cost[b, order[b]] for b in range(B)))
    assert total == pytest.approx(float(sum(cost[b, brute[b]] for b in range(B))), rel=1e-12)
    assert sorted(order) == list(range(B))


@pytest.mark.parametrize("B", [1, 2])
def test_block0_fc1_gradient_spans_every_token_of_the_batch(B: int) -> None:
    """dL/dW_fc1 = sum_{b,t} g_{b,t} h_{b,t}^T: its row space is the span of all B*T inputs when
    B*T <= fan-in (65 B <= 192), so every token of every image lies in it (DAGER's span check)."""
    model = _deit()
    seen = {}
    hook = model.blocks[0].mlp.fc1.register_forward_hook(lambda m, a, o: seen.__setitem__("h", a[0].detach()))
    xn = _inputs(B)
    update = attacks.compute_update(model, xn, torch.tensor([3, 5][:B]))
    hook.remove()
    H = seen["h"].reshape(-1, seen["h"].shape[-1])  # [B*T, D]
    G = update["blocks.0.mlp.fc1.weight"]
    _, sv, Vh = torch.linalg.svd(G, full_matrices=False)
    r = 65 * B
    assert H.shape[0] == r and float(sv[r]) < 1e-12 * float(sv[0])  # rank <= B*T: rounding beyond
    V = Vh[:r].T
    rel = (H - H @ V @ V.T).norm(dim=1) / H.norm(dim=1)
    assert float(rel.max()) < 1e-8
    # and a token of another image is not in it
    other = _inputs(1, start=B)
    model.blocks[0].mlp.fc1.register_forward_hook(lambda m, a, o: seen.__setitem__("o", a[0].detach()))
    model(other)
    O = seen["o"][0]
    # measured 4.6e-4 at B = 2 (the 130-dim span holds most of R^192), 4 decades above the batch's own
    assert float(((O - O @ V @ V.T).norm(dim=1) / O.norm(dim=1)).median()) > 1e-5


def test_round_counts_keeps_sum_and_floor() -> None:
    got = round_counts(torch.tensor([1.6, 0.2, 0.7, -0.3]), 3, floor=torch.tensor([False, True, False, False]))
    assert got.tolist() == [1, 1, 1, 0]
    assert round_counts(torch.tensor([2.2, 0.9]), 3).tolist() == [2, 1]


@pytest.mark.parametrize("labels", [[3, 3], [4, 8]])
def test_label_counts_on_real_updates(labels: list[int]) -> None:
    """B = 2, a repeated class and two classes: the counts come out exact from the head's update of
    the trained DeiT (the bias's two most negative entries cannot say [3, 3])."""
    model = _deit()
    y = torch.tensor(labels)
    upd = attacks.compute_update(model, _inputs(len(labels)), y)
    got = recover_label_counts(upd["head.bias"], upd["head.weight"], model.head.weight, model.head.bias, len(labels))
    assert got.method == "fit", got.notes
    assert got.counts.tolist() == torch.bincount(y, minlength=10).tolist()
    assert label_accuracy(y, got.labels) == 1.0


def test_label_accuracy_is_a_multiset_overlap() -> None:
    assert label_accuracy(torch.tensor([3, 3, 5]), torch.tensor([5, 3, 1])) == pytest.approx(2 / 3)
    assert label_accuracy(torch.tensor([3]), None) != label_accuracy(torch.tensor([3]), None)  # NaN


def test_batch_match_runs_at_batch_two_with_recovered_labels() -> None:
    """A B = 2 update: two images back, labels recovered as a multiset, the objective halved from the start."""
    model = _deit()
    y = torch.tensor([2, 6])
    upd = attacks.compute_update(model, _inputs(2), y)
    attack = attacks.create_attack("batch_match", iterations=20)
    res = attack.reconstruct(model, upd, {"num_images": 2, "mean": MEAN.tolist(), "std": STD.tolist()})
    assert not res.failed, res.reason
    assert res.images.shape == (2, 3, 32, 32)
    assert sorted(res.labels.tolist()) == [2, 6]
    assert res.stats[0]["labels_source"] == "recovered"
    run = res.stats[0]["restarts"][0]
    assert res.stats[0]["objective"] == run["objective"] < 0.5 * run["objective_start"]


def test_batch_plot_draws_the_strongest_row_against_b(tmp_path: Path) -> None:
    import pandas as pd

    from benchmark.batch_plot import batch_plot

    rows = []
    for i, B in enumerate([1, 2, 4]):
        for attack, psnr in (("batch_match", 20.0 - B), ("strongest", 21.0 - B)):
            rows.append({"sweep_index": i, "model": "DeiT", "defence": "none", "setting": "c", "attack": attack,
                         "sweep.federation.batch_size": B, "psnr": psnr, "lpips": 0.1 * B})
    frame = pd.DataFrame(rows)
    path = batch_plot(frame, tmp_path / "batch_size.png")
    assert path is not None and path.stat().st_size > 0
    assert batch_plot(frame.drop(columns=["sweep.federation.batch_size"]), tmp_path / "none.png") is None

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
from attacks.closed_form.labels import recover_label_counts, round_counts
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
                         "sweep.federation.batch_size": B, "psnr": psnr, "lpips": 0.1 * B,
                         "flat_psnr": 12.0 + 0.1 * B})
    frame = pd.DataFrame(rows)
    path = batch_plot(frame, tmp_path / "batch_size.png")
    assert path is not None and path.stat().st_size > 0
    without = batch_plot(frame.drop(columns=["flat_psnr"]), tmp_path / "no_floor.png")  # runs stored before the column
    assert without is not None and without.read_bytes() != path.read_bytes()  # the floor is drawn
    assert batch_plot(frame.drop(columns=["sweep.federation.batch_size"]), tmp_path / "none.png") is None


def test_batch_plot_joins_several_sweeps(tmp_path: Path) -> None:
    """``python -m benchmark.batch_plot A B --out PNG``: two sweeps' points (each numbered from 0) on one
    plot, the same as one sweep of both; a folder without sweep.csv or of another key is a clear error."""
    import pandas as pd

    from benchmark.batch_plot import batch_plot, main

    def sweep(folder: Path, sizes: list[int]) -> list[dict]:
        rows = [{"sweep_index": i, "model": "DeiT", "defence": "none", "setting": "c", "attack": "batch_match",
                 "sweep.federation.batch_size": B, "psnr": 20.0 - B, "lpips": 0.1 * B} for i, B in enumerate(sizes)]
        folder.mkdir()
        pd.DataFrame(rows).to_csv(folder / "sweep.csv", index=False)
        return rows

    a, b = sweep(tmp_path / "a", [1, 2]), sweep(tmp_path / "b", [16])
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "joined.png")]) == 0
    whole = pd.DataFrame(a + [{**b[0], "sweep_index": 2}])
    batch_plot(whole, tmp_path / "whole.png")
    assert (tmp_path / "joined.png").read_bytes() == (tmp_path / "whole.png").read_bytes()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")])
    pd.DataFrame([{"sweep_index": 0, "sweep.gamma": 0.1}]).to_csv(tmp_path / "a" / "sweep.csv", index=False)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "a"), "--out", str(tmp_path / "x.png")])


def _fedavg(model: torch.nn.Module, images: torch.Tensor, y: torch.Tensor, steps: int, lr: float) -> dict:
    """The client's own FedAvg update (clients.update.fedavg_update) of a copy of ``model``."""
    import copy

    from clients.partition import PrivateBatch
    from clients.update import fedavg_update

    batch = PrivateBatch(images=images, labels=y, image_ids=[str(i) for i in range(len(y))],
                         indices=torch.arange(len(y)), plan=None, shuffled=None, gamma=0.0)
    delta, _ = fedavg_update(copy.deepcopy(model), batch, steps, lr)
    return delta


def test_simulated_fedavg_delta_is_the_clients_own() -> None:
    """batch_match's unrolled E local steps at the true batch give the client's delta (float64)."""
    from attacks.optimization.batch_match import simulate_delta

    model = _deit()
    y = torch.tensor([2, 6])
    delta = _fedavg(model, bundled_images(2, 32).double(), y, steps=3, lr=0.5)
    names = [n for n, _ in model.named_parameters()]
    from fedmjp.factory import model_input_stats, normalize

    sim = simulate_delta(model, normalize(bundled_images(2, 32).double(), *model_input_stats(model)), y, 3, 0.5, names)
    scale = max(float(d.abs().max()) for d in delta.values())
    worst = max(float((s.detach() - delta[n]).abs().max()) for n, s in zip(names, sim))
    assert worst <= 1e-9 * scale
    # the mean-gradient reading of the same delta is off by far more than rounding
    g0 = attacks.compute_update(model, _inputs(2), y)
    approx = max(float((-0.5 * 3 * g0[n] - delta[n]).abs().max()) for n in names if n in g0)
    assert approx > 1e-3 * scale


@pytest.mark.parametrize("steps,lr", [(2, 0.05), (5, 0.05), (4, 0.5)])
def test_a_fedavg_delta_of_one_image_is_read_exactly_off_the_patch_embedding(steps: int, lr: float) -> None:
    """E local SGD steps on one image (the model as trained, block 0 standard): the patch embedding's
    input is the image's patches at every step, so its delta is -lr sum_t (sum_e g_te) x_t^T and the
    position embedding's -lr sum_e g_te, one gradient's equations with each token's gradient summed
    over the steps (docs/design.md, "Several local steps"). pe_closed_form reads the image to the
    rounding floor whatever E and lr, where the mean-gradient reading of the rest of the model is off
    by far more than rounding (test_simulated_fedavg_delta_is_the_clients_own)."""
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="standard", depth=4)
    load_checkpoint(model, CHECKPOINT)
    model = model.eval().double()
    y = torch.tensor([3])
    x = bundled_images(1, 32, 4).double()
    delta = _fedavg(model, x, y, steps=steps, lr=lr)
    meta = {"num_images": 1, "mean": MEAN.tolist(), "std": STD.tolist(), "labels": y, "update_type": "delta",
            "lr": lr, "local_steps": steps}
    res = attacks.create_attack("pe_closed_form").reconstruct(model, delta, dict(meta))
    assert not res.failed, res.reason
    assert float((res.images.double() - x).abs().max()) < 1e-6  # the float32 result's rounding: 6e-8


def test_block0_roots_names_the_tokens_a_fedavg_delta_holds() -> None:
    """A 2-step delta at B = 2 sends E B T = 260 tokens through block 0's MLP: block0_roots refuses
    with that count and names the attacker that simulates the steps; at B = 1 it names the closed form."""
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="standard", depth=4)
    load_checkpoint(model, CHECKPOINT)
    model = model.eval().double()
    for B in (1, 2):
        y = torch.tensor([3, 5][:B])
        delta = _fedavg(model, bundled_images(B, 32).double(), y, steps=2, lr=0.05)
        meta = {"num_images": B, "mean": MEAN.tolist(), "std": STD.tolist(), "labels": y, "update_type": "delta",
                "lr": 0.05, "local_steps": 2}
        res = attacks.create_attack("block0_roots").reconstruct(model, delta, meta)
        assert res.failed and f"E B T = {2 * B * 65} tokens" in res.reason, res.reason
        assert ("pe_closed_form" if B == 1 else "batch_match") in res.reason


ITERS = 30


@pytest.mark.slow
def test_unrolled_fedavg_matching_beats_the_mean_gradient_reading() -> None:
    """A 4-step FedAvg delta at lr 0.5 (B = 1): matching the simulated delta recovers the image
    far better than matching -delta / (lr E) as one gradient, on the same budget."""
    from tests.helpers import psnr

    model = _deit()
    y = torch.tensor([3])
    x = bundled_images(1, 32, 4).double()
    delta = _fedavg(model, x, y, steps=4, lr=0.5)
    meta = {"num_images": 1, "mean": MEAN.tolist(), "std": STD.tolist(), "labels": y, "update_type": "delta",
            "lr": 0.5, "local_steps": 4}
    got = {}
    for unroll in (True, False):
        res = attacks.create_attack("batch_match", iterations=ITERS, unroll=unroll).reconstruct(model, delta, dict(meta))
        assert not res.failed, res.reason
        got[unroll] = psnr(res.images.float(), x.float())
    assert got[True] > got[False] + 3.0, got


def test_true_tokens_are_roots_of_the_per_token_mlp_problem() -> None:
    """DAGER's per-token check on a real B = 2 update (docs/results/batches.md, the structure
    attack): with the spans :func:`attacks.solvers.spans.input_spans` reads off the update, every one of the
    B*T = 130 true tokens has its fc1 input (block 0's norm2 output) in S_fc1 and its fc2 input
    GELU(W1 h + b1) in S_fc2 at the float64 noise floor, while tokens the batch did not hold (the
    same images shifted by one pixel, random LayerNorm outputs) are decades off."""
    from attacks.solvers.spans import input_spans

    model = _deit()
    mlp = model.blocks[0].mlp
    seen: dict[str, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, k=k: seen.__setitem__(k, a[0].detach().flatten(0, -2)))
             for k, layer in (("fc1", mlp.fc1), ("fc2", mlp.fc2))]
    xn = _inputs(2)
    update = attacks.compute_update(model, xn, torch.tensor([3, 5]))
    true = dict(seen)
    spans = {s.name: s.basis for s in input_spans(model, update, 2 * 65)}

    def residual(layer: str, tokens: torch.Tensor) -> torch.Tensor:
        """Per token: ||a - V V^T a|| / ||a|| against the layer's span."""
        V = spans[f"blocks.0.mlp.{layer}"]
        return (tokens - tokens @ V @ V.T).norm(dim=1) / tokens.norm(dim=1)

    assert true["fc1"].shape[0] == 130 and spans["blocks.0.mlp.fc1"].shape[1] == 130
    # measured max 2.5e-12 (fc1) and 5.1e-10 (fc2: the small tokens' relative rounding)
    assert float(residual("fc1", true["fc1"]).max()) < 1e-10
    assert float(residual("fc2", true["fc2"]).max()) < 1e-8
    with torch.no_grad():
        model(torch.roll(xn, 1, dims=-1))
    # measured min 2.5e-4 (fc1: S_fc1 holds 130 of 192 dimensions, and real tokens crowd into it)
    # and 7.0e-3 (fc2: 130 of 768)
    assert float(residual("fc1", seen["fc1"]).min()) > 1e-5
    assert float(residual("fc2", seen["fc2"]).min()) > 1e-3
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        h = model.blocks[0].norm2(torch.randn(130, 192, generator=gen, dtype=torch.float64))
        a = mlp.act(mlp.fc1(h))
    assert float(residual("fc1", h).min()) > 0.1 and float(residual("fc2", a).min()) > 0.1  # measured 0.42, 0.64
    for hook in hooks:
        hook.remove()


def test_batched_roots_of_the_per_token_mlp_problem_are_true_tokens() -> None:
    """:func:`attacks.structure.token_roots.mlp_token_roots` on a real B = 2 update from random starts: every
    start that converges lands on one of the batch's 130 true fc1 inputs (cosine > 0.99999), and
    distinct starts find distinct tokens (measured: 64 starts, 30 iterations, 30 converged, 10
    distinct tokens, all true)."""
    from attacks.solvers.spans import input_spans
    from attacks.structure.token_roots import mlp_token_roots

    model = _deit()
    seen: dict[str, torch.Tensor] = {}
    hook = model.blocks[0].mlp.fc1.register_forward_hook(
        lambda m, a, o: seen.__setitem__("h", a[0].detach().flatten(0, -2)))
    update = attacks.compute_update(model, _inputs(2), torch.tensor([3, 5]))
    hook.remove()
    spans = {s.name: s.basis for s in input_spans(model, update, 2 * 65)}
    starts = torch.randn(32, 192, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = mlp_token_roots(model.blocks[0], spans["blocks.0.mlp.fc1"], spans["blocks.0.mlp.fc2"], starts)
    assert out.starts == 32 and out.converged >= 8, out.converged
    true = seen["h"] / seen["h"].norm(dim=-1, keepdim=True)
    cos = (out.roots / out.roots.norm(dim=-1, keepdim=True)) @ true.T
    assert out.roots.shape[0] >= 4
    assert float(cos.max(dim=1).values.min()) > 0.99999  # no spurious root
    assert len(set(cos.argmax(dim=1).tolist())) == out.roots.shape[0]  # distinct roots, distinct tokens
    with pytest.raises(ValueError, match="starts must be"):
        mlp_token_roots(model.blocks[0], spans["blocks.0.mlp.fc1"], spans["blocks.0.mlp.fc2"], starts[:, :10])


def _bench(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_sided_span_agreement_keeps_the_candidates_apart() -> None:
    """bench/batch_match_basin.py's span agreement on a real B = 2 update: both sides ~0 at the
    client's batch; a pair of one image twice passes the one-sided (per-token) test but not the
    two-sided one; noise raises the two-sided term with its size."""
    from attacks.solvers.spans import input_spans
    basin = _bench("batch_match_basin")
    model = _deit()
    xn = _inputs(2)
    update = attacks.compute_update(model, xn, torch.tensor([3, 5]))
    agree = basin.SpanAgreement(model, input_spans(model, update, 130))
    one, two = agree(xn)
    assert one < 1e-12 and two < 1e-8  # measured 1.8e-19 and 5.1e-10 (the spans' rank cut-off)
    one_dup, two_dup = agree(xn[:1].expand_as(xn))
    assert one_dup < 1e-12 and two_dup > 0.1  # measured 5e-22 and 0.35
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(xn.shape, generator=gen, dtype=torch.float64)
    small, large = agree(xn + 0.01 * noise)[1], agree(xn + 0.3 * noise)[1]
    assert 1e-4 < small < large  # measured 1.5e-3 (RMS 0.01) and 0.14 (RMS 0.3)


@pytest.mark.slow
def test_batch_match_tv_lifts_a_batch_of_two_above_the_mean_colour() -> None:
    """B = 2, labels known, 40 L-BFGS iterations from the same start: ``tv: 1`` ends above
    ``tv: 0`` and above a flat image of the normalisation mean colour (docs/results/batches.md:
    without a prior the batch attack stays below that flat image)."""
    basin = _bench("batch_match_basin")
    model = _deit()
    x = bundled_images(2, 32).double()
    update = attacks.compute_update(model, _inputs(2), torch.tensor([3, 5]))
    meta = {"num_images": 2, "labels": [3, 5], "mean": MEAN.tolist(), "std": STD.tolist()}

    def mean_psnr(rec: torch.Tensor) -> float:
        return sum(basin.paired_psnr(rec.double(), x)) / 2

    flat = mean_psnr(MEAN.double()[:, None, None].expand_as(x))
    got = {tv: mean_psnr(attacks.create_attack("batch_match", iterations=40, tv=tv).reconstruct(model, update, meta).images)
           for tv in (0.0, 1.0)}
    # measured: mean colour 14.47 dB, tv 0 13.26 dB, tv 1 15.28 dB
    assert got[1.0] > got[0.0] + 1.0
    assert got[1.0] > flat


def test_presets_attack_a_batch_and_keep_batch_one_runs_unchanged() -> None:
    """The default and CIFAR presets name a batch attacker with min_batch_size 2: absent at B = 1
    (batch-1 tables and the golden rows unchanged), present at B > 1, so no preset's rows are all
    failed at B > 1; an attack list that leaves nothing at the run's B is a config error."""
    from benchmark.config import ConfigError, load_config, with_values
    from benchmark.entries import attack_entries
    from benchmark.validation import validate

    for preset in ("configs/default.yaml", "configs/cifar.yaml"):
        cfg = validate(load_config(preset))
        assert cfg.federation.batch_size == 1 and "batch_match" not in [a.name for a in attack_entries(cfg)]
        batched = validate(with_values(cfg, [(["federation", "batch_size"], 2)]))
        assert "batch_match" in [a.name for a in attack_entries(batched)], preset
    cifar = validate(with_values(validate(load_config("configs/cifar.yaml")), [(["federation", "batch_size"], 2)]))
    assert "block0_roots" in [a.name for a in attack_entries(cifar)]
    assert {m.name: m.april for m in cifar.models}["DeiT-std"] is None
    only = validate(load_config("configs/default.yaml"))
    with pytest.raises(ConfigError, match="no attack runs at federation.batch_size 1"):
        validate(with_values(only, [(["attacks"], [{"name": "batch_match", "min_batch_size": 2}])]))


# ------------------------------------------------------------------------ MJP clients at B > 1
TINY_MJP = dict(variant="mjp", img_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, num_classes=10)


def _mjp_client(B: int, seed: int, per_sample: bool = False) -> tuple:
    """A fresh tiny MJP model (float64), one plan for B bundled photographs (``model.draw_plan``),
    the shuffled photographs x~ [B, 3, 32, 32], their labels and the client's update of them."""
    from fedmjp.models import MJPVisionTransformer

    torch.manual_seed(0)
    model = MJPVisionTransformer(**TINY_MJP).eval().double()
    for blk in model.blocks:
        blk.attn.fused_attn = False
    plan = model.draw_plan(B, gamma=0.27, seed=seed, per_sample=per_sample)
    shuffled = model.shuffle_images(bundled_images(B, 32).double(), plan)
    y = torch.arange(B) + 1
    inputs = (shuffled - MEAN.double()[:, None, None]) / STD.double()[:, None, None]
    return model, plan, shuffled, y, attacks.compute_update(model, inputs, y, unk_mask=plan.mask)


@pytest.mark.parametrize("B", [2, 4])
def test_shared_shuffle_is_read_off_a_batch_update(B: int) -> None:
    """One shuffle for the batch (the clients' default): the zero rows of the batch's dL/dP are
    exactly its positions; per-image shuffles leave only their intersection readable."""
    from attacks.closed_form.mjp_update import read_mjp_update

    model, plan, _, _, update = _mjp_client(B, seed=B)
    assert bool((plan.mask == plan.mask[:1]).all()) and int(plan.mask[0].sum()) > 0
    S, _, _ = read_mjp_update(model, update)
    assert torch.equal(S, plan.mask[0])
    model, plan, _, _, update = _mjp_client(B, seed=B, per_sample=True)
    S, _, _ = read_mjp_update(model, update)
    assert torch.equal(S, plan.mask.all(0)) and int(S.sum()) < int(plan.mask.sum(1).min())


def test_batch_match_with_the_read_mask_beats_the_plain_forward() -> None:
    """B = 2, one shuffle for the batch: at the client's x~ the masked forward gives the update
    exactly and the plain forward does not; from the same start 30 L-BFGS iterations with the mask
    end at a lower gradient distance, and each candidate's jigsaw is solved (``unshuffled``)."""
    from attacks.optimization.batch_match import gradient_distance
    from attacks.optimization.breaching_adapter import matched_names

    model, plan, shuffled, y, update = _mjp_client(2, seed=3)
    names = matched_names(model, update, (3, 32, 32))  # the plain forward's parameters, as the attack matches
    params = dict(model.named_parameters())
    inputs = (shuffled - MEAN.double()[:, None, None]) / STD.double()[:, None, None]
    at_truth = {m: float(gradient_distance(model, [params[n] for n in names], [update[n] for n in names], y,
                                           None if m is None else plan.mask[0])(inputs).detach())
                for m in (None, "mask")}
    assert at_truth["mask"] < 1e-20 and at_truth[None] > 1e-6, at_truth
    meta = {"num_images": 2, "labels": y.tolist(), "mean": MEAN.tolist(), "std": STD.tolist()}
    got = {m: attacks.create_attack("batch_match", iterations=30, mjp_mask=m).reconstruct(model, update, meta)
           for m in (True, False)}
    # measured (plan seeds 1-3): 2.77e-4 / 2.96e-4, 2.67e-4 / 3.08e-4, 2.53e-4 / 3.08e-4
    assert got[True].stats[0]["objective"] < got[False].stats[0]["objective"]
    assert f"|S| = {int(plan.mask[0].sum())}" in " ".join(got[True].stats[0]["notes"])
    assert got[True].unshuffled is not None and got[True].unshuffled.shape == (2, 3, 32, 32)
    assert got[False].unshuffled is None


def test_batch_match_says_what_per_image_shuffles_leave_readable() -> None:
    """Per-image shuffles at B = 2: fewer zero rows than gamma implies; E_unk only at the
    intersection, no jigsaw, and the notes say so."""
    model, plan, _, y, update = _mjp_client(2, seed=3, per_sample=True)
    meta = {"num_images": 2, "labels": y.tolist(), "mean": MEAN.tolist(), "std": STD.tolist()}
    res = attacks.create_attack("batch_match", iterations=1).reconstruct(model, update, meta)
    notes = " ".join(res.stats[0]["notes"])
    inter = int(plan.mask.all(0).sum())
    assert res.stats[0]["shuffled_count"] == inter
    assert (f"only {inter} zero rows" in notes) if inter else ("no zero row" in notes), notes
    assert "not readable" in notes or "plain forward" in notes
    assert res.unshuffled is None

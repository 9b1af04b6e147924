"""What a row of results.jsonl means, end to end on tiny configs (in-process Flower engine, 32 px,
depth-2 models): Acc. on the model as trained and the attacked model's top-1, failure semantics and
exit status, batch pairing, several attackers, per-region columns, distribution statistics, and the
estimate each setting is scored on."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from helpers import register_condition_failure, write_config
from helpers import run as _run

import attacks
from attacks.api.base import Attack
from attacks.api.registry import register_attack
from benchmark import scoring
from fedmjp.stats import bootstrap_ci
from benchmark.store import read_jsonl
from fedmjp.data import load_images
from fedmjp.factory import build_model, model_input

ARCH = "mjp_vit_cifar_patch4_32"
MJP_ROW = {"name": "MJP", "arch": ARCH, "variant": "mjp", "kwargs": {"depth": 2}, "april": "surgery"}


def _config(tmp: Path, **changes) -> Path:
    """helpers.tiny_config with one MJP row, one round, one grid image; then ``changes``."""
    return write_config(tmp, **{"federation.rounds": 1, "models": [MJP_ROW], "report.grid_images": 1, **changes})


@register_attack("test_buggy")
class BuggyAttack(Attack):
    """An attack with a bug (raises ZeroDivisionError): must not make rows look private silently."""

    name = "test_buggy"

    def _reconstruct(self, model, update, meta):
        return 1 / 0


register_condition_failure("test_condition")  # an expected failure (AttackFailure) on every image


# ------------------------------------------------------------------ 1. Acc. on the model as trained
@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory) -> Path:
    """A depth-2 plain ViT fitted to 16 embedded images (100% top-1): a trained-looking model whose
    block-0 norm1 matters."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: intra-op threads only oversubscribe
    data = load_images("embedded", 32, 16, 10)
    model = build_model({"name": "t", "arch": ARCH, "variant": "plain", "kwargs": {"depth": 2}, "seed": 0})
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(60):
        opt.zero_grad()
        F.cross_entropy(model(model_input(model, data.images)), data.labels).backward()
        opt.step()
    torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("ckpt") / "plain.pt"
    torch.save(model.state_dict(), path)
    return path


def test_acc_is_measured_on_the_unmodified_model(trained_checkpoint: Path, tmp_path: Path) -> None:
    spec = {"name": "t", "arch": ARCH, "variant": "plain", "kwargs": {"depth": 2}, "seed": 0,
            "checkpoint": str(trained_checkpoint)}
    data = load_images("embedded", 32, 16, 10)
    plain, cut = build_model(spec), build_model({**spec, "april": "surgery"})
    with torch.no_grad():
        acc_plain = (plain(model_input(plain, data.images)).argmax(-1) == data.labels).float().mean()
        acc_cut = (cut(model_input(cut, data.images)).argmax(-1) == data.labels).float().mean()
    assert acc_plain == 1.0 and acc_cut < 0.8  # the surgery changes what the model predicts

    # 2 clients x batch 8 x 1 round: all 16 images, attacked at the checkpoint's weights (round 1)
    cfg = _config(tmp_path, **{"data.num_images": 16, "federation.batch_size": 8, "settings": ["a"],
                               "models": [{"name": "Plain", "arch": ARCH, "variant": "plain", "kwargs": {"depth": 2},
                                           "april": "surgery", "checkpoint": str(trained_checkpoint)}]})
    out = tmp_path / "out"
    assert _run(cfg, out) == 0
    rows = read_jsonl(out / "results.jsonl")
    assert len(rows) == 16 and all(r["failed"] for r in rows)  # APRIL's closed form needs batch size 1
    assert all("batch size 1" in r["reason"] and not r["error"] for r in rows)
    assert [r["correct"] for r in rows] == [1.0] * 16  # the model as trained
    assert math.isclose(np.mean([r["correct_attacked_model"] for r in rows]), float(acc_cut))  # what the attack saw
    table = (out / "table.md").read_text()
    assert pd.read_csv(out / "table.csv")["Acc. (%) ↑"].tolist() == [100.0]
    assert "norm1 and attention residual removed" in table


def test_attacked_model_top1_is_read_off_single_image_gradients(trained_checkpoint: Path, tmp_path: Path,
                                                                 monkeypatch) -> None:
    """Batch size 1, plain FedSGD: the attacked (surgery) model's prediction comes from the update's
    classifier-bias gradient, image by image equal to its forward pass, and the only forward the
    benchmark runs for Acc. is the unmodified model's (16 images, not 32)."""
    from benchmark import scoring

    forwarded = []
    original = scoring.top1_many
    monkeypatch.setattr(scoring, "top1_many",
                        lambda model, batches, device: forwarded.append(sum(len(b.labels) for b in batches))
                        or original(model, batches, device))
    spec = {"name": "t", "arch": ARCH, "variant": "plain", "kwargs": {"depth": 2}, "seed": 0,
            "checkpoint": str(trained_checkpoint)}
    cfg = _config(tmp_path, **{"data.num_images": 16, "federation.rounds": 8, "federation.lr": 0.0, "settings": ["a"],
                               "models": [{"name": "Plain", "arch": ARCH, "variant": "plain", "kwargs": {"depth": 2},
                                           "april": "surgery", "checkpoint": str(trained_checkpoint)}]})
    out = tmp_path / "out"
    assert _run(cfg, out) == 0
    rows = read_jsonl(out / "results.jsonl")
    assert len(rows) == 16 and sum(forwarded) == 16
    data = load_images("embedded", 32, 16, 10)
    cut = build_model({**spec, "april": "surgery"}).double()
    with torch.no_grad():
        logits = cut(model_input(cut, data.images.double()))
    by_id = {name: i for i, name in enumerate(data.names)}
    compared = 0
    for r in rows:
        i = by_id[r["image_id"]]
        top = logits[i].topk(2).values
        if float(top[0] - top[1]) > 1e-6:  # clear of float64 noise
            compared += 1
            assert r["correct_attacked_model"] == float(int(logits[i].argmax()) == int(data.labels[i]))
        assert r["correct"] == 1.0
    assert compared >= 12


# ------------------------------------------------------------------ 2. failures and exit status
def test_unexpected_attack_error_is_recorded_and_fails_the_run(tmp_path: Path, capsys) -> None:
    cfg = _config(tmp_path, attacks=[{"name": "april_analytic"}, {"name": "test_buggy"},
                                     {"name": "test_condition"}])
    out = tmp_path / "out"
    assert _run(cfg, out) == 8
    assert "unexpected attack error" in capsys.readouterr().err
    rows = pd.DataFrame(read_jsonl(out / "results.jsonl"))
    assert sorted(rows["attack"].unique()) == ["april_analytic", "test_buggy", "test_condition"]
    buggy = rows[rows["attack"] == "test_buggy"]
    assert buggy["failed"].all() and buggy["error"].all()
    assert buggy["reason"].str.contains("ZeroDivisionError").all()
    cond = rows[rows["attack"] == "test_condition"]
    assert cond["failed"].all() and not cond["error"].any()
    assert not rows[rows["attack"] == "april_analytic"]["failed"].any()
    tracebacks = list((out / "errors").glob("*.txt"))
    assert len(tracebacks) == 2 and all("ZeroDivisionError" in p.read_text() for p in tracebacks)
    # the tables were still written, one row per attacker (and the per-image strongest of them),
    # with the failure share: failed attackers never win the strongest row
    full = pd.read_csv(out / "table_full.csv")
    assert list(full["attack"]) == ["april_analytic", "test_buggy", "test_condition", "strongest"]
    assert list(full["n_error"]) == [0, 2, 0, 0] and list(full["n_failed"]) == [0, 2, 2, 0]
    assert full["winners"].iloc[-1] == "april_analytic 2/2"
    table = pd.read_csv(out / "table.csv")
    assert "Attack" in table.columns and list(table["n"]) == ["2", "2 (2 failed, 2 on errors)", "2 (2 failed)", "2"]
    # the grid has one row per model and attacker, and the strongest row
    from PIL import Image

    from benchmark.pictures import GridLayout, grid_columns

    width, height = Image.open(out / "grid_c.png").size
    least = GridLayout(4, len(grid_columns("c")), 32).size  # titles and captions may wrap onto more lines
    assert width == least[0] and height >= least[1]


def test_condition_failures_alone_keep_exit_status_zero(tmp_path: Path) -> None:
    assert _run(_config(tmp_path, **{"attack.name": "test_condition"}), tmp_path / "out", "--dry-run") == 0


# ------------------------------------------------------------------ 3. batch pairing
def test_pairing_undoes_a_label_sort() -> None:
    data = load_images("embedded", 32, 8, 10)
    x = data.images[[3, 0, 2, 1]]
    labels = torch.tensor([7, 2, 9, 4])
    sort = labels.argsort()  # breaching's adapter returns the batch in label order
    g = torch.Generator().manual_seed(0)
    recon = (x[sort] + 0.1 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    order = scoring.pair_reconstructions(recon, x)
    assert torch.equal(sort[torch.tensor(order)], torch.arange(4))
    assert order != [0, 1, 2, 3]
    # a failed (zeroed) reconstruction never takes a reference from a usable one
    failed_recon = recon.clone()
    failed_recon[0] = 0.0
    flags = [True, False, False, False]
    order = scoring.pair_reconstructions(failed_recon, x, flags)
    assert all(sort[order[b]] == b for b in range(4) if not flags[order[b]])
    with pytest.raises(ValueError, match="one image per image"):
        scoring.pair_reconstructions(recon[:3], x)


def test_batch_of_four_rows_record_their_pairing(tmp_path: Path) -> None:
    cfg = _config(tmp_path, **{"data.num_images": 8, "federation.batch_size": 4, "federation.precision": "float32",
                               "attack.name": "invertinggradients", "attack.options": {"iterations": 2}})
    out = tmp_path / "out"
    assert _run(cfg, out) == 0
    rows = pd.DataFrame(read_jsonl(out / "results.jsonl"))
    assert len(rows) == 8
    for _, update in rows.groupby(["round", "partition_id"]):
        assert sorted(update["recon_index"]) == [0, 1, 2, 3]
        assert sorted(update["batch_index"]) == [0, 1, 2, 3]


# ------------------------------------------------------------------ 4-6. regions, several attackers, shape
def test_mjp_rows_carry_region_scores_and_shape_statistics(tmp_path: Path) -> None:
    cfg = _config(tmp_path, settings=["a", "b", "c"])
    out = tmp_path / "out"
    assert _run(cfg, out) == 0
    rows = pd.DataFrame(read_jsonl(out / "results.jsonl"))
    shuffled = rows[rows["setting"].isin(["b", "c"])]
    for col in ("psnr_unshuffled", "psnr_shuffled", "mse_unshuffled", "ssim_shuffled"):
        assert shuffled[col].notna().all(), col
    assert rows[rows["setting"] == "a"].get("psnr_shuffled", pd.Series(dtype=float)).isna().all()
    # x and x~ agree outside S and hold the same patch set on S: the region scores of one
    # reconstruction are the same against x~ (b) and x (c), while the whole-image scores differ
    b = shuffled[shuffled["setting"] == "b"].set_index("image_id")
    c = shuffled[shuffled["setting"] == "c"].set_index("image_id")
    for image_id, r in b.iterrows():
        for col in ("mse_unshuffled", "mse_shuffled"):
            assert math.isclose(r[col], c.loc[image_id, col], rel_tol=1e-6, abs_tol=1e-12), col
    assert not np.allclose(b["fft2d"], c.loc[b.index, "fft2d"])
    full = pd.read_csv(out / "table_full.csv")
    for col in ("psnr_median", "psnr_ci_low", "psnr_ci_high", "recognisable_ssim", "recognisable_lpips",
                "psnr_unshuffled_mean", "mse_shuffled_mean"):
        assert col in full.columns, col
    assert (full["psnr_ci_low"] <= full["psnr_mean"] + 1e-9).all()
    assert (full["psnr_mean"] <= full["psnr_ci_high"] + 1e-9).all()
    paper = pd.read_csv(out / "table.csv")
    assert list(paper.columns)[:3] == ["Model", "Setting", "Acc. (%) ↑"]  # one attacker: no Attack column
    for s in "abc":
        assert (out / f"dist_{s}.png").is_file()


def test_bootstrap_interval_is_seeded_and_brackets_the_mean() -> None:
    v = np.array([1.0, 2.0, 3.0, 10.0, 4.0])
    lo, hi = bootstrap_ci(v)
    assert (lo, hi) == bootstrap_ci(v) and lo < v.mean() < hi
    assert all(math.isnan(t) for t in bootstrap_ci(np.array([])))


@register_attack("test_constant")
class ConstantAttack(Attack):
    """Returns grey 0.25 as the client's input and grey 0.75 as its estimate of x (``unshuffled``)."""

    name = "test_constant"

    def _reconstruct(self, model, update, meta):
        n, size = meta.num_images, meta.image_size
        return attacks.AttackResult(torch.full((n, *size), 0.25), [{} for _ in range(n)],
                                    unshuffled=torch.full((n, *size), 0.75))


def test_unshuffled_estimate_scores_setting_c(tmp_path: Path) -> None:
    """Setting (c) is scored on AttackResult.unshuffled, (b) on images."""
    out = tmp_path / "out"
    assert _run(_config(tmp_path, settings=["b", "c"], **{"attack.name": "test_constant"}), out, "--dry-run") == 0
    rows = {r["setting"]: r for r in read_jsonl(out / "results.jsonl")}
    data = load_images("embedded", 32, 4, 10)
    x = data.images[data.names.index(rows["c"]["image_id"])].double()
    # x~ permutes x's patches, so a constant image is as far from x~ as from x
    assert math.isclose(rows["b"]["mse"], float(((x - 0.25) ** 2).mean()), rel_tol=1e-5)
    assert math.isclose(rows["c"]["mse"], float(((x - 0.75) ** 2).mean()), rel_tol=1e-5)
    assert rows["b"]["scored_estimate"] == "images" and rows["c"]["scored_estimate"] == "unshuffled"

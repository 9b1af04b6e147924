"""Evaluation: Consistency / Diff. Norm semantics, a hand count on a trained model, the CLI outputs."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import timm
import torch
from torch.utils.data import DataLoader, TensorDataset

import fedmjp  # noqa: F401  (registers mjp_* models)
from fedmjp.evaluate import (
    draw_eval_plan,
    evaluate_gammas,
    evaluate_model,
    main as evaluate_main,
    plan_rng,
)
from fedmjp.train import run_training
from fedmjp.trainutils import model_from_checkpoint

from helpers import make_imagefolder, tiny_train_config as tiny_config

SMALL = dict(depth=2, embed_dim=48, num_heads=3, num_classes=5)


def random_loader(n: int = 12, batch: int = 4, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def test_no_position_embedding_is_shuffle_invariant():
    """Without PEs, a [CLS] readout over permuted tokens is permutation invariant."""
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="nope", **SMALL).eval()
    rows = evaluate_gammas(model, random_loader(), [0.27, 0.5, 1.0], seed=3)
    for row in rows:
        assert row["consistency"] == 100.0
        assert row["diff_norm"] < 1e-4
        assert row["top1"] == row["top1_shuffled"]


def test_position_embedding_breaks_invariance():
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="mjp", **SMALL).eval()
    with torch.no_grad():  # make the PE and E_unk matter
        model.pos_embed.normal_(0, 1.0)
        model.unk_embed.normal_(0, 1.0)
    zero, half = evaluate_gammas(model, random_loader(), [0.0, 0.5], seed=3)
    assert zero["consistency"] == 100.0 and zero["diff_norm"] < 1e-5
    assert half["diff_norm"] > 1e-2


def test_reproducible_and_sweep_rows_match_single_gamma():
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="jp_unk", **SMALL).eval()
    with torch.no_grad():
        model.pos_embed.normal_(0, 1.0)
    a = evaluate_model(model, random_loader(), gamma=0.5, seed=7)
    b = evaluate_model(model, random_loader(), gamma=0.5, seed=7)
    sweep = evaluate_gammas(model, random_loader(), [0.1, 0.5, 0.9], seed=7)
    assert a == b == sweep[1]


def test_per_image_outputs_reproduce_the_figures():
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="mjp", **SMALL).eval()
    with torch.no_grad():
        model.pos_embed.normal_(0, 1.0)
        model.unk_embed.normal_(0, 1.0)
    plain = evaluate_gammas(model, random_loader(n=30, batch=7), [0.27, 0.9], seed=2)
    rows = evaluate_gammas(model, random_loader(n=30, batch=7), [0.27, 0.9], seed=2, per_image=True)
    for row, ref in zip(rows, plain):
        pi = row["per_image"]
        assert {k: v for k, v in row.items() if k != "per_image"} == ref  # the flag adds the arrays and changes nothing else
        assert {k: (v.shape, v.dtype.kind) for k, v in pi.items()} == {
            "correct": ((30,), "b"), "correct_shuffled": ((30,), "b"), "agree": ((30,), "b"),
            "diff_norm": ((30,), "f")}
        assert 100 * pi["correct"].mean() == pytest.approx(ref["top1"])
        assert 100 * pi["correct_shuffled"].mean() == pytest.approx(ref["top1_shuffled"])
        assert 100 * pi["agree"].mean() == pytest.approx(ref["consistency"])
        assert pi["diff_norm"].mean() == pytest.approx(ref["diff_norm"], rel=1e-5)
    assert rows[1]["per_image"]["diff_norm"].min() > 0  # every image moved: the per-image values are not a constant


def test_plain_timm_vit_is_supported():
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, **SMALL).eval()
    row = evaluate_model(model, random_loader(), gamma=0.5, seed=0)
    assert row["images"] == 12 and 0.0 <= row["consistency"] <= 100.0 and row["diff_norm"] > 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny MJP model trained for 2 epochs on a 2-class ImageFolder."""
    root = tmp_path_factory.mktemp("eval")
    data = make_imagefolder(root / "data")
    result = run_training(tiny_config(data, root / "run"), progress=False)
    return data, result.checkpoint


def test_matches_hand_count_on_trained_model(trained):
    """Recount with independent primitives: pixel-shuffled x~ and an explicit E_unk mask."""
    data, ckpt = trained
    model, state = model_from_checkpoint(ckpt)
    from fedmjp.evaluate import build_eval_loader

    loader = build_eval_loader(state["config"], str(data), batch_size=5, num_workers=0)
    gamma, seed = 0.5, 11
    got = evaluate_model(model, loader, gamma=gamma, seed=seed)

    rng = plan_rng(seed, gamma)
    n = correct = correct_s = agree = 0
    norms = []
    with torch.no_grad():
        for x, y in loader:
            plan = draw_eval_plan(model, x.shape[0], gamma, rng)
            x_tilde = model.shuffle_images(x, plan)
            logits = model(x)
            logits_s = model(x_tilde, unk_mask=plan.mask)
            cls = model.forward_features(x)[:, 0]
            cls_s = model.forward_features(x_tilde, unk_mask=plan.mask)[:, 0]
            for i in range(x.shape[0]):
                p, ps = int(logits[i].argmax()), int(logits_s[i].argmax())
                n += 1
                correct += p == int(y[i])
                correct_s += ps == int(y[i])
                agree += p == ps
                norms.append(float(torch.linalg.vector_norm(cls[i] - cls_s[i])))
    assert got["images"] == n == 16
    assert got["top1"] == pytest.approx(100.0 * correct / n)
    assert got["top1_shuffled"] == pytest.approx(100.0 * correct_s / n)
    assert got["consistency"] == pytest.approx(100.0 * agree / n)
    assert got["diff_norm"] == pytest.approx(sum(norms) / n, rel=1e-4, abs=1e-6)


def test_cli_writes_json_csv_and_png(trained, tmp_path):
    data, ckpt = trained
    out = tmp_path / "eval"
    assert evaluate_main(["--checkpoint", str(ckpt), "--data-path", str(data), "--gamma", "0.27",
                          "--gamma-sweep", "0,0.5,1", "--num-workers", "0", "--output-dir", str(out)]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["gamma"] == 0.27 and result["images"] == 16 and result["epoch"] == 2
    with open(out / "gamma_sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["gamma"]) for r in rows] == [0.0, 0.5, 1.0]
    assert float(rows[0]["consistency"]) == 100.0 and float(rows[0]["diff_norm"]) == 0.0
    assert (out / "gamma_sweep.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("extra, named", [
    (["--checkpoint", "{missing}"], "--checkpoint"),
    (["--checkpoint", "{not_torch}"], "not a PyTorch weights file"),
    (["--data-path", "{nowhere}"], "--data-path"),
    (["--split", "nope"], "split 'nope'"),
    (["--device", "cuda:99"], "cuda:99"),
    (["--output-dir", "/proc/fedmjp-eval"], "--output-dir"),
    (["--gamma", "2"], "--gamma"),
    (["--gamma-sweep", "0,x"], "--gamma-sweep"),
    (["--max-images", "0"], "--max-images"),
    (["--batch-size", "0"], "--batch-size"),
    (["--num-workers", "-1"], "--num-workers"),
])
def test_cli_refuses_bad_input_in_one_line(trained, tmp_path, capsys, extra, named):
    """Each bad argument, checkpoint, data path, split, device or output dir: exit status 2, one line
    on stderr naming it, no traceback and nothing written."""
    data, ckpt = trained
    not_torch = tmp_path / "notes.pth"
    not_torch.write_text("not a checkpoint")
    values = {"missing": str(tmp_path / "none.pth"), "not_torch": str(not_torch), "nowhere": str(tmp_path / "nowhere")}
    out = tmp_path / "eval"
    args = {"--checkpoint": str(ckpt), "--data-path": str(data), "--num-workers": "0", "--output-dir": str(out)}
    args.update(zip(extra[::2], (v.format(**values) for v in extra[1::2])))
    try:
        status = evaluate_main([x for kv in args.items() for x in kv])
    except SystemExit as stop:  # argparse's own refusal of an argument's value
        status = stop.code
    err = capsys.readouterr().err
    assert status == 2 and named in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1
    assert not out.exists()


@pytest.mark.parametrize("flag, value, words", [
    ("--threads", "1000000", ["--threads", "[1, 1,024]"]),  # 1e6 threads: MemoryError
    ("--num-workers", "100000", ["--num-workers", "[0, 256]"]),
    ("--gamma-sweep", ",".join(["0.5"] * 500), ["--gamma-sweep", "500 values", "at most 101"]),
    ("--split", "../../etc", ["--split", "folder name inside --data-path"]),
])
def test_cli_bounds_and_split_names_are_checked_before_loading(tmp_path, capsys, flag, value, words):
    """Sizes are bounded and the split is a folder name inside the data root (no path out of it):
    refused by the argument parser (exit 2) before the checkpoint or any image is read."""
    from fedmjp.evaluate import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(tmp_path / "missing.pth"), "--data-path", str(tmp_path), flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err

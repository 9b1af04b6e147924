"""run_benchmark.py end to end on tiny configs (in-process Flower engine, 32 px, depth-2 models).

Covers: --dry-run runs every stage once; tables are the means of results.jsonl; the grid layout;
a killed run resumes to the same table (and the recomputed rows equal the lost ones: same seed,
same metrics); a different config in the same folder is refused; every bad input gets its own clear
message and exit status without touching finished work.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Literal, Union

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from helpers import assert_same_scores, metric_rows, run, tiny_config, write_config
from PIL import Image
from pydantic import BaseModel

from benchmark import config as C
from benchmark.entries import model_spec
from benchmark.validation import validate
from benchmark.pictures import GridLayout, grid_columns
from benchmark.tables import to_latex
from benchmark.store import read_jsonl
from fedmjp.config import keys

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """An uninterrupted run of settings a, b, c (4 federations, 4 images each)."""
    folder = tmp_path_factory.mktemp("full")
    assert run(write_config(folder), folder / "out", "--setting", "all") == 0
    return folder / "out"


# ---------------------------------------------------------------------------------------- config
def test_overrides_are_yaml_values_and_unknown_keys_list_valid_ones() -> None:
    cfg = C.apply_overrides(C.load_config(), ["federation.rounds=3", "gamma=0.5", "data.num_images=null",
                                              "attack.options.precision=float32"])
    assert cfg["federation"]["rounds"] == 3 and cfg["gamma"] == 0.5 and cfg["data"]["num_images"] is None
    assert cfg["attack"]["options"] == {"precision": "float32"}
    with pytest.raises(C.ConfigError, match="valid keys here: .*rounds"):
        C.apply_overrides(cfg, ["federation.roundz=3"])
    with pytest.raises(C.ConfigError, match="key=value"):
        C.apply_overrides(cfg, ["gamma"])
    # a value that looks like code stays a string
    assert C.apply_overrides(cfg, ["name=__import__('os').system('true')"])["name"].startswith("__import__")


def test_presets_validate() -> None:
    quick = validate(C.load_config())
    assert [m.name for m in quick.models] == ["ViT", "DeiT", "DeiT-noPE", "DeiT+MJP", "DeiT-std"]
    assert quick.models[-1].april is None  # a standard pre-norm DeiT: no surgery needed
    # every preset runs the patch-embedding closed form next to APRIL's
    for name in ("default", "paper", "cifar", "defences", "defences_cifar"):
        cfg = quick if name == "default" else validate(C.load_config(ROOT / "configs" / f"{name}.yaml"))
        assert {"april_analytic", "pe_closed_form"} <= {a.name for a in cfg.attacks}, name
    paper = validate(C.load_config(ROOT / "configs" / "paper.yaml"))
    assert paper.data.image_size == 224 and paper.data.num_images == 999
    assert paper.gamma == 0.27 and paper.settings == ["a", "b", "c"]
    # the ImageNet sample in the data folder: $FEDMJP_DATA/imagenet-sample (tests/test_datadir.py)
    assert paper.data.source.endswith("imagenet-sample")
    assert len(paper.models) == 5 and all(m.april == "surgery" for m in paper.models)
    fed = paper.federation
    assert fed.rounds * fed.clients * fed.batch_size == 999
    assert "block0_roots" in {a.name for a in paper.attacks}  # design A at T = 197: a failed row naming the bound
    # the as-trained block 0 at 224 px, on the shipped 224 px checkpoints (docs/checkpoints.md)
    std = validate(C.load_config(ROOT / "configs" / "paper_std.yaml"))
    assert std.data.image_size == 224 and std.federation.batch_size == 1 and std.federation.precision == "float64"
    assert [m.april for m in std.models] == [None, None] and {m.variant for m in std.models} == {"plain", "mjp"}
    assert all((ROOT / str(m.checkpoint)).is_file() for m in std.models)
    assert std.attacks[0].name == "block0_roots"


# ---------------------------------------------------------------------------------------- runs
def test_dry_run_runs_every_stage_once(tmp_path: Path) -> None:
    out = tmp_path / "dry"
    assert run(write_config(tmp_path), out, "--dry-run", "--setting", "all") == 0
    rows = read_jsonl(out / "results.jsonl")
    # one update (round 1, partition 0) per federation: 2 models x (a | b, c)
    assert {(r["model"], r["setting"]) for r in rows} == {(m, s) for m in ("DeiT", "DeiT+MJP") for s in "abc"}
    assert {(r["round"], r["partition_id"]) for r in rows} == {(1, 0)}
    for name in ("table.csv", "table.md", "table.tex", "table_full.csv", "config.yaml",
                 "grid_a.png", "grid_b.png", "grid_c.png"):
        assert (out / name).is_file(), name
    assert yaml.safe_load((out / "config.yaml").read_text())["dry_run"] is True


def test_tables_are_means_of_results(full_run: Path) -> None:
    rows = pd.DataFrame(read_jsonl(full_run / "results.jsonl"))
    assert len(rows) == 2 * 3 * 4  # models x settings x attacked images
    assert rows["image_id"].nunique() == 4 and not rows["failed"].any()
    # the flat-image floor depends on the image alone: x~ in (b) permutes the pixels of x
    spread = rows.groupby("image_id")["flat_psnr"].agg(lambda v: float(v.max() - v.min()))
    assert float(spread.max()) < 1e-9 and rows["flat_psnr"].between(5, 40).all()
    full = pd.read_csv(full_run / "table_full.csv")
    table = pd.read_csv(full_run / "table.csv", dtype=str)
    assert len(full) == len(table) == 6
    for i, r in full.iterrows():
        g = rows[(rows["model"] == r["model"]) & (rows["setting"] == r["setting"])]
        assert r["n"] == len(g)
        # LPIPS where weights exist ($FEDMJP_DATA/lpips, torchvision's cache); else the column is empty
        for m in ("mse", "fft2d", "ssim", "lpips")[: 4 if g["lpips"].notna().any() else 3]:
            assert r[f"{m}_mean"] == pytest.approx(g[m].astype(float).mean(), rel=1e-9, abs=1e-15)
            assert r[f"{m}_count"] == len(g)
        assert r["psnr_mean"] == pytest.approx(np.minimum(g["psnr"].astype(float), 100.0).mean(), rel=1e-9)
        assert r["acc_mean"] == pytest.approx(g["correct"].mean())
        assert table.loc[i, "MSE ↑"] == f"{g['mse'].astype(float).mean():.4f}"
        assert r["flat_psnr_mean"] == pytest.approx(g["flat_psnr"].astype(float).mean(), rel=1e-12)
        assert table.loc[i, "PSNR flat"] == f"{g['flat_psnr'].astype(float).mean():.2f}"
        assert table.loc[i, "Model"].endswith("(untrained)")
    # the unprotected model leaks completely in (a) and (b); MJP takes the leak away in (b)
    plain_a = full[(full["model"] == "DeiT") & (full["setting"] == "a")].iloc[0]
    mjp_b = full[(full["model"] == "DeiT+MJP") & (full["setting"] == "b")].iloc[0]
    assert plain_a["psnr_mean"] == pytest.approx(100.0) and mjp_b["psnr_mean"] < 20.0
    md, tex = (full_run / "table.md").read_text(), (full_run / "table.tex").read_text()
    assert "PSNR ↓" in md and r"PSNR $\downarrow$" in tex and "LPIPS ↑" in md


def test_latex_table_is_an_escaped_booktabs_tabular() -> None:
    table = pd.DataFrame([{"Model": "ViT_S & co (untrained)", "Attack": "april_analytic", "Setting": "(a)",
                           "Acc. (%) ↑": "12.5", "PSNR ↓": "—", "n": "8 (8 failed), #1 ~"}])
    lines = to_latex(table).splitlines()
    assert lines[:2] == [r"\begin{tabular}{lllrrr}", r"\toprule"] and lines[3] == r"\midrule"
    assert lines[-2:] == [r"\bottomrule", r"\end{tabular}"]
    cells = [[c.strip() for c in line.removesuffix(r"\\").split(" & ")] for line in (lines[2], lines[4])]
    assert cells == [["Model", "Attack", "Setting", r"Acc. (\%) $\uparrow$", r"PSNR $\downarrow$", "n"],
                     [r"ViT\_S \& co (untrained)", r"april\_analytic", "(a)", "12.5", "—",
                      r"8 (8 failed), \#1 \textasciitilde{}"]]


def test_grid_layout(full_run: Path) -> None:
    for setting in "abc":
        img = Image.open(full_run / f"grid_{setting}.png")
        cols = 2 * len(grid_columns(setting))  # 2 images x (x, [x~,] recon.)
        assert img.size == GridLayout(n_rows=2, n_cols=cols, tile=32).size
    # one reconstruction per model x setting x image (stored per attacker and setting)
    assert len(list((full_run / "images").rglob("*__rec-april_analytic-*.png"))) == 2 * 3 * 2


def test_killed_run_resumes_to_the_same_table(full_run: Path, tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    shutil.copytree(full_run, killed)
    lines = (killed / "results.jsonl").read_text().splitlines(keepends=True)
    # keep 7 rows (mid-federation) plus a torn line: what a kill during a write leaves behind
    (killed / "results.jsonl").write_text("".join(lines[:7]) + lines[7][:40])
    for name in ("table.csv", "table_full.csv", "table.md", "grid_c.png"):
        (killed / name).unlink()
    shutil.rmtree(killed / "images")
    config = killed / "config.yaml"
    assert run(config, killed, "--setting", "all") == 0
    assert (killed / "table.csv").read_text() == (full_run / "table.csv").read_text()
    # same seed on CPU: the recomputed rows equal the ones the "kill" lost
    assert_same_scores(metric_rows(killed / "results.jsonl"), metric_rows(full_run / "results.jsonl"))
    assert (killed / "grid_c.png").is_file()
    # a finished run re-run changes nothing
    before = (killed / "results.jsonl").read_text()
    assert run(config, killed, "--setting", "all") == 0
    assert (killed / "results.jsonl").read_text() == before


def test_different_config_in_same_folder_is_refused(full_run: Path, capsys) -> None:
    before = (full_run / "results.jsonl").read_text()
    assert run(full_run / "config.yaml", full_run, "--setting", "all", "--gamma", "0.5") == 6
    assert "gamma: 0.27 -> 0.5" in capsys.readouterr().err
    assert (full_run / "results.jsonl").read_text() == before


# ---------------------------------------------------------------------------------------- bad input
def _image_folder(folder: Path) -> Path:
    """Good images of every awkward kind, a non-image file and a corrupt JPEG."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(folder / "a_rgb.png")
    Image.fromarray(rng.integers(0, 255, (64, 48), dtype=np.uint8), "L").save(folder / "b_grey.jpg")
    Image.fromarray(rng.integers(0, 255, (36, 36, 4), dtype=np.uint8), "RGBA").save(folder / "c_rgba.png")
    Image.fromarray(rng.integers(0, 255, (12, 20, 3), dtype=np.uint8)).save(folder / "d_small.png")
    (folder / "e_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (folder / "notes.txt").write_text("not an image")
    return folder


def test_image_folder_skips_and_converts(tmp_path: Path, caplog, capsys) -> None:
    images = _image_folder(tmp_path / "imgs")
    config = write_config(tmp_path, **{"federation.rounds": 1, "federation.clients": 4, "settings": ["a"],
                                       "data.num_images": None})
    out = tmp_path / "out"
    assert run(config, out, "--images", str(images), "--models", "DeiT") == 0
    rows = read_jsonl(out / "results.jsonl")
    # greyscale, RGBA and small images are converted and resized, and attacked like the others
    assert {r["image_id"] for r in rows} == {"a_rgb.png", "b_grey.jpg", "c_rgba.png", "d_small.png"}
    assert not any(r["failed"] for r in rows)
    logged = caplog.text
    assert "e_broken.jpg" in logged and "notes.txt" in logged
    # fatal per flag: exit 4, the file named
    capsys.readouterr()
    assert run(config, tmp_path / "out2", "--images", str(images), "--on-corrupt", "fail") == 4
    assert "corrupt image" in capsys.readouterr().err


@pytest.mark.parametrize("argv, code, message", [
    (["--images", "/nonexistent/folder"], 4, "does not exist"),
    (["--models", "DeiT", "ResNet"], 3, r"valid: DeiT, DeiT\+MJP"),
    (["--attack", "nope"], 3, "valid: .*april_analytic"),
    (["--set", "federation.engine=ray"], 3, "valid: inprocess, simulation"),
    (["--set", "models.0.variant=xxl"], 3, "valid: plain"),
    (["--set", "models.0.checkpoint=/nonexistent/ckpt.pth"], 5, "does not exist"),
])
def test_bad_input_exit_codes(tmp_path: Path, capsys, argv, code, message) -> None:
    assert run(write_config(tmp_path), tmp_path / "out", *argv) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err), err
    assert not (tmp_path / "out").exists()  # nothing written for a run that cannot start


def test_empty_folder_and_unknown_setting(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert run(write_config(tmp_path), tmp_path / "out", "--images", str(tmp_path / "empty")) == 4
    assert "holds no image files" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        run(write_config(tmp_path), tmp_path / "out", "--setting", "d")
    assert exc.value.code == 2
    assert "invalid choice: 'd'" in capsys.readouterr().err


def test_mismatched_checkpoint_keeps_finished_work(full_run: Path, tmp_path: Path, capsys) -> None:
    # A checkpoint of another architecture: exit 5 with the mismatched keys named.
    other = torch.nn.Linear(3, 3)
    ckpt = tmp_path / "other.pth"
    torch.save(other.state_dict(), ckpt)
    assert run(write_config(tmp_path), tmp_path / "out", "--set", f"models.1.checkpoint={ckpt}") == 5
    assert "missing from checkpoint" in capsys.readouterr().err
    # A checkpoint that disappears before a resume: exit 5, stored rows untouched.
    good = tmp_path / "deit.pth"
    from fedmjp.factory import build_model

    spec = model_spec(validate(C.load_config(write_config(tmp_path))), 0)
    torch.save(build_model(dict(spec, april=None)).state_dict(), good)  # a standard trained model
    config = write_config(tmp_path / "c2", **{"federation.rounds": 1, "models": [
        dict(tiny_config()["models"][0], checkpoint=str(good))]})
    out = tmp_path / "resume"
    assert run(config, out) == 0
    before = (out / "results.jsonl").read_text()
    assert "(untrained)" not in (out / "table.md").read_text()
    good.unlink()
    assert run(out / "config.yaml", out) == 5
    assert (out / "results.jsonl").read_text() == before


@pytest.mark.slow
def test_script_exit_status(tmp_path: Path) -> None:
    """The real entry script: a missing image folder exits 4 with one clear line."""
    proc = subprocess.run([sys.executable, str(ROOT / "run_benchmark.py"), "--images", str(tmp_path / "none"),
                           "--output", str(tmp_path / "out"), "--no-progress"],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert "error: image folder" in proc.stderr


@pytest.mark.slow
def test_flower_simulation_engine_gives_the_same_rows(full_run: Path, tmp_path: Path) -> None:
    """One federation through Flower's Ray simulation: the same rows as the in-process engine."""
    out = tmp_path / "sim"
    assert run(full_run / "config.yaml", out, "--setting", "a", "--models", "DeiT", "--engine", "simulation") == 0
    sim = metric_rows(out / "results.jsonl")
    ref = [r for r in metric_rows(full_run / "results.jsonl") if r["model"] == "DeiT" and r["setting"] == "a"]
    assert len(sim) == 4
    drop = ("node_id",)  # Flower assigns node ids per engine
    strip = lambda rows: [{k: v for k, v in r.items() if k not in drop} for r in rows]
    assert_same_scores(strip(sim), strip(ref))


def test_failed_client_becomes_failed_rows(tmp_path: Path) -> None:
    """A client that raises: its images are failed rows with the server's reason, the tables are
    written, and the exit status (7) says the rows are to be resumed."""
    config = write_config(tmp_path, **{"federation.rounds": 1, "settings": ["a"]})
    out = tmp_path / "out"
    assert run(config, out, "--models", "DeiT", "--set", "federation.options={fail-partition: 1}") == 7
    rows = read_jsonl(out / "results.jsonl")
    failed = [r for r in rows if r["failed"]]
    assert len(rows) == 2 and len(failed) == 1 and failed[0]["partition_id"] == 1
    assert "client failed" in failed[0]["reason"] and "injected failure" in failed[0]["reason"]
    assert "2 (1 failed)" in (out / "table.md").read_text()


# ---------------------------------------------------------------------------------------- value fuzzing
def _leaf_keys(schema: type = C.BenchmarkConfig, where: str = "") -> list[tuple[str, object]]:
    """Every key of the schema with its type (sections walked; free-form mappings are leaves)."""
    out = []
    for key, info in keys(schema).items():
        tp = info.annotation
        section = isinstance(tp, type) and issubclass(tp, BaseModel)
        out += _leaf_keys(tp, f"{where}{key}.") if section else [(f"{where}{key}", tp)]
    return out


def _wrong_values(tp: object) -> list[str]:
    """YAML texts of a type the key does not take."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Union:
        if type(None) in args:
            return ["[1, 2]", "{a: 1}"]
        tp = args[0]  # settings: a list (or "all"); sweep: a mapping (or a list of points)
        tp = typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp
    if tp is bool:
        return ["abc", "3"]
    if tp in (int, float):
        return ["abc", "[1]", "{a: 1}", "true"]
    if tp is str or typing.get_origin(tp) is Literal:
        return ["[1, 2]", "{a: 1}"]
    if typing.get_origin(tp) is list:
        return ["5", "{a: 1}"]
    return ["5", "abc", "[1]"]  # mappings


def _is_str(tp: object) -> bool:
    return tp is str or typing.get_origin(tp) is Union and str in typing.get_args(tp)


FUZZ_CASES = ([(key, value) for key, tp in _leaf_keys() if key != "models" for value in _wrong_values(tp)]
              + [(f"models.0.{key}", value) for key, tp in _leaf_keys(C.ModelRowConfig)
                 for value in (["[1, 2]"] if _is_str(tp) else ["abc", "[1]"])]
              + [("federation.partition", "foo"), ("federation.lr", "abc"), ("federation.lr", "-1"),
                 ("federation.lr", ".nan"), ("gamma", ".nan"), ("federation.options", "{no-such-key: 1}"),
                 ("federation.options", "{lr: abc}"), ("models.0.kwargs", "{depth: abc}"),
                 ("models.0.kwargs", "{no_such_kwarg: 1}"), ("attack.options", "{no_such_option: 1}"),
                 ("models", "5"), ("data", "5"), ("device", "''"),
                 ("attacks", "[{name: nope}]"), ("attacks", "[{name: april_analytic, options: {no_such_option: 1}}]"),
                 ("attacks", "[{name: april_analytic}, {name: april_analytic}]"), ("attacks", "[{label: x}]")])


@pytest.mark.parametrize("key, value", FUZZ_CASES)
def test_every_wrong_value_is_a_clear_error_before_anything_is_written(tmp_path: Path, capsys, key, value) -> None:
    """Any value a user can type into --set: a one-line error and its exit status, no traceback,
    nothing written (so the corrected command with the same --output is not refused)."""
    out = tmp_path / "out"
    code = run(write_config(tmp_path), out, "--set", f"{key}={value}", "--models", "DeiT", "--setting", "a")
    err = capsys.readouterr().err
    assert code in (3, 4, 5), (key, value, code, err)
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert not out.exists()


def test_bad_lpips_cache_budget_is_a_clear_error_before_anything_is_written(tmp_path: Path, monkeypatch,
                                                                            capsys) -> None:
    monkeypatch.setenv("FEDMJP_LPIPS_CACHE_MB", "4GB")
    out = tmp_path / "out"
    assert run(write_config(tmp_path), out, "--models", "DeiT", "--setting", "a") == 3
    err = capsys.readouterr().err
    assert err.startswith("error: FEDMJP_LPIPS_CACHE_MB must be a whole number of megabytes >= 0, got '4GB'"), err
    assert not out.exists()


def test_corrected_command_runs_after_a_bad_value(tmp_path: Path) -> None:
    config = write_config(tmp_path, **{"federation.rounds": 1, "federation.clients": 2})
    out = tmp_path / "out"
    assert run(config, out, "--models", "DeiT", "--setting", "a", "--set", "federation.partition=foo") == 3
    # a Dirichlet split of 4 images over 2 clients cannot work: also caught before anything is written
    assert run(config, out, "--models", "DeiT", "--setting", "a", "--set", "federation.partition=dirichlet") == 3
    assert run(config, out, "--models", "DeiT", "--setting", "a", "--set", "federation.partition=iid") == 0


def test_without_any_lpips_weights_the_run_completes_and_says_why(tmp_path: Path, monkeypatch, capsys) -> None:
    """A user without a data folder, without a torch hub cache and without a network: exit 0, the LPIPS
    column is empty, every row and the table say why, the other metrics are there."""
    from metrics import perceptual

    monkeypatch.delenv(perceptual.BACKBONE_ENV, raising=False)
    monkeypatch.delenv(perceptual.DATA_ENV, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.setattr(perceptual, "installed_trunk_file", lambda: tmp_path / "no_installed_trunk.pth")
    # nothing listens on port 9 of this machine: the download fails at once, as it does offline
    monkeypatch.setattr(perceptual, "TORCHVISION_ALEXNET_URL", "http://127.0.0.1:9/alexnet-owt-7be5be79.pth")
    config = write_config(tmp_path, **{"federation.rounds": 1, "metrics": {"lpips_backbone": None}})
    out = tmp_path / "out"
    assert run(config, out, "--models", "DeiT", "--setting", "a") == 0
    rows = read_jsonl(out / "results.jsonl")
    assert rows and all(not r["failed"] and r["lpips"] is None and r["psnr"] > 100 for r in rows)  # NaN -> null
    assert all("LPIPS not computed" in r["lpips_note"] for r in rows)
    table = (out / "table.md").read_text()
    assert "LPIPS not computed" in table and perceptual.BACKBONE_ENV in table
    # a file the config names but that does not exist is the user's error, before anything is written
    bad = write_config(tmp_path / "bad", metrics={"lpips_backbone": str(tmp_path / "missing.pth")})
    assert run(bad, tmp_path / "out2", "--models", "DeiT", "--setting", "a") == 3
    assert "missing.pth" in capsys.readouterr().err and not (tmp_path / "out2").exists()

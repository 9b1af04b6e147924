"""report.html (benchmark/report.py) and the plots it shows (benchmark/pictures.py, batch_plot.py, sweep.py).

Covers: every string read from a folder is escaped; the verdict is the strongest attacker's, per
model and setting, from the stored rows (capped PSNR, all-failed rows said as such); failed rows keep
their reasons; the distribution figure fits a page, names rows as the table does, keeps an
all-failed model and says why an LPIPS panel is empty; grid captions cap the PSNR as the tables do
and wrap instead of cutting; sweep curves stay apart and a constant utility axis gives way to the
grid point; a real run's report renders in headless Chromium with every image loaded.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

import metrics
from benchmark.store import RunFolder

HOSTILE = "<img src=x onerror=alert(1)>&\"'"


def _row(model, label, attack, image, psnr, failed=False, reason=None, setting="a", trained=False):
    return {"model": model, "label": label, "trained": trained, "setting": setting, "round": 1, "partition_id": image,
            "batch_index": 0, "image_id": f"img{image}", "attack": attack, "attack_name": attack, "correct": 0.0,
            "psnr": None if failed else psnr, "ssim": None if failed else 0.5, "mse": None if failed else 0.01,
            "fft2d": None if failed else 0.01, "lpips": None, "flat_psnr": 12.0, "failed": failed,
            "reason": reason, "error": False, "lpips_note": "LPIPS not computed: no weights"}


def _folder(tmp_path: Path, rows: list[dict], models: list[dict], name: str = "hostile") -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({"name": name, "settings": ["a"], "models": models}))
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _hostile_folder(tmp_path: Path) -> Path:
    """Model M (label hostile): attacker 'a<b>' reads 30/40 dB, 'april' exact copies (inf, 229.6 dB);
    model F: every attacker fails on both images with a hostile reason."""
    rows = []
    for i, (weak, exact) in enumerate(((30.0, "inf"), (40.0, 229.6))):
        rows += [_row("M", HOSTILE, "a<b>", i, weak), _row("M", HOSTILE, "april", i, exact)]
        rows += [_row("F", "F", a, i, None, failed=True, reason=f"condition failed: {HOSTILE}") for a in ("a<b>", "april")]
    return _folder(tmp_path, rows, [{"name": "M", "label": HOSTILE}, {"name": "F", "label": "F"}], name=HOSTILE)


def test_report_escapes_every_string_and_states_the_strongest_verdict(tmp_path):
    from benchmark.report import REPORT, write_report
    from benchmark.tables import write_tables

    folder = _hostile_folder(tmp_path)
    write_tables(RunFolder(folder))
    page = write_report(folder).read_text()
    assert (folder / REPORT).is_file()
    # nothing from the folder reaches the page as markup: no tag, no attribute break-out
    assert "<img src=x" not in page and "<b>" not in page and "<script" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;&amp;&quot;&#x27;" in page
    text = re.sub(r"<[^>]+>", "", page)
    # the strongest attacker wins both images with exact copies: capped at the tables' 100 dB, not inf/229.6
    assert ("the strongest attacker (april) reads x at 100.0 dB PSNR in (a) (the 100 dB cap" in text)
    assert "inf" not in re.sub(r"(?i)info|infinity", "", text.split("Table")[1].split("Pictures")[0])
    assert "F (untrained): every attacker failed on all 2 image(s) in (a)." in text
    # failed rows with their (escaped) reasons; the table's rows
    assert "F / april (a): 2 x condition failed: &lt;img src=x" in page
    assert page.count("<tr class='strongest'>") == 2
    assert "python run_benchmark.py --config" in text


def test_report_rebuilds_from_a_folder_without_tables(tmp_path):
    from benchmark.report import main

    folder = _hostile_folder(tmp_path)  # rows and config only: no table.csv yet
    assert main([str(folder)]) == 0
    assert "reads x at 100.0 dB PSNR" in (folder / "report.html").read_text()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing")])


def test_distribution_figure_fits_a_page_names_rows_as_the_table_and_keeps_failed_models(tmp_path, monkeypatch):
    import benchmark.pictures as P

    models = [{"name": f"m{i}", "label": f"Model number {i} with a long label"} for i in range(6)]
    rows = [_row(m["name"], m["label"], a, i, 20.0 + i, failed=m["name"] == "m5", reason="no PE")
            for m in models for a in ("attack_one", "attack_two") for i in range(2)]
    folder = _folder(tmp_path, rows, models)
    figures = []
    monkeypatch.setattr(P, "save_figure", lambda fig, path, **kw: figures.append((fig, kw.get("dpi", 100))))
    P.write_distributions(RunFolder(folder), ["a"])
    (fig, dpi), = figures
    width, height = fig.get_size_inches() * dpi
    assert width <= 1600 and height <= 2400
    labels = [t.get_text() for ax in fig.axes for t in ax.get_xticklabels()]
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    # the table's Model column (label, "(untrained)"), wrapped; every pair kept, the failed one said so
    assert any(lbl.replace("\n", " ").startswith("Model number 5 with a long label (untrained)") for lbl in labels)
    assert sum("strongest" in lbl for lbl in labels) == 6  # six models' PSNR boxes (no LPIPS: a narrow note)
    assert texts.count("all 2\nfailed") == 3  # attack_one, attack_two and strongest of m5
    assert any(P.NO_LPIPS in t.replace("\n", " ") for t in texts)


def test_grid_captions_cap_the_psnr_as_the_tables_and_wrap_without_cutting():
    from PIL import ImageFont

    from benchmark.pictures import _psnr_caption, _wrap_px

    cap = f"PSNR {metrics.PSNR_CAP_DB:g} dB (cap)"
    assert _psnr_caption(229.6) == _psnr_caption(float("inf")) == cap and _psnr_caption(23.31) == "PSNR 23.3 dB"
    font = ImageFont.load_default(size=11)
    for text in ("immunohistochemistry", "a very long model label (no surgery)", "x"):
        lines = _wrap_px(text, font, 60)
        assert "".join(lines).replace(" ", "") == text.replace(" ", "")
        assert all(font.getlength(line) <= 60 for line in lines if len(line) > 1)


def _sweep_frame(cos: float | None = None) -> pd.DataFrame:
    rows = []
    for index, gamma in enumerate((0.0, 0.27, 0.5)):
        for attack, psnr in (("april", 100.0), ("mjp_adaptive", 20.0 - 10 * gamma), ("strongest", 100.0)):
            rows.append({"sweep_index": index, "sweep": f"gamma={gamma}", "sweep.gamma": gamma, "model": "DeiT+MJP",
                         "label": "DeiT+MJP", "defence": "none", "setting": "b", "attack": attack, "psnr": psnr,
                         "lpips": np.nan, "defence_cos": 1.0 if cos is None else cos + index, "n": 2, "failed": 0})
    return pd.DataFrame(rows)


def test_sweep_curves_stay_apart_and_a_constant_utility_axis_gives_way(tmp_path, monkeypatch):
    import benchmark.sweep as S

    figures = []
    monkeypatch.setattr(S, "save_figure", lambda fig, path, **kw: figures.append(fig))
    S.write_sweep_plots(_sweep_frame(), tmp_path, ["gamma"])
    psnr = figures[0].axes[0]
    styles = {ln.get_label(): (ln.get_marker(), ln.get_linestyle(), ln.get_zorder()) for ln in psnr.lines}
    strongest = styles.pop("DeiT+MJP (b, strongest)")
    # the strongest curve lies on april's: dashed and drawn above it, and no two curves look alike
    assert strongest[1] == "--" and all(strongest[2] > z for _, _, z in styles.values())
    assert len(set(styles.values()) | {strongest}) == 3
    # privacy_utility.png: the cosine is 1.0 at every gamma, so x is the grid point (not all points at 1.0)
    pu = figures[-1].axes[0]
    assert sorted(set(np.concatenate([ln.get_xdata() for ln in pu.lines]))) == [0, 1, 2]
    assert "at every point" in pu.get_xlabel()
    figures.clear()
    S.write_sweep_plots(_sweep_frame(cos=0.5), tmp_path, ["gamma"])  # a varying cosine stays the axis
    assert sorted(set(np.concatenate([ln.get_xdata() for ln in figures[-1].axes[0].lines]))) == [0.5, 1.5, 2.5]


# ------------------------------------------------------------------------------------ a real browser
def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A tiny run of settings a, b, c through the pipeline (two attackers, so strongest rows exist)."""
    from helpers import tiny_config

    from benchmark.pipeline import run_benchmark
    from benchmark.validation import validate
    from server.offline import keep_flower_offline

    keep_flower_offline()
    cfg = tiny_config(settings=["a", "b", "c"])
    cfg["attacks"] = [{"name": "april_analytic"}, {"name": "pe_closed_form"}]
    cfg["models"][1]["label"] = HOSTILE
    out = tmp_path_factory.mktemp("report") / "out"
    run_benchmark(validate(cfg), str(out), progress=False)
    return out


def test_every_run_writes_its_report(real_run):
    page = (real_run / "report.html").read_text()
    table = pd.read_csv(real_run / "table.csv", dtype=str)
    assert page.count("<tr") >= len(table) + 1 and "<img src=x" not in page
    for name in ("grid_a.png", "grid_c.png", "dist_b.png"):
        assert f"alt='{name}'" in page
    assert "&lt;img src=x onerror=alert(1)&gt;&amp;&quot;&#x27; (untrained): the strongest attacker" in page


@pytest.mark.skipif(_chromium() is None, reason="no chromium here: `apt-get install -y chromium` (.ci/run "
                    "installs it where it runs as root with apt)")
def test_report_renders_in_headless_chromium(real_run, tmp_path):
    chromium = _chromium()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
             "--virtual-time-budget=10000", f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", "--window-size=1400,1800",
                    (real_run / "report.html").as_uri()], check=True, capture_output=True, timeout=120)
    img = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert img.shape == (1800, 1400) and img.std() > 10  # drawn: text, table and pictures, not a blank page
    # a copy with a probe that writes, once loaded, how many images decoded (naturalWidth > 0)
    probe = tmp_path / "probe.html"
    script = ("<script>addEventListener('load', () => { const i = [...document.images]; document.body.dataset.loaded"
              " = i.filter(x => x.complete && x.naturalWidth > 0).length + '/' + i.length; });</script>")
    probe.write_text((real_run / "report.html").read_text().replace("</body>", script + "</body>"))
    dom = subprocess.run([chromium, *flags, "--dump-dom", probe.as_uri()], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    loaded, total = map(int, re.search(r'data-loaded="(\d+)/(\d+)"', dom).groups())
    assert total == len(list(real_run.glob("*.png"))) and loaded == total
    assert len(re.findall(r"<tr class=\"strongest\">", dom)) == len(pd.read_csv(real_run / "table.csv").query(
        "Attack == 'strongest'"))

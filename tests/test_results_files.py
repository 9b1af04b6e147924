"""Results files a reader can average without filtering: failed rows carry no attacker score, and
every line is strict JSON (an infinite PSNR is the cap with its raw value named)."""
from __future__ import annotations

import json

import pandas as pd


def _row(**kw):
    from benchmark.rows import ResultRow

    base = dict(model="m", setting="a", round=1, partition_id=0, batch_index=0, image_id="x", attack="k")
    return ResultRow(**{**base, **kw})


def test_a_failed_row_keeps_its_fallback_scores_apart_and_a_mean_needs_no_filter() -> None:
    ok = _row(failed=False, scores={"psnr": 30.0, "flat_psnr": 6.0})
    bad = _row(image_id="y", failed=True, reason="r", scores={"psnr": 20.06, "ssim": 0.1, "flat_psnr": 5.0})
    rows = [json.loads(r.to_json()) for r in (ok, bad)]
    assert rows[1]["psnr"] is None and rows[1]["ssim"] is None
    assert rows[1]["fallback_psnr"] == 20.06 and rows[1]["flat_psnr"] == 5.0
    assert pd.DataFrame(rows)["psnr"].mean() == 30.0


def test_infinite_scores_are_strict_json_capped_with_the_raw_value_and_old_rows_are_rewritten() -> None:
    from benchmark.rows import ResultRow

    line = _row(failed=False, scores={"psnr": float("inf"), "mse": float("-inf"), "ssim": float("nan")}).to_json()
    data = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert (data["psnr"], data["psnr_raw"], data["mse"], data["mse_raw"], data["ssim"]) == (100.0, "inf", None,
                                                                                             "-inf", None)
    assert ResultRow.from_json(line).to_json() == line
    old = json.dumps({"model": "m", "setting": "a", "round": 1, "partition_id": 0, "batch_index": 0, "image_id": "x",
                      "attack": "k", "psnr": "inf", "failed": False})
    assert json.loads(ResultRow.from_json(old).to_json())["psnr"] == 100.0


def test_sweep_table_text_is_aligned_and_rounded() -> None:
    from benchmark.sweep_table import sweep_table_text

    frame = pd.DataFrame({"sweep_index": [0, 1], "sweep": ["defence.sigma=0", "defence.sigma=0.01"],
                          "model": ["DeiT", "DeiT"], "setting": ["a", "a"], "n": [4, 4], "failed": [0, 1],
                          "psnr": [23.123456789012345, 9.87654321], "ssim": [0.123456789012, 0.2]})
    text = sweep_table_text(frame)
    assert "23.12" in text and "0.1235" in text and "23.1234" not in text and "," not in text
    lines = text.splitlines()
    assert len({len(line.rstrip()) for line in lines[2:]}) == 1 or len(lines) == 4

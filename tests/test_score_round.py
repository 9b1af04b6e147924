"""The row schema and the pipeline's pure functions, called directly on small tensors (no threads,
no Flower, no Ray): :class:`benchmark.rows.ResultRow`, :func:`benchmark.rows.client_failure_rows`,
:func:`benchmark.scoring.score_round`, :func:`benchmark.scoring.round_top1` and the pipeline's
:class:`~benchmark.group_attacker.RoundCollector`. Expected values are computed here with numpy."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attacks.api.base import AttackResult
from benchmark import scoring
from benchmark.group_attacker import RoundCollector
from benchmark.rows import (
    ABSENT,
    ROW_KEY,
    ResultRow,
    RowContext,
    RowKey,
    client_failure_rows,
    is_run_failure,
    row_key,
)
from benchmark.workers import LocalRunner
from clients.partition import PrivateBatch
from defences import validate_defence
from fedmjp.jigsaw import JigsawPlan
from server.tap import TappedUpdate

REFERENCE = Path(__file__).parent / "data" / "default_preset_results.jsonl"
#: A complete row as the pipeline writes it (the default preset, setting c, an MJP-aware attack).
FULL_LINE = (
    '{"model": "DeiT+MJP", "label": "DeiT+MJP", "trained": false, "arch": "mjp_vit_cifar_patch4_32", "variant": '
    '"mjp", "april": null, "setting": "c", "group": "shuffled", "round": 1, "partition_id": 2, "node_id": '
    '5208383718651387203, "batch_index": 0, "image_id": "immunohistochemistry", "image_index": 5, "class": 5, '
    '"pred": 3, "correct": 0.0, "correct_attacked_model": 0.0, "gamma": 0.27, "attack": "mjp_adaptive", '
    '"attack_name": "mjp_adaptive", "seed": 0, "recon_index": 0, "scored_estimate": "unshuffled", "clamped": false, '
    '"mse": 0.0011, "fft2d": 0.0002, "psnr": 100.0, "psnr_raw": "inf", "ssim": 0.97, "lpips": null, '
    '"fft2d_hermitian": 0.99, '
    '"mse_unshuffled": 1e-05, "psnr_unshuffled": 50.0, "ssim_unshuffled": 0.99, "mse_shuffled": 0.004, '
    '"psnr_shuffled": 23.9, "ssim_shuffled": 0.8, "failed": false, "reason": null, "error": false, "attack_stats": '
    '{"objective": 1.5e-07, "iterations": 200, "notes": ["a", "b"]}, "time_attack_s": 12.5, "time_score_s": 0.03, '
    '"image_stored": true, "defence": "dp", "defence_label": "DP-SGD (sigma=1)", "defence_cos": 0.5, '
    '"dp_epsilon": 3.2, "dp_delta": 1e-05}')
SIZE, PATCH = 32, 4
OFFSET = 0.05  # reconstructions below are the true image plus this: MSE OFFSET**2 everywhere


# ------------------------------------------------------------------------------------ the schema
def test_a_full_row_reads_and_writes_back_byte_for_byte() -> None:
    row = ResultRow.from_json(FULL_LINE)
    assert row.to_json() == FULL_LINE
    assert row.image_class == 5 and row.scored_estimate == "unshuffled" and row.dp_epsilon == 3.2
    assert list(row.scores)[:2] == ["clamped", "mse"] and row.scores["psnr"] == 100.0 and row.extra == {}
    assert row.scores["psnr_raw"] == "inf"
    assert row.key == RowKey("DeiT+MJP", "mjp_adaptive", "c", 1, 2, 0, "immunohistochemistry")


def test_a_row_of_the_old_form_is_read_and_written_strictly() -> None:
    """A row stored before the strict form (``"psnr": "inf"``) is read as infinity and written back
    as the cap with the raw value named."""
    old = FULL_LINE.replace('"psnr": 100.0, "psnr_raw": "inf"', '"psnr": "inf"')
    assert old != FULL_LINE
    assert ResultRow.from_json(old).to_json() == FULL_LINE


def test_every_reference_row_round_trips() -> None:
    lines = [line for line in REFERENCE.read_text().splitlines() if line.strip()]
    assert len(lines) > 100
    for line in lines:
        stored = json.loads(line)
        row = ResultRow.from_json(line)
        assert json.loads(row.to_json()) == stored
        assert row_key(stored) == row.key == tuple(stored[k] for k in ROW_KEY)


def test_row_key_is_the_same_for_stored_mappings_plain_tuples_and_rows() -> None:
    stored = json.loads(FULL_LINE)
    key = row_key(stored)
    assert key == row_key(ResultRow.from_mapping(stored))
    assert {tuple(key)} == {key} and hash(tuple(key)) == hash(key)
    assert row_key({"model": "m"}) == RowKey("m", None, None, None, None, None, None)  # an old row: None


def test_sweep_columns_stay_after_the_schema_in_their_order() -> None:
    stored = {**json.loads(FULL_LINE), "utility_top1": 0.5, "sweep": "gamma=0.3", "sweep_index": 1,
              "sweep.gamma": 0.3}
    row = ResultRow.from_mapping(stored)
    assert list(row.extra) == ["utility_top1", "sweep", "sweep_index", "sweep.gamma"]
    assert row.to_json() == json.dumps(stored)


def test_bad_rows_are_refused_naming_the_column() -> None:
    with pytest.raises(ValueError, match="image_id"):
        ResultRow.from_mapping({k: 1 for k in ROW_KEY if k != "image_id"} | {"failed": False})
    with pytest.raises(TypeError, match="JSON object"):
        ResultRow.from_json("[1, 2]")
    with pytest.raises(ValueError, match="schema column.*failed"):
        ResultRow(model="m", setting="a", round=1, partition_id=0, batch_index=0, image_id="i", attack="x",
                  failed=False, scores={"failed": True})


def test_non_finite_values_are_written_as_the_store_reads_them() -> None:
    row = ResultRow(model="m", setting="a", round=1, partition_id=0, batch_index=0, image_id="i", attack="x",
                    failed=False, scores={"psnr": math.inf, "mse": float("nan"), "ssim": np.float32(0.5)},
                    attack_stats={"residual": torch.tensor([1.0, -math.inf])})
    assert json.loads(row.to_json()) == {"model": "m", "setting": "a", "round": 1, "partition_id": 0,
                                         "batch_index": 0, "image_id": "i", "attack": "x", "psnr": 100.0,
                                         "psnr_raw": "inf", "mse": None, "ssim": 0.5, "failed": False,
                                         "attack_stats": {"residual": [1.0, None]}}
    assert "Infinity" not in row.to_json() and "NaN" not in row.to_json()


# ------------------------------------------------------------------------------------ fixtures
def _context(**changes) -> RowContext:
    values = {"model": "MJP", "label": "MJP row", "trained": False, "arch": "mjp_vit_cifar_patch4_32",
              "variant": "mjp", "april": None, "group": "shuffled", "seed": 7, "defence": validate_defence(None),
              "image_index": {"img0": 10, "img1": 11}}
    values.update(changes)
    return RowContext(**values)


def _images(n: int, seed: int = 0) -> torch.Tensor:
    """[n, 3, 32, 32] in [0.1, 0.9]: room for the offset reconstructions without clamping."""
    g = torch.Generator().manual_seed(seed)
    return 0.1 + 0.8 * torch.rand(n, 3, SIZE, SIZE, generator=g)


def _batch(images: torch.Tensor, shuffled: torch.Tensor | None = None, mask: torch.Tensor | None = None,
           gamma: float = 0.0) -> PrivateBatch:
    n = len(images)
    plan = None if mask is None else JigsawPlan(mask, torch.arange(mask.shape[1]).repeat(n, 1))
    return PrivateBatch(images=images, labels=torch.arange(n) + 3, image_ids=[f"img{i}" for i in range(n)],
                        indices=torch.arange(n) + 20, plan=plan, shuffled=shuffled, gamma=gamma)


def _update(rnd: int = 1, part: int = 0, metrics: dict | None = None, arrays: dict | None = None) -> TappedUpdate:
    return TappedUpdate(server_round=rnd, node_id=99 + part, partition_id=part, kind="gradients",
                        arrays=arrays or {}, global_state={}, num_examples=1, metrics=metrics or {})


def _top1(n: int) -> scoring.RoundTop1:
    return scoring.RoundTop1([torch.tensor([1.0] * n)], [torch.arange(n) + 3], [torch.tensor([0.0] * n)])


@pytest.fixture(scope="module")
def scorer() -> scoring.Scorer:
    return scoring.Scorer(torch.device("cpu"), {"lpips": False})


def _psnr(mse: float) -> float:
    return 10.0 * math.log10(1.0 / mse)


# ------------------------------------------------------------------------------------ score_round
def test_score_round_pairs_and_scores_a_batch_against_x(scorer: scoring.Scorer) -> None:
    """Setting a, a batch of two returned in swapped order: each image is scored on its own
    reconstruction (recon_index 1 then 0), MSE and PSNR as numpy computes them."""
    x = _images(2)
    recon = (x + OFFSET)[[1, 0]]
    result = AttackResult(images=recon, stats=[{"objective": 0.5, "iterations": 3}, {"objective": 0.25}])
    update = _update(metrics={"defence-cos": 0.75, "dp-epsilon": 2.5})
    ctx = _context(defence=validate_defence({"name": "dp_sgd", "delta": 1e-5}))
    scored = scoring.score_round(ctx, ("att", "att_name"), "a", [update], [_batch(x)], [result], _top1(2), scorer,
                                 PATCH, t_attack=1.5, grid_ids={"img1"})
    rows = [s.row for s in scored]
    assert [r.recon_index for r in rows] == [1, 0]
    for b, s in enumerate(scored):
        want = float(np.mean((recon[[1, 0]][b].double().numpy() - x[b].double().numpy()) ** 2))
        assert s.row.scores["mse"] == pytest.approx(want, rel=1e-6)
        assert s.row.scores["psnr"] == pytest.approx(_psnr(want), abs=1e-4)
        assert s.row.scores["ssim"] < 1.0 and "lpips" not in s.row.scores  # LPIPS off in this scorer
        assert torch.equal(s.reconstruction, x[b] + OFFSET)
    first = rows[0]
    assert (first.model, first.label, first.group, first.seed, first.setting) == ("MJP", "MJP row", "shuffled", 7, "a")
    assert (first.round, first.partition_id, first.node_id, first.image_index, first.image_class) == (1, 0, 99, 10, 3)
    assert (first.pred, first.correct, first.correct_attacked_model) == (3, 1.0, 0.0)
    assert first.attack_stats == {"objective": 0.25} and first.scored_estimate == "images"
    assert (first.failed, first.reason, first.error) == (False, None, False)
    assert (first.defence, first.defence_label, first.defence_cos, first.dp_epsilon, first.dp_delta) == (
        "dp_sgd", "dp_sgd(clip=1.0, sigma=1.0, delta=1e-05)", 0.75, 2.5, 1e-5)
    assert first.time_attack_s == 1.5 and first.time_score_s > 0
    assert [r.image_stored for r in rows] == [False, True]
    assert first.scores.keys() >= {"clamped", "mse", "fft2d", "psnr", "ssim", "fft2d_hermitian"}


def test_score_round_skips_stored_rows_and_reports_failures(scorer: scoring.Scorer) -> None:
    x = _images(2, seed=1)
    result = AttackResult(images=torch.zeros_like(x), stats=[{}, {}], failed=True, reason="rank condition not met")
    stored = {RowKey("MJP", "att", "a", 1, 0, 0, "img0")}
    scored = scoring.score_round(_context(), ("att", "att"), "a", [_update()], [_batch(x)], [result], _top1(2),
                                 scorer, PATCH, 0.0, skip=stored)
    assert [s.row.image_id for s in scored] == ["img1"]
    row = scored[0].row
    assert row.failed and row.reason == "rank condition not met" and row.error is False
    assert not is_run_failure(row)  # a condition failure is a result, not retried
    bug = AttackResult(images=torch.zeros_like(x), stats=[{}, {}], failed=True, reason="ZeroDivisionError",
                       error="Traceback ...")
    rows = [s.row for s in scoring.score_round(_context(), ("att", "att"), "a", [_update()], [_batch(x)], [bug],
                                               _top1(2), scorer, PATCH, 0.0)]
    assert all(r.failed and r.error for r in rows)


def test_score_round_settings_b_and_c_use_their_reference_and_the_region_scores(scorer: scoring.Scorer) -> None:
    """One image with two shuffled patch positions (patches 0 and 1 swapped in x~). Setting b is
    scored against x~; setting c against x, on the attack's own estimate of x when it has one,
    and both get the per-region columns of the unshuffled and shuffled positions."""
    x = _images(1, seed=2)
    n_side = SIZE // PATCH
    mask = torch.zeros(1, n_side * n_side, dtype=torch.bool)
    mask[0, :2] = True
    xs = x.clone()
    xs[..., :PATCH, :PATCH], xs[..., :PATCH, PATCH:2 * PATCH] = x[..., :PATCH, PATCH:2 * PATCH], x[..., :PATCH, :PATCH]
    batch = _batch(x, shuffled=xs, mask=mask, gamma=0.03)
    result = AttackResult(images=xs + OFFSET, stats=[{}], unshuffled=x + 2 * OFFSET)
    run = {s: scoring.score_round(_context(), ("mjp", "mjp"), s, [_update()], [batch], [result], _top1(1), scorer,
                                  PATCH, 0.0)[0] for s in ("b", "c")}
    b_row, c_row = run["b"].row, run["c"].row
    assert b_row.scored_estimate == "images" and c_row.scored_estimate == "unshuffled"
    assert b_row.scores["mse"] == pytest.approx(OFFSET ** 2, rel=1e-4)  # x~ + offset against x~
    assert c_row.scores["mse"] == pytest.approx((2 * OFFSET) ** 2, rel=1e-4)  # the estimate of x against x
    assert torch.equal(run["c"].reconstruction, (x + 2 * OFFSET)[0])
    assert b_row.gamma == 0.03
    for row, offset in ((b_row, OFFSET), (c_row, 2 * OFFSET)):
        assert row.scores["mse_unshuffled"] == pytest.approx(offset ** 2, rel=1e-4)
        assert row.scores["mse_shuffled"] == pytest.approx(offset ** 2, rel=1e-4)
        assert row.scores["psnr_unshuffled"] == pytest.approx(_psnr(offset ** 2), abs=1e-3)
    a_row = scoring.score_round(_context(), ("mjp", "mjp"), "a", [_update()], [batch], [result], _top1(1), scorer,
                                PATCH, 0.0)[0].row
    assert "mse_unshuffled" not in a_row.scores  # setting a has no shuffled positions


def test_every_row_carries_the_flat_image_floor_of_its_own_image(scorer: scoring.Scorer) -> None:
    """``flat_psnr``: a flat image of the context's colour scored against the row's reference (x~ in
    b, x in c) as numpy computes it; failed attack rows carry it too (no reconstruction enters it),
    the aggregate averages it over the rows the PSNR mean is over, the paper table shows it beside
    PSNR, and a context without a colour writes no such column."""
    from benchmark.aggregate import aggregate
    from benchmark.tables import FLAT_HEADER, paper_table

    colour = (0.485, 0.456, 0.406)
    x = _images(2, seed=3)
    xs = torch.roll(x, 1, dims=-1)  # a stand-in for x~: another reference than x
    batch = PrivateBatch(images=x, labels=torch.tensor([3, 4]), image_ids=["img0", "img1"],
                         indices=torch.tensor([20, 21]), plan=None, shuffled=xs, gamma=0.0)
    ctx = _context(flat_colour=colour)
    flat = np.broadcast_to(np.array(colour)[:, None, None], (3, SIZE, SIZE))
    ok = AttackResult(images=xs + OFFSET, stats=[{}, {}])
    bad = AttackResult(images=torch.zeros_like(x), stats=[{}, {}], failed=True, reason="rank condition not met")
    rows = []
    for setting, reference in (("b", xs), ("c", x)):
        for label, result in (("ok", ok), ("bad", bad)):
            got = scoring.score_round(ctx, (label, label), setting, [_update()], [batch], [result], _top1(2), scorer,
                                      PATCH, 0.0)
            for b, item in enumerate(got):
                want = _psnr(float(np.mean((flat - reference[b].double().numpy()) ** 2)))
                assert item.row.scores[scoring.FLAT_COLUMN] == pytest.approx(want, abs=1e-9), (setting, label, b)
                rows.append(json.loads(item.row.to_json()))
    full = aggregate(rows)
    ok_b = full[(full["attack"] == "ok") & (full["setting"] == "b")].iloc[0]
    assert ok_b["flat_psnr_mean"] == pytest.approx(np.mean([r["flat_psnr"] for r in rows[:2]]), rel=1e-12)
    assert full[full["attack"] == "bad"]["flat_psnr_mean"].isna().all()  # no PSNR mean there: no floor either
    assert FLAT_HEADER in paper_table(full).columns
    plain = scoring.score_round(_context(), ("ok", "ok"), "c", [_update()], [batch], [ok], _top1(2), scorer, PATCH, 0.0)
    assert scoring.FLAT_COLUMN not in plain[0].row.scores
    with pytest.raises(ValueError, match=r"flat colour \(0.5, 0.5\)"):
        scoring.flat_psnr(x, (0.5, 0.5))


# ------------------------------------------------------------------------------------ failures
def test_client_failure_rows() -> None:
    batch = _batch(_images(2))
    reason = "boom\n   " + "x" * 400
    rows = client_failure_rows(_context(), 2, 1, batch, [reason], [("a1", "n1"), ("a2", "n2")], ["b", "c"])
    assert len(rows) == 2 * 2 * 2
    assert [(r.setting, r.attack, r.batch_index) for r in rows[:3]] == [("b", "a1", 0), ("b", "a1", 1), ("b", "a2", 0)]
    row = json.loads(rows[1].to_json())
    assert list(row) == ["model", "label", "trained", "arch", "variant", "setting", "group", "round", "partition_id",
                         "node_id", "batch_index", "image_id", "image_index", "class", "gamma", "attack",
                         "attack_name", "seed", "failed", "reason", "image_stored"]
    assert row["reason"].startswith("client failed: boom x") and len(row["reason"]) == 300
    assert (row["node_id"], row["image_index"], row["class"], row["image_stored"]) == (None, 11, 4, False)
    assert all(is_run_failure(r) for r in rows) and rows[0].pred is ABSENT
    default = client_failure_rows(_context(), 1, 0, batch, [], [("a1", "n1")], ["a"])[0]
    assert default.reason == "client failed: no update from this client"


# ------------------------------------------------------------------------------------ top-1
def test_round_top1_reads_single_image_gradients_and_forwards_the_rest() -> None:
    from fedmjp.factory import build_model, model_input

    torch.manual_seed(0)
    model = build_model({"name": "t", "arch": "mjp_vit_cifar_patch4_32", "variant": "plain", "kwargs": {"depth": 1},
                         "seed": 0}).eval()
    x = _images(3, seed=3)
    batches = [_batch(x[i:i + 1]) for i in range(2)] + [_batch(x[1:3])]
    updates = []
    for batch in batches:
        model.zero_grad()
        F.cross_entropy(model(model_input(model, batch.images)), batch.labels).backward()
        updates.append(_update(arrays={"head.bias": model.head.bias.grad.detach().clone()}))
    with torch.no_grad():
        want = [model(model_input(model, b.images)).argmax(-1) for b in batches]
    name = scoring.classifier_bias_name(model)
    assert name == "head.bias"
    read, forwards = scoring.round_top1(model, None, updates, batches, torch.device("cpu"), readout=name)
    assert forwards == 1  # the batch of two needs a forward; the single images are read off their gradients
    plain, all_forward = scoring.round_top1(model, None, updates, batches, torch.device("cpu"))
    assert all_forward == 3
    for got in (read, plain):
        assert [p.tolist() for p in got.pred] == [w.tolist() for w in want]
        assert [c.tolist() for c in got.correct] == [(w == b.labels).float().tolist() for w, b in zip(want, batches)]
        assert got.correct_attacked == got.correct
    assert read.take([2]).pred[0].tolist() == want[2].tolist()


# ------------------------------------------------------------------------------------ rounds
def test_round_collector_completes_rounds_and_lists_missing_clients() -> None:
    rounds = RoundCollector({(r, p) for r in (1, 2, 3) for p in (0, 1)})
    assert rounds.add(_update(1, 1)) == []
    done = rounds.add(_update(1, 0))
    assert [[int(u.partition_id) for u in r] for r in done] == [[1, 0]]
    assert rounds.add(_update(2, 0)) == []
    done = rounds.add(_update(3, 1))  # round 2 lost a client: it is complete once round 3 starts
    assert [[(u.server_round, u.partition_id) for u in r] for r in done] == [[(2, 0)]]
    assert rounds.add(_update(4, 0)) == []  # not expected: dropped
    assert [(u.server_round, u.partition_id) for u in rounds.close()] == [(3, 1)]
    assert rounds.missing() == [(2, 1), (3, 0)]


def test_local_runner_capabilities() -> None:
    runner = LocalRunner([])
    model = torch.nn.Linear(1, 1)
    assert runner.slots == 1 and runner.share(model) is model

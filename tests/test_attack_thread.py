"""The benchmark attacks and scores in a thread of its own while the federation goes on.

The server's tap only queues each update; the attack thread attacks and scores round r while the
clients compute round r + 1. An error in the attack thread must still stop the run with that error
(never a hang, never a silent pass), and keep the rows already written, so a re-run resumes.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from helpers import metric_rows, write_config

import clients.defence as defence
from benchmark import config as C
from benchmark import scoring
from benchmark.pipeline import run_benchmark
from benchmark.validation import validate


def _config(folder: Path) -> dict:
    return validate(C.load_config(write_config(folder, **{"models": [
        {"name": "DeiT", "arch": "mjp_vit_cifar_patch4_32", "variant": "plain", "kwargs": {"depth": 2},
         "april": "surgery"}]})))


def test_round_r_is_scored_while_the_clients_compute_round_r_plus_1(tmp_path: Path, monkeypatch) -> None:
    """Scoring of round 1 waits until a client has started round 2: with a tap that attacked in the
    server's thread, round 2 could not start before round 1 was scored, and the wait times out."""
    second_round = threading.Event()
    overlapped: list[bool] = []
    local_update, score = defence.local_update, scoring.Scorer.score

    def client_update(cfg, state, partition_id, server_round, *args, **kwargs):
        if server_round == 2:
            second_round.set()
        return local_update(cfg, state, partition_id, server_round, *args, **kwargs)

    def slow_score(self, *args, **kwargs):
        if not overlapped:  # the first round's scores
            overlapped.append(second_round.wait(timeout=60))
        return score(self, *args, **kwargs)

    monkeypatch.setattr(defence, "local_update", client_update)
    monkeypatch.setattr(scoring.Scorer, "score", slow_score)
    summary = run_benchmark(_config(tmp_path), str(tmp_path / "out"), progress=False)
    assert overlapped == [True]
    assert summary.new_rows == 4  # 2 rounds x 2 clients x 1 image, setting c


def test_an_error_in_the_attack_thread_stops_the_run_and_keeps_finished_rows(tmp_path: Path, monkeypatch) -> None:
    cfg, out = _config(tmp_path), tmp_path / "out"
    score = scoring.Scorer.score
    calls: list[int] = []

    def failing_score(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # round 2
            raise RuntimeError("scorer broke in round 2")
        return score(self, *args, **kwargs)

    monkeypatch.setattr(scoring.Scorer, "score", failing_score)
    with pytest.raises(RuntimeError, match="scorer broke in round 2"):
        run_benchmark(cfg, str(out), progress=False)
    kept = metric_rows(out / "results.jsonl")
    assert [r["round"] for r in kept] == [1, 1]  # round 1's rows were written before the error

    monkeypatch.setattr(scoring.Scorer, "score", score)
    summary = run_benchmark(cfg, str(out), progress=False)  # the re-run computes round 2 only
    assert (summary.kept_rows, summary.new_rows) == (2, 2)
    assert [r["round"] for r in metric_rows(out / "results.jsonl")] == [1, 1, 2, 2]


def test_an_error_after_the_federation_ended_stops_the_run_instead_of_hanging(tmp_path: Path,
                                                                              monkeypatch) -> None:
    """An error while the attack thread finishes (after it took the end marker: the last round's
    attacks, e.g. a Ray attack worker killed during the final drain) is raised, not waited on: the
    thread used to wait for a second end marker that never comes, and the run hung in join()."""
    from benchmark import group_attacker

    close = group_attacker.RoundCollector.close

    def broken_close(self):
        if not self.buffer:  # the call at the end marker (every round already complete)
            raise RuntimeError("attack worker died while the last round was attacked")
        return close(self)

    monkeypatch.setattr(group_attacker.RoundCollector, "close", broken_close)
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_benchmark(_config(tmp_path), str(tmp_path / "out"), progress=False)
        except BaseException as err:  # noqa: BLE001  (checked below)
            errors.append(err)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(timeout=240), "the run hung after an error in the attack thread's last round"
    assert len(errors) == 1 and "attack worker died" in str(errors[0])

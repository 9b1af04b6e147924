"""The attack runners (benchmark.workers): a round's calls go in at once, every job is a
``concurrent.futures.Future`` of (results, seconds); the local runner's is done at submission, in
this process, in the calls' order. RoundDispatch keeps a federation's rounds in flight and hands each
back once its jobs are done. The Ray runner keeps the calls of attackers that share the update's
estimate store on one worker (tests/test_benchmark_batched.py runs it)."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from benchmark.workers import AttackCall, LocalRunner, RoundDispatch, make_runner


class _Echo:
    """An attack that says which of its two entry points answered."""

    def reconstruct_many(self, model, updates, metadatas):
        return [("many", model, u, m["i"]) for u, m in zip(updates, metadatas)]

    def reconstruct(self, model, update, metadata):
        return ("one", model, update, metadata["i"])


class _Broken:
    def reconstruct_many(self, model, updates, metadatas):
        raise RuntimeError("attack broke")


class _Store:
    """An attack that puts its name in the metadata's store, and reads what earlier attacks put."""

    def __init__(self, name: str) -> None:
        self.name = name

    def reconstruct_many(self, model, updates, metadatas):
        out = []
        for m in metadatas:
            out.append(list(m["store"]))
            m["store"].append(self.name)
        return out


def test_local_jobs_are_done_futures_of_the_attack_s_results() -> None:
    runner = make_runner([_Broken(), _Echo()], workers=0)
    assert isinstance(runner, LocalRunner) and runner.slots == 1
    model = object()
    assert runner.share(model) is model
    jobs = runner.submit(model, [AttackCall(1, ["u0", "u1"], [{"i": 0}, {"i": 1}]), AttackCall(1, ["u2"], [{"i": 2}])])
    assert len(jobs) == 2 and all(isinstance(job, Future) and job.done() for job in jobs)
    results, seconds = jobs[0].result()
    assert results == [("many", model, "u0", 0), ("many", model, "u1", 1)] and seconds >= 0.0
    assert jobs[1].result()[0] == [("many", model, "u2", 2)]
    [job] = runner.submit(model, [AttackCall(1, ["u0"], [{"i": 0}])], batched=False)
    assert job.result()[0] == [("one", model, "u0", 0)]
    assert runner.submit(model, []) == []


def test_local_calls_run_in_order_and_see_one_metadata_object() -> None:
    """The calls of a round run one after the other in this process: a later attacker sees what an
    earlier one left in the metadata of the same update (the estimate store), never another update's."""
    runner = LocalRunner([_Store("a"), _Store("b")])
    first, second = {"store": []}, {"store": []}
    jobs = runner.submit(None, [AttackCall(0, ["u0", "u1"], [first, second]), AttackCall(1, ["u1"], [second])])
    assert jobs[0].result()[0] == [[], []] and jobs[1].result()[0] == [["a"]]
    assert first["store"] == ["a"] and second["store"] == ["a", "b"]


def test_a_local_attack_error_is_raised_at_submission() -> None:
    """The attack ran in the caller's thread: its error surfaces there, not in a later result()."""
    with pytest.raises(RuntimeError, match="attack broke"):
        LocalRunner([_Broken()]).submit(None, [AttackCall(0, ["u"], [{"i": 0}])])


# ------------------------------------------------------------------------------- round dispatch
class _Manual:
    """A runner whose jobs finish when the test says so."""

    slots = 1

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def share(self, model):
        return ("shared", model)

    def submit(self, model, calls, batched=True) -> list[Future]:
        self.calls += [(c.index, model, list(c.updates), batched) for c in calls]
        return [Future() for _ in calls]

    def close(self) -> None:
        pass


def _dispatch(batched: bool = True) -> tuple[RoundDispatch, _Manual, list[str]]:
    finished: list[str] = []
    runner = _Manual()
    return RoundDispatch(runner, finished.append, batched), runner, finished


def test_dispatch_hands_the_runner_the_calls_and_finishes_done_rounds_oldest_first() -> None:
    dispatch, runner, finished = _dispatch(batched=False)
    assert dispatch.limit == 2 and dispatch.share("m") == ("shared", "m")
    a, b = dispatch.submit("m", [AttackCall(0, ["u"], [{}]), AttackCall(1, ["v"], [{}])])
    assert runner.calls == [(0, "m", ["u"], False), (1, "m", ["v"], False)]
    dispatch.add("r1", [a, b])
    dispatch.add("r2", [])  # a round with nothing left to attack is done at once
    a.set_result(([], 0.0))
    dispatch.drain()
    assert finished == ["r2"]  # r1 still waits for b; r2 does not wait behind it
    b.set_result(([], 0.0))
    dispatch.drain()
    assert finished == ["r2", "r1"] and not dispatch.pending


def test_dispatch_keeps_at_most_limit_rounds_in_flight() -> None:
    """Adding a round beyond the limit waits for the oldest one's jobs (set from another thread)."""
    dispatch, _, finished = _dispatch()
    jobs = dispatch.submit("m", [AttackCall(0, [i], [{}]) for i in range(3)])
    dispatch.add("r1", [jobs[0]])
    dispatch.add("r2", [jobs[1]])
    assert finished == []
    threading.Timer(0.2, jobs[0].set_result, args=(([], 0.0),)).start()
    dispatch.add("r3", [jobs[2]])  # three in flight > limit 2: waits for r1
    assert finished == ["r1"] and [item for item, _ in dispatch.pending] == ["r2", "r3"]
    for job in jobs[1:]:
        threading.Timer(0.1, job.set_result, args=(([], 0.0),)).start()
    dispatch.drain(keep=0)  # the federation's end: every round, waiting for each
    assert finished == ["r1", "r2", "r3"] and not dispatch.pending


def test_gpu_share_packs_attack_workers_onto_whole_gpus() -> None:
    from benchmark.errors import ConfigError
    from benchmark.workers import gpu_share

    assert gpu_share(1, 1) == 1.0 and gpu_share(2, 4) == 1.0  # a GPU each while there are enough
    assert gpu_share(4, 1) == 0.25  # k workers on one GPU: 1/k each
    assert gpu_share(3, 2) == 0.5  # 2 + 1 per GPU: 2/3 each would leave the third worker unplaced
    with pytest.raises(ConfigError, match="no GPU"):
        gpu_share(2, 0)


@pytest.mark.slow
def test_ray_keeps_the_attackers_that_share_estimates_on_one_worker() -> None:
    """On Ray every task unpickles its own metadata: the calls of attackers that share the update's
    estimate store go to one actor as one task, in their order, so the later one sees what the
    earlier one put; an attacker that shares nothing is its own task, with its own copy."""
    import os

    import ray

    from benchmark.workers import RayRunner

    class Store:  # defined here: pickled by value to the actors, which cannot import this test module
        def __init__(self, name: str, shares: bool) -> None:
            self.name, self.shares_estimates = name, shares

        def reconstruct_many(self, model, updates, metadatas):
            out = [(list(m["store"]), os.getpid()) for m in metadatas]
            for m in metadatas:
                m["store"].append(self.name)
            return out

    runner = RayRunner([Store("a", True), Store("plain", False), Store("b", True)], workers=2)
    try:
        metas = [{"store": []}, {"store": []}]
        calls = [AttackCall(0, ["u0", "u1"], metas), AttackCall(1, ["u0", "u1"], metas),
                 AttackCall(2, ["u1"], metas[1:])]
        jobs = runner.submit(None, calls)
        (a, _), (plain, _), (b, _) = (job.result(timeout=600) for job in jobs)  # Ray actors start slowly on a loaded machine
        assert [seen for seen, _ in a] == [[], []] and [seen for seen, _ in plain] == [[], []]
        assert [seen for seen, _ in b] == [["a"]]  # a's entry in the same (unpickled) store of update u1
        assert a[0][1] == b[0][1]  # one actor process
        assert metas == [{"store": []}, {"store": []}]  # the actors' copies, not the caller's
        [alone] = runner.submit(None, [AttackCall(1, ["u2"], [{"store": ["x"]}])])  # no sharing attacker
        assert [seen for seen, _ in alone.result(timeout=120)[0]] == [["x"]]
    finally:
        runner.close()
    assert not ray.is_initialized()


def test_an_attacker_that_computes_what_an_earlier_one_computes_runs_once(tmp_path: Path, monkeypatch) -> None:
    """The preset's ``ig_plain_forward`` (``ig_closed_start`` with ``mjp_mask: false``) is
    ``ig_closed_start`` on a plain ViT: there it runs once and both labels' rows hold its scores (the
    copy's notes say so); on the MJP row the two differ and both run."""
    from collections import Counter

    from helpers import run, write_config

    from attacks.optimization.ig_closed_start import InvertingGradientsClosedStart as IgClosedStart
    from benchmark.store import read_jsonl

    calls: Counter = Counter()
    original = IgClosedStart.reconstruct_many

    def counted(self, model, updates, metadatas):  # type: ignore[no-untyped-def]
        calls[(getattr(model, "unk_embed", None) is not None, self.mjp_mask)] += 1
        return original(self, model, updates, metadatas)

    monkeypatch.setattr(IgClosedStart, "reconstruct_many", counted)
    options = {"iterations": 3, "restarts": 1, "start_attacks": []}
    config = write_config(tmp_path, **{"federation.rounds": 1, "federation.lr": 0.0, "attacks": [
        {"name": "ig_closed_start", "options": options},
        {"name": "ig_closed_start", "label": "ig_plain_forward", "options": {**options, "mjp_mask": False}}]})
    assert run(config, tmp_path / "out") == 0
    assert calls == {(False, True): 1, (True, True): 1, (True, False): 1}  # plain row: one call for both labels
    rows = {(r["model"], r["attack"], r["image_id"]): r for r in read_jsonl(tmp_path / "out" / "results.jsonl")}
    plain = [(r, rows[("DeiT", "ig_plain_forward", key[2])]) for key, r in rows.items()
             if key[:2] == ("DeiT", "ig_closed_start")]
    assert len(plain) == 2
    for first, copy in plain:
        assert copy["psnr"] == first["psnr"] and copy["mse"] == first["mse"]
        assert any("the run of ig_closed_start" in n for n in copy["attack_stats"]["notes"])
        assert not any("the run of" in n for n in first["attack_stats"]["notes"])
    mjp = [r for k, r in rows.items() if k[0] == "DeiT+MJP"]
    assert mjp and not any("the run of" in n for r in mjp for n in r["attack_stats"]["notes"])

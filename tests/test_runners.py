"""The attack runners (benchmark.workers): every job is a ``concurrent.futures.Future`` of
(results, seconds); the local runner's is done at submission, in this process. RoundDispatch keeps a
federation's rounds in flight and hands each back once its jobs are done."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from benchmark.workers import LocalRunner, RoundDispatch, make_runner


class _Echo:
    """An attack that says which of its two entry points answered."""

    def reconstruct_many(self, model, updates, metadatas):
        return [("many", model, u, m["i"]) for u, m in zip(updates, metadatas)]

    def reconstruct(self, model, update, metadata):
        return ("one", model, update, metadata["i"])


class _Broken:
    def reconstruct_many(self, model, updates, metadatas):
        raise RuntimeError("attack broke")


def test_local_jobs_are_done_futures_of_the_attack_s_results() -> None:
    runner = make_runner([_Broken(), _Echo()], workers=0)
    assert isinstance(runner, LocalRunner) and runner.slots == 1
    model = object()
    assert runner.share(model) is model
    job = runner.submit(1, model, ["u0", "u1"], [{"i": 0}, {"i": 1}])
    assert isinstance(job, Future) and job.done()
    results, seconds = job.result()
    assert results == [("many", model, "u0", 0), ("many", model, "u1", 1)] and seconds >= 0.0
    one_by_one, _ = runner.submit(1, model, ["u0"], [{"i": 0}], batched=False).result()
    assert one_by_one == [("one", model, "u0", 0)]


def test_a_local_attack_error_is_raised_at_submission() -> None:
    """The attack ran in the caller's thread: its error surfaces there, not in a later result()."""
    with pytest.raises(RuntimeError, match="attack broke"):
        LocalRunner([_Broken()]).submit(0, None, ["u"], [{"i": 0}])


# ------------------------------------------------------------------------------- round dispatch
class _Manual:
    """A runner whose jobs finish when the test says so."""

    slots = 1

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def share(self, model):
        return ("shared", model)

    def submit(self, index, model, updates, metadatas, batched=True) -> Future:
        self.calls.append((index, model, list(updates), batched))
        return Future()

    def close(self) -> None:
        pass


def _dispatch(batched: bool = True) -> tuple[RoundDispatch, _Manual, list[str]]:
    finished: list[str] = []
    runner = _Manual()
    return RoundDispatch(runner, finished.append, batched), runner, finished


def test_dispatch_hands_the_runner_the_calls_and_finishes_done_rounds_oldest_first() -> None:
    dispatch, runner, finished = _dispatch(batched=False)
    assert dispatch.limit == 2 and dispatch.share("m") == ("shared", "m")
    a = dispatch.submit(0, "m", ["u"], [{}])
    b = dispatch.submit(1, "m", ["v"], [{}])
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
    jobs = [dispatch.submit(0, "m", [i], [{}]) for i in range(3)]
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

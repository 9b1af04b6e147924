"""The attack runners (benchmark.workers): every job is a ``concurrent.futures.Future`` of
(results, seconds); the local runner's is done at submission, in this process."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from benchmark.workers import LocalRunner, make_runner


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

"""Where the attacks of a benchmark run: in this process, or spread over Ray workers.

The pipeline hands every round's updates to a runner as one :class:`AttackCall` per attacker
(``attack.reconstruct_many``: the batched attacks solve them together), all of a round at once, and
scores the results when they are ready. A runner (:class:`Runner`) returns each call as a
``concurrent.futures.Future``; :class:`RoundDispatch` keeps the rounds in flight and hands each back
once its jobs are done. :class:`LocalRunner` attacks at once, in this process, in the calls' order.
:class:`RayRunner` sends the calls to ``workers`` Ray actors (a local Ray instance of that many
CPUs, or a running cluster at ``address``) and returns at once, so the federation's next round and
other workers' attacks go on meanwhile; the attacks are deterministic functions of (model, update,
metadata), so the rows are the same as in a single process. On a cluster, every node needs this
checkout importable (the same code and libraries, e.g. an editable install of the project).

Each update's metadata carries the round's estimate store of that update
(:class:`attacks.api.estimates.EstimateStore`): ``ig_closed_start`` starts from the x~ that
``mjp_adaptive`` put there. In this process every call sees it; :class:`RayRunner` sends the calls of
the attackers that share estimates (``attack.shares_estimates``) to one actor as one task, in their
order, so that they see one unpickled store there too.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from .errors import ConfigError

if TYPE_CHECKING:
    from attacks.api.base import AttackMetadata

_logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]


def _copy(value: Any) -> Any:
    """A private copy of an update's entry (a tensor or an array; anything else as it is)."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value.copy() if isinstance(value, np.ndarray) else value


def _same(a: Any, b: Any) -> bool:
    """Whether two entries hold the same values (NaN equal to NaN; tensors by dtype, shape, values)."""
    import numpy as np
    import torch

    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


class ModelGuard:
    """What the attackers of a round share, as it was before they ran: the model's state (parameters
    and buffers), every module's train/eval mode and every parameter's ``requires_grad``.
    :meth:`changed` says what an attacker changed in place and puts it back, so that the next
    attacker is given the model the server sent."""

    def __init__(self, model: Any) -> None:
        self.model = model
        modules = getattr(model, "modules", None)
        self.active = callable(modules)  # an nn.Module (a Ray ObjectRef or a stand-in has nothing to guard)
        if self.active:
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.modes = [m.training for m in model.modules()]
            self.grads = [p.requires_grad for p in model.parameters()]

    def changed(self) -> str | None:
        """What differs from the snapshot (None: nothing), after putting the snapshot back."""
        if not self.active:
            return None
        what = None
        state = self.model.state_dict()
        if set(state) != set(self.state):
            what = f"its state's names ({len(state)} entries, were {len(self.state)})"
        else:
            bad = next((k for k, v in state.items() if not _same(v.detach(), self.state[k])), None)
            if bad is not None:
                what = f"the model's {bad!r}"
        modes = [m.training for m in self.model.modules()]
        if what is None and modes != self.modes:
            what = "the model's train/eval mode"
        grads = [p.requires_grad for p in self.model.parameters()]
        if what is None and grads != self.grads:
            what = "the model's requires_grad flags"
        if what is not None:
            self.model.load_state_dict(self.state, strict=False)
            for m, mode in zip(self.model.modules(), self.modes):
                m.training = mode
            for p, flag in zip(self.model.parameters(), self.grads):
                p.requires_grad_(flag)
        return what


def run_attack(attack: Any, model: Any, updates: Sequence[dict], metadatas: Sequence[AttackMetadata],
               batched: bool = True, guard: ModelGuard | None = None) -> tuple[list, float]:
    """(results, seconds) of one attacker on one round's updates: one ``reconstruct_many`` call, or
    one ``reconstruct`` per update (``batched=False``, the reference path the tests compare with).

    The one boundary around an attack's call in the benchmark: the attack gets its own copy of each
    update; whatever it raises (``SystemExit`` and its own ``KeyboardInterrupt`` included; the
    user's interrupt is re-raised) fails its results with the reason; what it returns is checked
    (:func:`attacks.api.base.check_results`); and one that changed the model in place (``guard``,
    :class:`ModelGuard`; the model is put back) has its results failed saying so."""
    from attacks.api.base import Attack, check_results, failed_result
    from attacks.api.errors import ErrorReason
    from fedmjp import plugins

    if not isinstance(attack, Attack):
        # Every attack the benchmark builds is an Attack (the registry and the plug-in loader refuse
        # anything else); a stand-in object (the runners' own tests) is called as it is.
        t0 = time.perf_counter()
        if batched:
            return attack.reconstruct_many(model, list(updates), list(metadatas)), time.perf_counter() - t0
        return [attack.reconstruct(model, u, m) for u, m in zip(updates, metadatas)], time.perf_counter() - t0
    name = attack.name or type(attack).__name__
    guard = guard if guard is not None else ModelGuard(model)
    given = [{k: _copy(v) for k, v in u.items()} if isinstance(u, Mapping) else u for u in updates]
    t0 = time.perf_counter()
    try:
        if batched:
            results: Any = attack.reconstruct_many(model, list(given), list(metadatas))
        else:
            results = [attack.reconstruct(model, u, m) for u, m in zip(given, metadatas)]
    except (Exception, SystemExit, KeyboardInterrupt) as err:
        if isinstance(err, KeyboardInterrupt) and plugins.interrupted_by_user():
            raise
        _logger.error("attack %s raised past its guard: %s", name, type(err).__name__)
        results = [failed_result(m, ErrorReason.from_exception(err)) for m in metadatas]
    seconds = time.perf_counter() - t0
    results = check_results(results, name, list(metadatas), seconds)
    # the update was the attack's own copy: whatever it did to it reaches no other attacker; the
    # model is shared, so a change to it fails this attacker's results and is undone
    changed = guard.changed()
    if changed is not None:
        reason = ErrorReason.of(f"attack {name!r} changed the model in place ({changed}); an attack must "
                                "leave the model it is given as it is (work on a copy)")
        _logger.error("%s", reason)
        results = [failed_result(m, reason) for m in metadatas]
    return results, seconds


#: What a runner's job gives: the attack's results (one per update) and the seconds the call took.
JobResult = tuple[list, float]


@dataclass(frozen=True)
class AttackCall:
    """Attacker ``index`` (the pipeline's attacker order) on ``updates`` with their ``metadatas``."""

    index: int
    updates: Sequence[dict]
    metadatas: Sequence[AttackMetadata]


def run_calls(attacks: Sequence[Any], model: Any, calls: Sequence[AttackCall], batched: bool = True) -> list[JobResult]:
    """:func:`run_attack` for each call, one after the other (what one job of a runner does); one
    :class:`ModelGuard` of the model for all of them."""
    guard = ModelGuard(model)
    return [run_attack(attacks[c.index], model, c.updates, c.metadatas, batched, guard) for c in calls]


class Runner(Protocol):
    """Where the pipeline's attack calls run: ``slots`` (attacks that run at the same time),
    :meth:`share` (the model as jobs take it), :meth:`submit` (a round's calls; a Future per call),
    :meth:`close`."""

    @property
    def slots(self) -> int: ...

    def share(self, model: Any) -> Any: ...

    def submit(self, model: Any, calls: Sequence[AttackCall], batched: bool = True) -> list[Future[JobResult]]: ...

    def close(self) -> None: ...


class LocalRunner:
    """Attacks in this process, at submission: :meth:`submit` returns a Future already done.

    Not a ``ThreadPoolExecutor``: :meth:`share` hands jobs the server's model itself, which the attack
    thread loads the next round's weights into right after submitting, so a job must be finished by
    then; a completed Future keeps the runners' one interface.
    """

    #: Attacks that run at the same time.
    slots = 1

    def __init__(self, attacks: Sequence[Any]) -> None:
        self.attacks = list(attacks)

    def share(self, model: Any) -> Any:
        """The model as :meth:`submit` takes it, for every job of a round: the model itself."""
        return model

    def submit(self, model: Any, calls: Sequence[AttackCall], batched: bool = True) -> list[Future[JobResult]]:
        """Run the calls now, in order (an error of an attack is raised here); their done Futures."""
        jobs: list[Future[JobResult]] = []
        for result in run_calls(self.attacks, model, calls, batched):
            jobs.append(Future())
            jobs[-1].set_result(result)
        return jobs

    def close(self) -> None:
        pass


class _AttackWorker:
    """A Ray actor holding the run's attack objects (built once, shipped once)."""

    def __init__(self, attacks: list) -> None:
        import torch

        torch.set_num_threads(1)  # one CPU per actor: Ray schedules one actor per requested CPU
        self.attacks = attacks

    def run(self, model: Any, calls: list[AttackCall], batched: bool) -> Any:
        """The calls in order, one return value each (Ray's ``num_returns``: a single call's result
        is returned as is, several as a tuple)."""
        results = run_calls(self.attacks, model, calls, batched)
        return results[0] if len(results) == 1 else tuple(results)


def gpu_share(workers: int, gpus: int) -> float:
    """The GPUs each of ``workers`` attack workers requests from a Ray cluster with ``gpus`` GPUs:
    one whole GPU each where there are enough, else 1/k with k = ceil(workers / gpus) workers per
    GPU (Ray places fractions of a GPU on one GPU, so k shares of 1/k fill each GPU and every worker
    fits; with one GPU, 1/workers).

    Raises:
        ConfigError: no GPU in the cluster.
    """
    if gpus < 1:
        raise ConfigError("device is CUDA but the Ray cluster has no GPU for the attack workers; run with "
                          "--device cpu, or start Ray on GPU nodes")
    return 1.0 if workers <= gpus else 1.0 / math.ceil(workers / gpus)


class RayRunner:
    """Attacks on ``workers`` Ray actors (one CPU each; with a CUDA ``device``, also a share of the
    cluster's GPUs, :func:`gpu_share`: the attacks built with ``device: cuda`` compute there).

    Args:
        attacks: the attack objects, in the pipeline's attacker order.
        workers: number of actors.
        address: a Ray cluster address (``ray://host:10001`` or ``auto``); None starts a local Ray
            instance with ``workers`` CPUs (never more than this machine has) and this machine's GPUs.
        device: the run's device; CUDA gives every actor its GPU share.
    """

    def __init__(self, attacks: Sequence[Any], workers: int, address: str | None = None,
                 device: Any = None) -> None:
        import ray
        import torch

        cuda = device is not None and torch.device(device).type == "cuda"

        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
                   "OMP_NUM_THREADS": "1"}
            kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "include_dashboard": False,
                                      "logging_level": logging.WARNING, "log_to_driver": False}
            if address:
                try:
                    ray.init(address=address, **kwargs)
                except (ConnectionError, TimeoutError, RuntimeError, ValueError) as err:
                    raise ConfigError(f"cannot connect to the Ray cluster at ray_address={address!r}: "
                                      f"{' '.join(str(err).split())[:300]}; start it, fix --ray-address, or "
                                      "leave it out to attack on this machine") from err
            else:
                ray.init(num_cpus=min(int(workers), os.cpu_count() or 1),
                         num_gpus=torch.cuda.device_count() if cuda else None, **kwargs)
            self.started = True
        share = gpu_share(int(workers), int(ray.cluster_resources().get("GPU", 0))) if cuda else 0.0
        actor = ray.remote(num_cpus=1, num_gpus=share)(_AttackWorker)
        shared = ray.put(list(attacks))
        #: per attacker: does it share the update's estimate store (its calls of a round go together)
        self.shares = [bool(getattr(a, "shares_estimates", False)) for a in attacks]
        self.actors = [actor.remote(shared) for _ in range(int(workers))]
        self.jobs: list[list[Future]] = [[] for _ in self.actors]  # per actor, the jobs sent to it
        _logger.info("attacks run on %d Ray worker(s)%s", len(self.actors), f" at {address}" if address else "")

    @property
    def slots(self) -> int:
        """Attacks that run at the same time: one per actor."""
        return len(self.actors)

    def share(self, model: Any) -> Any:
        """The model in Ray's object store, shipped once per round for every attacker's job."""
        return self.ray.put(model)

    def submit(self, model: Any, calls: Sequence[AttackCall], batched: bool = True) -> list[Future[JobResult]]:
        """Queue each call on the actor with the fewest unfinished jobs, the calls of attackers that
        share estimates together as one task (in their order: one process, one unpickled estimate
        store per update); an ObjectRef as a Future per call.

        Not ``ray.util.ActorPool``: it holds one job per actor and queues the rest in this process
        until its results are fetched (``get_next``) in submission order, and hands out no per-job
        handle, while the pipeline keeps several rounds in flight and asks each round's jobs whether
        they are done."""
        tasks: list[list[AttackCall]] = []
        together: list[AttackCall] = []  # the calls that share estimates, a task where the first of them is
        for call in calls:
            if not self.shares[call.index]:
                tasks.append([call])
            elif not together:
                together.append(call)
                tasks.append(together)
            else:
                together.append(call)
        futures: list[tuple[AttackCall, Future[JobResult]]] = []
        for task in tasks:
            self.jobs = [[j for j in jobs if not j.done()] for jobs in self.jobs]
            k = min(range(len(self.actors)), key=lambda i: len(self.jobs[i]))  # the least busy actor
            # ignore: Ray types an actor handle as ActorHandle | type[_AttackWorker], whose methods have
            # no .options/.remote (Ray's own typing needs @ray.method, which would import Ray here)
            refs = self.actors[k].run.options(num_returns=len(task)).remote(  # type: ignore[attr-defined]
                model, task, batched)
            for call, ref in zip(task, refs if len(task) > 1 else [refs]):
                futures.append((call, ref.future()))
                self.jobs[k].append(futures[-1][1])
        return [next(f for c, f in futures if c is call) for call in calls]

    def close(self) -> None:
        """Stop the actors; shut Ray down if this runner started it."""
        for a in self.actors:
            self.ray.kill(a)  # type: ignore[arg-type]  # an ActorHandle (Ray types it ActorHandle | type)
        self.actors = []
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()


Round = TypeVar("Round")


class RoundDispatch(Generic[Round]):
    """A federation's rounds whose attack jobs are on a runner, oldest first, until they are scored.

    :meth:`submit` sends one attack call to the runner; :meth:`add` queues a round with its jobs;
    :meth:`drain` hands the rounds whose jobs are all done to ``finish``: the oldest first, a later
    one first where an older one still runs (on Ray workers). At most :attr:`limit` rounds stay in
    flight: :meth:`add` beyond that waits for the oldest, so the updates held in memory stay bounded.
    A round is whatever the caller keeps beside its jobs (the group attacker's ``_Round``, benchmark/group_attacker.py).

    Args:
        runner: where the attacks run (:func:`make_runner`).
        finish: called once per round, in the attack thread, when its jobs are done.
        batched: one ``reconstruct_many`` call per job (False: one ``reconstruct`` per update).
    """

    def __init__(self, runner: Runner, finish: Callable[[Round], None], batched: bool = True) -> None:
        self.runner, self.finish, self.batched = runner, finish, batched
        #: Rounds allowed in flight before :meth:`add` waits: two per attack that runs at once.
        self.limit = 2 * max(int(runner.slots), 1)
        self.pending: list[tuple[Round, list[Future[JobResult]]]] = []  # submitted, not finished yet

    def share(self, model: Any) -> Any:
        """The model as the round's jobs take it (:meth:`Runner.share`, e.g. put in Ray's object store once)."""
        return self.runner.share(model)

    def submit(self, model: Any, calls: Sequence[AttackCall]) -> list[Future[JobResult]]:
        """A round's attack calls: the runner's jobs, one per call."""
        return self.runner.submit(model, calls, self.batched)

    def add(self, item: Round, jobs: Sequence[Future[JobResult]]) -> None:
        """Queue a round whose jobs were submitted; beyond :attr:`limit` rounds, finish the oldest."""
        self.pending.append((item, list(jobs)))
        if len(self.pending) > self.limit:
            self.drain(keep=self.limit)

    def drain(self, keep: int | None = None) -> None:
        """Finish the rounds whose jobs are done; with ``keep``, first wait (oldest first) until at most
        ``keep`` rounds are left in flight (``keep=0``: every round, at the federation's end)."""
        while self.pending:
            i = 0  # the oldest round
            if not (keep is not None and len(self.pending) > keep) and not _done(self.pending[0][1]):
                i = next((k for k, (_, jobs) in enumerate(self.pending) if _done(jobs)), -1)
                if i < 0:
                    return
            item, jobs = self.pending.pop(i)
            wait(jobs)  # the oldest round may still run on Ray workers: its results are needed now
            self.finish(item)


def _done(jobs: Sequence[Future]) -> bool:
    return all(j.done() for j in jobs)


#: Seconds to wait for a TCP connection to a Ray cluster's address before giving up (Ray's own
#: client retries for about half a minute).
CONNECT_TIMEOUT_S = 5.0


def check_ray_address(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast when a ``host:port`` Ray address (``ray://host:10001`` or a GCS ``host:6379``)
    accepts no TCP connection; ``auto`` and ``local`` are left to Ray.

    Raises:
        ConfigError: the address is malformed or nothing listens there.
    """
    import socket
    from urllib.parse import urlsplit

    if address in ("auto", "local"):
        return
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as err:  # a port that is not a number or out of range
        raise ConfigError(f"ray_address={address!r} is not a Ray address ({err}); use ray://host:10001 or "
                          "host:6379") from err
    if not host or port is None:
        raise ConfigError(f"ray_address={address!r} names no host:port; use ray://host:10001 or host:6379")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as err:
        raise ConfigError(f"cannot reach the Ray cluster at ray_address={address!r} ({host}:{port}: "
                          f"{err.strerror or err}); start it, fix --ray-address, or leave it out to attack on "
                          "this machine") from err


def make_runner(attacks: Sequence[Any], workers: int, address: str | None = None, device: Any = None) -> Runner:
    """:class:`RayRunner` for ``workers`` >= 1 or a cluster address (``device``: the run's device,
    CUDA gives its actors GPUs), else :class:`LocalRunner`."""
    if workers >= 1 or address:
        return RayRunner(attacks, max(int(workers), 1), address, device)
    return LocalRunner(attacks)

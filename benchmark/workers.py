"""Where the attacks of a benchmark run: in this process, or spread over Ray workers.

The pipeline hands every round's updates to a runner as one call per attacker
(``attack.reconstruct_many``: the batched attacks solve them together) and scores the results when
they are ready. :class:`LocalRunner` attacks at once, in this process. :class:`RayRunner` sends the
call to one of ``workers`` Ray actors (a local Ray instance of that many CPUs, or a running cluster
at ``address``) and returns at once, so the federation's next round and other workers' attacks go
on meanwhile; the attacks are deterministic functions of (model, update, metadata), so the rows are
the same as in a single process. On a cluster, every node needs this checkout importable (the same
code and libraries, e.g. an editable install of the project).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

_logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]


def run_attack(attack: Any, model: Any, updates: Sequence[dict], metadatas: Sequence[dict],
               batched: bool = True) -> tuple[list, float]:
    """(results, seconds) of one attacker on one round's updates: one ``reconstruct_many`` call, or
    one ``reconstruct`` per update (``batched=False``, the reference path the tests compare with)."""
    t0 = time.perf_counter()
    if batched:
        results = attack.reconstruct_many(model, list(updates), list(metadatas))
    else:
        results = [attack.reconstruct(model, u, m) for u, m in zip(updates, metadatas)]
    return results, time.perf_counter() - t0


@dataclass
class _Done:
    """A finished local job."""

    value: tuple[list, float]


class LocalRunner:
    """Attacks in this process, at submission.

    A runner's interface (what the pipeline uses): ``slots`` (attacks that run at the same time),
    :meth:`share` (the model as jobs take it), :meth:`submit`, :meth:`ready`, :meth:`result`,
    :meth:`close`.
    """

    #: Attacks that run at the same time.
    slots = 1

    def __init__(self, attacks: Sequence[Any]) -> None:
        self.attacks = list(attacks)

    def share(self, model: Any) -> Any:
        """The model as :meth:`submit` takes it, for every job of a round: the model itself."""
        return model

    def submit(self, index: int, model: Any, updates: Sequence[dict], metadatas: Sequence[dict],
               batched: bool = True) -> _Done:
        return _Done(run_attack(self.attacks[index], model, updates, metadatas, batched))

    def ready(self, job: Any) -> bool:
        return True

    def result(self, job: Any) -> tuple[list, float]:
        return job.value

    def close(self) -> None:
        pass


class _AttackWorker:
    """A Ray actor holding the run's attack objects (built once, shipped once)."""

    def __init__(self, attacks: list) -> None:
        import torch

        torch.set_num_threads(1)  # one CPU per actor: Ray schedules one actor per requested CPU
        self.attacks = attacks

    def run(self, index: int, model: Any, updates: list, metadatas: list, batched: bool) -> tuple[list, float]:
        return run_attack(self.attacks[index], model, updates, metadatas, batched)


class RayRunner:
    """Attacks on ``workers`` Ray actors (one CPU each).

    Args:
        attacks: the attack objects, in the pipeline's attacker order.
        workers: number of actors.
        address: a Ray cluster address (``ray://host:10001`` or ``auto``); None starts a local Ray
            instance with ``workers`` CPUs (never more than this machine has).
    """

    def __init__(self, attacks: Sequence[Any], workers: int, address: str | None = None) -> None:
        import ray

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
                ray.init(num_cpus=min(int(workers), os.cpu_count() or 1), **kwargs)
            self.started = True
        actor = ray.remote(num_cpus=1)(_AttackWorker)
        shared = ray.put(list(attacks))
        self.actors = [actor.remote(shared) for _ in range(int(workers))]
        self.in_flight = [0] * len(self.actors)
        self.owner: dict[Any, int] = {}
        _logger.info("attacks run on %d Ray worker(s)%s", len(self.actors), f" at {address}" if address else "")

    @property
    def slots(self) -> int:
        """Attacks that run at the same time: one per actor."""
        return len(self.actors)

    def share(self, model: Any) -> Any:
        """The model in Ray's object store, shipped once per round for every attacker's job."""
        return self.ray.put(model)

    def submit(self, index: int, model: Any, updates: Sequence[dict], metadatas: Sequence[dict],
               batched: bool = True) -> Any:
        k = min(range(len(self.actors)), key=self.in_flight.__getitem__)  # the least busy actor
        ref = self.actors[k].run.remote(index, model, list(updates), list(metadatas), batched)
        self.in_flight[k] += 1
        self.owner[ref] = k
        return ref

    def ready(self, job: Any) -> bool:
        done, _ = self.ray.wait([job], timeout=0)
        return bool(done)

    def result(self, job: Any) -> tuple[list, float]:
        value = self.ray.get(job)
        k = self.owner.pop(job, None)
        if k is not None:
            self.in_flight[k] -= 1
        return value

    def close(self) -> None:
        """Stop the actors; shut Ray down if this runner started it."""
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()


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


def make_runner(attacks: Sequence[Any], workers: int, address: str | None = None) -> Any:
    """:class:`RayRunner` for ``workers`` >= 1 or a cluster address, else :class:`LocalRunner`."""
    if workers >= 1 or address:
        return RayRunner(attacks, max(int(workers), 1), address)
    return LocalRunner(attacks)

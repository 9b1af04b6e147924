"""Run a federation from Python: Flower's simulation engine, or an in-process engine for tests.

Both engines run the same ServerApp and ClientApp code (:func:`server.server_app.make_server_app`,
:func:`clients.client_app.make_client_app`); the tap is a Python callback because in both the
ServerApp runs in this process (Flower's ``run_simulation`` runs it in a thread; the ClientApps run
in Ray actor processes).

``engine="inprocess"`` replaces Flower's SuperLink state, message queues and Ray actors by
:class:`LocalGrid`, a :class:`flwr.serverapp.Grid` that calls the ClientApp object directly in
worker threads. It bypasses: process isolation and Ray resource scheduling, Flower's message store
and TTL handling, message ids and serialisation between processes (Message objects are passed by
reference; ArrayRecords already hold serialised bytes; each node gets its own copy of the config
records, as serialisation would give it). It keeps: the ServerApp main, the strategy
(sampling, configure/aggregate, timeout), the ClientApp handlers, per-node Contexts with Flower's
``partition-id``/``num-partitions`` node config, and error replies for clients that raise
(ErrorCode CLIENT_APP_RAISED_EXCEPTION, as Flower's simulation sends).
"""
from __future__ import annotations

import logging
import os
import queue
import random
import time
import traceback
import uuid
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

import torch

from fedmjp.threads import start_daemon

from .offline import keep_flower_offline

# Before the Flower imports below, so nothing Flower does at import or run time sees them unset.
keep_flower_offline()

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict  # noqa: E402
from flwr.app.message import make_message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.run import Run  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from clients.runconfig import RunConfig  # noqa: E402
from clients.client_app import make_client_app  # noqa: E402

from .rounds import ServerOutcome  # noqa: E402
from .server_app import make_server_app  # noqa: E402
from .tap import Tap  # noqa: E402

_logger = logging.getLogger(__name__)

ENGINES = ("simulation", "inprocess")


@dataclass
class FederationResult(ServerOutcome):
    """Outcome of :func:`run_federation`: the server's outcome plus how the run was made.

    Attributes (beyond :class:`server.rounds.ServerOutcome`'s history, failures, final_state,
    node_partitions, failed_rounds and ok):
        run_config: the resolved config both apps ran with (num-partitions = number of clients);
            pass it to :func:`clients.partition.private_batch` for the ground truth.
        engine: ``simulation`` or ``inprocess``.
        seconds: wall time of the whole run, start-up included.
    """

    run_config: RunConfig = field(default_factory=RunConfig)
    engine: str = "inprocess"
    seconds: float = 0.0


class DaemonPool:
    """A fixed set of daemon worker threads running submitted calls, each with its Future.

    Not :class:`concurrent.futures.ThreadPoolExecutor`: the interpreter joins its threads at exit,
    so one client hung past the round timeout would keep the process alive after the run's
    results are written (and after Ctrl-C). A daemon thread ends with the process; the CLI's
    :func:`fedmjp.threads.exit_process` first gives it a bounded time to finish its call.
    """

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Optional[tuple[Future, Any, tuple]]] = queue.SimpleQueue()
        self._threads = [start_daemon(self._work, f"{name}_{i}") for i in range(max(1, workers))]

    def submit(self, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001  (the Future carries it to the caller)
                future.set_exception(err)

    def shutdown(self) -> None:
        """Cancel the calls not started and let every thread end after its current call."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)


class LocalGrid(Grid):
    """A Grid that delivers messages to a ClientApp object in this process (worker threads).

    It implements Flower's abstract Grid interface and nothing more; the Flower internals it and
    :func:`_run_inprocess` rely on (``Run``, ``TaskIdentity``, ``SUPERLINK_NODE_ID``, the error
    reply) are pinned by tests/test_flower_internals.py, which names the symbol an upgrade broke.

    Args:
        client_app: the ClientApp every node runs.
        num_nodes: number of nodes; node ``i`` gets ``partition-id=i``.
        run_config: the nodes' ``context.run_config``.
        seed: seeds the (Flower-like, random 63-bit) node ids.
        max_workers: client threads running at once (default: the CPU count, at most all nodes:
            more threads only oversubscribe the cores, and every client thread builds its own model);
            daemon threads (:class:`DaemonPool`).
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: Mapping[str, Any],
                 seed: int = 0, max_workers: Optional[int] = None) -> None:
        self.client_app = client_app
        rng = random.Random(seed)
        self.node_ids = [rng.getrandbits(63) for _ in range(num_nodes)]
        self._run: Optional[Run] = None
        self.contexts = {
            node_id: Context(run_id=0, node_id=node_id, node_config={"partition-id": i, "num-partitions": num_nodes},
                             state=RecordDict(), run_config=dict(run_config))
            for i, node_id in enumerate(self.node_ids)
        }
        workers = max_workers or min(num_nodes, os.cpu_count() or 1)
        self._pool = DaemonPool(workers, "clientapp")
        self._pending: dict[str, Future] = {}

    def set_run(self, run: Run) -> None:
        self._run = run
        for ctx in self.contexts.values():
            ctx.run_id = run.run_id

    @property
    def run(self) -> Run:
        if self._run is None:
            raise RuntimeError("LocalGrid.set_run was not called")
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: Optional[float] = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_ids)

    def _deliver(self, message: Message) -> Message:
        context = self.contexts[message.metadata.dst_node_id]
        try:
            return self.client_app(_own_config_records(message), context)
        except Exception as ex:  # a failing client becomes an error reply, as in Flower's engines
            _logger.warning("ClientApp on node %d raised: %s", message.metadata.dst_node_id, ex)
            _logger.debug("%s", traceback.format_exc())
            reason = f"{type(ex)}:<'{ex}'>"
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            if message.metadata.dst_node_id not in self.contexts:
                raise ValueError(f"unknown node id {message.metadata.dst_node_id}")
            msg_id = str(uuid.uuid4())
            self._pending[msg_id] = self._pool.submit(self._deliver, message)
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        for msg_id in list(message_ids):
            future = self._pending.get(msg_id)
            if future is not None and future.done():
                replies.append(future.result())
                del self._pending[msg_id]
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None
                         ) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        wait([self._pending[i] for i in ids], timeout=timeout)
        late = [i for i in ids if not self._pending[i].done()]
        if late:
            _logger.warning("%d client(s) did not reply within %.1f s", len(late), timeout or 0.0)
        return self.pull_messages(ids)

    def close(self) -> None:
        """Stop accepting work; clients still running (timed out) finish in the background, in
        daemon threads that never keep the process alive."""
        self._pool.shutdown()


def _own_config_records(message: Message) -> Message:
    """``message`` with its own copy of every ConfigRecord (arrays and metrics shared).

    Flower's engines serialise each message, so every node reads its own records. A server may put
    one content object into the messages of several nodes (SecAgg+'s set-up stage does), and a
    handler may edit its config (Flower's ``secaggplus_mod`` pops the stage key): passed by
    reference, the first node's edit would reach the others.
    """
    if not message.has_content():
        return message
    content = RecordDict({key: ConfigRecord(dict(record)) if isinstance(record, ConfigRecord) else record
                          for key, record in message.content.items()})
    return make_message(metadata=message.metadata, content=content)


def simulation_backend_config(client_cpus: float = 1.0, num_cpus: Optional[int] = None,
                              client_gpus: Optional[float] = None, num_supernodes: int = 2) -> dict[str, Any]:
    """Ray backend config with CPU requests kept within this machine (asking Ray for more CPUs
    than exist makes the simulation hang). ``client_gpus`` None: 1/num_supernodes of a GPU when
    CUDA is present, else 0."""
    cores = os.cpu_count() or 1
    total = min(cores, num_cpus or cores)
    if client_cpus > total:
        raise ValueError(f"client_cpus={client_cpus} exceeds the {total} CPU(s) given to Ray")
    if client_gpus is None:
        client_gpus = 1.0 / max(1, num_supernodes) if torch.cuda.is_available() else 0.0
    init_args: dict[str, Any] = {"num_cpus": total}
    if client_gpus:
        init_args["num_gpus"] = torch.cuda.device_count()
    return {"client_resources": {"num_cpus": client_cpus, "num_gpus": float(client_gpus)}, "init_args": init_args}


def run_federation(cfg: RunConfig, tap: Optional[Tap] = None, engine: str = "simulation",
                   num_supernodes: Optional[int] = None, client_cpus: float = 1.0, num_cpus: Optional[int] = None,
                   client_gpus: Optional[float] = None, keep_ray: bool = False) -> FederationResult:
    """Run ``num-server-rounds`` federated rounds and return the outcome.

    Args:
        cfg: the federation's typed run config (:class:`clients.runconfig.RunConfig`); the apps get it
            as Flower's flat run config (:meth:`~clients.runconfig.RunConfig.wire`).
        tap: called in this process with every client update before aggregation.
        engine: ``simulation`` (Flower's ``run_simulation``, Ray backend) or ``inprocess``
            (:class:`LocalGrid`, for tests).
        num_supernodes: number of clients (default: the config's ``num-partitions``).
        client_cpus, num_cpus, client_gpus: Ray resources (simulation only).
        keep_ray: leave Ray running after a simulation (faster repeated runs in one process).

    Returns:
        the :class:`FederationResult`; client failures are recorded in it, never raised. An
        exception raised by ``tap`` (or by the server itself) aborts the run and propagates.

    Raises:
        TypeError: ``cfg`` is not a :class:`~clients.runconfig.RunConfig` (a mapping of keys, say).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    if not isinstance(cfg, RunConfig):  # the typed config, read once from run-config keys
        raise TypeError(f"run_federation takes a clients.runconfig.RunConfig (resolve_config(keys) reads one "
                        f"from run-config keys), got {type(cfg).__name__}")
    keep_flower_offline()
    n = int(num_supernodes or cfg.num_partitions)
    cfg = cfg.with_values({"num-partitions": n, **({} if "min_nodes" in cfg.model_fields_set else {"min-nodes": n})})
    outcomes: list[ServerOutcome] = []
    server_app = make_server_app(cfg.wire(), tap=tap, on_finish=outcomes.append)
    client_app = make_client_app(cfg.wire())
    start = time.perf_counter()
    if engine == "simulation":
        _run_simulation(server_app, client_app, n, simulation_backend_config(client_cpus, num_cpus, client_gpus, n),
                        keep_ray)
    else:
        _run_inprocess(server_app, client_app, n, cfg)
    seconds = time.perf_counter() - start
    if not outcomes:
        raise RuntimeError(f"the ServerApp finished without an outcome ({engine} engine)")
    out = outcomes[0]
    result = FederationResult(out.history, out.failures, out.final_state, out.node_partitions,
                              run_config=cfg, engine=engine, seconds=seconds)
    if result.failed_rounds:
        _logger.error("rounds without any usable client update: %s", result.failed_rounds)
    return result


def _run_inprocess(server_app: Any, client_app: ClientApp, num_nodes: int, cfg: RunConfig) -> None:
    grid = LocalGrid(client_app, num_nodes, cfg.wire(), seed=cfg.seed)
    run = Run.create_empty(run_id=random.Random(cfg.seed).getrandbits(63))
    grid.set_run(run)
    # Messages take their run and source ids from this process-wide identity (as run_simulation sets it).
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run.run_id, SUPERLINK_NODE_ID
    context = Context(run_id=run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=cfg.wire())
    try:
        server_app(grid=grid, context=context)
    finally:
        grid.close()


def _run_simulation(server_app: Any, client_app: ClientApp, num_supernodes: int, backend_config: dict[str, Any],
                    keep_ray: bool) -> None:
    import sys

    from flwr.simulation import run_simulation

    # Ray workers import clients/, server/ and fedmjp/ by name: make sure the checkout is on the
    # path Flower hands to Ray (it forwards this process's sys.path as PYTHONPATH).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_supernodes,
                       backend_config=backend_config)
    finally:
        if not keep_ray:
            import ray

            if ray.is_initialized():
                ray.shutdown()

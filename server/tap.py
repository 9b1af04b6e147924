"""What an honest-but-curious server sees of each client update, and a folder store for it.

The tap receives one :class:`TappedUpdate` per client reply, before aggregation. It holds only what
a real Flower server holds: the reply's arrays and metrics, the node id, the global weights it sent,
and the round configuration it sent. The ground truth (x, x~) never passes through here.

Under secure aggregation (``secagg = true``, :mod:`server.secagg`) the server holds no client's
update: the tap receives one :class:`TappedUpdate` per round, the aggregate of the round's K
clients (``num_clients`` K, ``num_examples`` their K*B images, node and partition id
:data:`AGGREGATE_ID`, the clients it covers in ``node_ids`` / ``partition_ids``).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from .outdir import UPDATES, OutDir, OutDirError, read_marker

_logger = logging.getLogger(__name__)

UPDATE_KINDS = ("gradients", "delta")

#: node_id and partition_id of a K-client aggregate (no single node or partition; -1 already means
#: "reported no partition" for a client's own update).
AGGREGATE_ID = -2


@dataclass
class TappedUpdate:
    """One client's reply as the server sees it.

    Attributes:
        server_round: 1-based round.
        node_id: Flower node id the reply came from.
        partition_id: the client's self-reported partition id (-1 if it reported none); the
            benchmark uses it only to look up the ground truth.
        kind: ``gradients`` (FedSGD: dL/dw of one batch) or ``delta`` (FedAvg: w_after - w_before).
        arrays: parameter name -> tensor of the parameter's shape (CPU); the server's is a
            :class:`clients.records.LazyState`, which copies an array out of the reply when it is
            first read (do not modify the tensors).
        global_state: full state dict the client started from (shared by all updates of a round;
            do not modify).
        num_examples: examples the client reports to have used.
        metrics: the reply's metric record (loss, ...).
        metadata: what the server configured or knows: mode, setting, gamma, batch-size, lr,
            local-steps, input mean/std, image size, model spec (and, for an aggregate,
            ``aggregation``: ``secaggplus-mean``).
        num_clients: K, the clients whose updates this one averages (1: one client's own reply).
        node_ids, partition_ids: for an aggregate, the nodes and partitions it covers, in the same
            order (empty for a client's own reply: ``node_id`` / ``partition_id`` say it).
    """

    server_round: int
    node_id: int
    partition_id: int
    kind: str
    arrays: Mapping[str, torch.Tensor]
    global_state: dict[str, torch.Tensor]
    num_examples: int
    metrics: dict[str, float]
    metadata: dict[str, Any] = field(default_factory=dict)
    num_clients: int = 1
    node_ids: list[int] = field(default_factory=list)
    partition_ids: list[int] = field(default_factory=list)

    @property
    def is_aggregate(self) -> bool:
        """Whether this is a K-client aggregate (secure aggregation) rather than one client's reply."""
        return self.node_id == AGGREGATE_ID


@dataclass
class Failure:
    """A client that did not deliver a usable update in a round."""

    server_round: int
    node_id: int
    partition_id: Optional[int]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Tap = Callable[[TappedUpdate], None]


class FolderTap:
    """A tap that stores every update under the out-dir's ``updates/`` (for runs whose ServerApp
    lives in another process, e.g. ``flwr run`` or the deployment engine), through the out-dir's
    guarded writer (:class:`server.outdir.OutDir`: atomic, never through a link).

    Layout: ``round-0001-global.pt`` (the state sent in that round, once) and
    ``round-0001-node-<id>.pt`` (arrays plus a JSON header with the other fields, and the run id of
    the out-dir's marker), or ``round-0001-aggregate.pt`` for a secure-aggregation round's aggregate.
    """

    def __init__(self, out: OutDir) -> None:
        self.out = out
        self._saved_globals: set[int] = set()

    def __call__(self, update: TappedUpdate) -> None:
        r = update.server_round
        if r not in self._saved_globals:
            self.out.save_torch(f"{UPDATES}/round-{r:04d}-global.pt", update.global_state)
            self._saved_globals.add(r)
        # The header's fields only (asdict would deep-copy the arrays and global state first).
        header = {f.name: getattr(update, f.name) for f in fields(update) if f.name not in ("arrays", "global_state")}
        # a dict of str, tensors and a dict of tensors: weights_only loads it
        payload = {"header": json.dumps(header), "run": self.out.run_id, "arrays": dict(update.arrays)}
        name = "aggregate" if update.is_aggregate else f"node-{update.node_id}"
        self.out.save_torch(f"{UPDATES}/round-{r:04d}-{name}.pt", payload)


def _load_pt(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  (torch raises many types for a damaged or foreign file)
        raise OutDirError(f"{path} is not a tapped update a server run wrote ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}); remove it or use the run's own out-dir") \
            from None


def load_tapped_updates(folder: str | Path) -> list[TappedUpdate]:
    """Read back what :class:`FolderTap` stored in an out-dir's ``updates/``, sorted by (round,
    node id); safe loading only. Only the updates of the run the out-dir's marker names are read
    (a file of another run is skipped).

    Raises:
        OutDirError: the folder is missing, or a file is not an update a run wrote.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise OutDirError(f"{folder} is not a folder of tapped updates (a server run's out-dir/updates)")
    run = read_marker(folder.parent).get("run")
    globals_: dict[int, dict[str, torch.Tensor]] = {}
    updates = []
    paths = [*folder.glob("round-*-node-*.pt"), *folder.glob("round-*-aggregate.pt")]
    for path in sorted(paths):
        payload = _load_pt(path)
        if not isinstance(payload, dict) or not {"header", "arrays"} <= set(payload):
            raise OutDirError(f"{path} is not a tapped update a server run wrote; remove it")
        if run is not None and payload.get("run") != run:
            continue  # another run's file (the marker names the run this folder holds)
        try:
            header = json.loads(payload["header"])
            r = int(header["server_round"])
            if r not in globals_:
                globals_[r] = _load_pt(folder / f"round-{r:04d}-global.pt")
            updates.append(TappedUpdate(arrays=payload["arrays"], global_state=globals_[r], **header))
        except (TypeError, ValueError, KeyError) as err:
            raise OutDirError(f"{path} has a damaged header ({err}); remove it") from None
    return sorted(updates, key=lambda u: (u.server_round, u.node_id))

"""FedAvg and FedSGD strategies that hand every client reply to a tap before aggregating.

Both subclass Flower's message-based :class:`flwr.serverapp.strategy.FedAvg` and keep its node
sampling and message construction (``configure_train``); they replace ``aggregate_train``:

* :class:`TappedFedAvg`: clients reply weight deltas; w <- w + sum_i n_i delta_i / sum_i n_i.
* :class:`FedSGD`: clients reply one batch's gradients; w <- w - lr * sum_i n_i g_i / sum_i n_i.

A reply that carries an error, a malformed reply, or a sampled node that did not answer within the
round timeout becomes a :class:`~server.tap.Failure`; the round is aggregated over the others. A
round with no usable reply leaves the weights unchanged and is marked failed.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from typing import Any, Optional

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from clients.records import DecodeCache, LazyState, encode_state

from .tap import Failure, Tap, TappedUpdate

_logger = logging.getLogger(__name__)


class TappedFedAvg(FedAvg):
    """FedAvg over client weight deltas, with a tap on every reply.

    Args:
        tap: called with each usable reply, before aggregation (None: no tap).
        metadata: what the server knows, copied into every :class:`TappedUpdate`.
        **kwargs: :class:`flwr.serverapp.strategy.FedAvg` arguments.
    """

    update_kind = "delta"

    def __init__(self, *, tap: Optional[Tap] = None, metadata: Optional[dict[str, Any]] = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tap = tap
        self.metadata = dict(metadata or {})
        self.failures: list[Failure] = []
        self.node_partitions: dict[int, int] = {}
        self.rounds: dict[int, dict[str, Any]] = {}
        self._global: dict[str, torch.Tensor] = {}
        self._decode_global = DecodeCache()
        self._arrays: Optional[ArrayRecord] = None  # the record sent this round
        self._sent: list[int] = []
        self._started = 0.0

    # ------------------------------------------------------------------------- round set-up
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Flower's sampling and messages; remembers the weights sent and the nodes sampled."""
        self._started = time.perf_counter()
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._arrays = arrays
        self._global = self._decode_global(arrays)  # decoded once while the same record is resent
        self._sent = [m.metadata.dst_node_id for m in messages]
        return messages

    @property
    def global_state(self) -> dict[str, torch.Tensor]:
        """The weights sent this round, decoded (read-only; set by :meth:`configure_train`)."""
        return self._global

    # ------------------------------------------------------------------------- aggregation
    def apply(self, global_state: dict[str, torch.Tensor], mean_update: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
        """New global state from the weighted mean of the updates (FedAvg: add the mean delta)."""
        new = dict(global_state)
        for name, delta in mean_update.items():
            new[name] = (global_state[name].double() + delta.double()).to(global_state[name].dtype)
        return new

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """Record failures, tap every usable reply, then aggregate the usable ones."""
        replies = list(replies)
        usable: list[TappedUpdate] = []
        answered = set()
        for msg in replies:
            node_id = msg.metadata.src_node_id
            answered.add(node_id)
            if msg.has_error():
                self._fail(server_round, node_id, f"client error: {short_reason(msg.error.reason)}")
                continue
            try:
                update = self._parse(server_round, node_id, msg)
            except (KeyError, ValueError, TypeError) as err:
                self._fail(server_round, node_id, f"malformed reply: {type(err).__name__}: {err}")
                continue
            usable.append(update)
        for node_id in self._sent:
            if node_id not in answered:
                self._fail(server_round, node_id, "no reply within the round timeout")
        for update in sorted(usable, key=lambda u: u.node_id):
            if self.tap is not None:
                self.tap(update)
        self.rounds[server_round] = {
            "round": server_round, "sampled": len(self._sent), "replies": len(usable),
            "failures": len(self._sent) - len(usable),
            "train-loss": _weighted([u.metrics.get("loss", float("nan")) for u in usable],
                                    [u.num_examples for u in usable]),
            "seconds": time.perf_counter() - self._started,
        }
        if not usable:
            _logger.warning("round %d: no usable client update; the global model is unchanged", server_round)
            return None, None
        metrics = MetricRecord({k: float(v) for k, v in self.rounds[server_round].items()
                                if k != "round"})
        if self.leaves_weights_unchanged():
            # w - 0 * g == w exactly (updates are finite, _parse checks): the record sent this round
            # goes out again, with no mean and no re-serialisation of the weights (the paper protocol
            # attacks a fixed model: 1110 rounds of ~88 MB each).
            return self._arrays, metrics
        mean = self._weighted_mean(usable)
        new_state = self.apply(self._global, mean)
        return encode_state(new_state), metrics

    def leaves_weights_unchanged(self) -> bool:
        """True when aggregation cannot change the global weights (FedSGD with a zero server step)."""
        return False

    def _parse(self, server_round: int, node_id: int, msg: Message) -> TappedUpdate:
        content = msg.content
        metrics = dict(content["metrics"])
        num_examples = int(metrics[self.weighted_by_key])
        if num_examples < 1:
            raise ValueError(f"{self.weighted_by_key} must be >= 1, got {num_examples}")
        arrays = checked_arrays(content[self.arrayrecord_key], self._global)
        partition_id = int(metrics.get("partition-id", -1))
        if partition_id >= 0:
            self.node_partitions[node_id] = partition_id
        return TappedUpdate(server_round, node_id, partition_id, self.update_kind, arrays, self._global,
                            num_examples, {k: float(v) for k, v in metrics.items()}, dict(self.metadata))

    def _weighted_mean(self, updates: list[TappedUpdate]) -> dict[str, torch.Tensor]:
        total = float(sum(u.num_examples for u in updates))
        names = set().union(*(u.arrays for u in updates))
        mean = {}
        for name in names:
            # Accumulated in place in float64, in the order of ``updates``: the same values as
            # sum(double * n), with one temporary at a time instead of two per client.
            acc: Optional[torch.Tensor] = None
            for u in updates:
                if name not in u.arrays:
                    continue
                term = u.arrays[name].to(torch.float64, copy=True).mul_(u.num_examples)
                acc = term if acc is None else acc.add_(term)
            mean[name] = acc.div_(total)
        return mean

    def _fail(self, server_round: int, node_id: int, reason: str) -> None:
        partition_id = self.node_partitions.get(node_id)
        _logger.warning("round %d: node %d (partition %s) failed: %s", server_round, node_id, partition_id, reason)
        self.failures.append(Failure(server_round, node_id, partition_id, reason))


class FedSGD(TappedFedAvg):
    """FedSGD: clients reply one batch's gradients; w <- w - lr * (example-weighted mean gradient).

    Args:
        lr: server learning rate.
    """

    update_kind = "gradients"

    def __init__(self, *, lr: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lr = float(lr)

    def leaves_weights_unchanged(self) -> bool:
        return self.lr == 0.0

    def apply(self, global_state: dict[str, torch.Tensor], mean_update: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
        new = dict(global_state)
        for name, grad in mean_update.items():
            new[name] = (global_state[name].double() - self.lr * grad.double()).to(global_state[name].dtype)
        return new


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def short_reason(reason: str, limit: int = 300) -> str:
    """The informative line of a Flower error reason (Ray wraps the client's exception in a long
    traceback whose last line reads ``... Message: <the client's message>``)."""
    lines = [ln.strip() for ln in _ANSI.sub("", reason).splitlines() if ln.strip(" '>^")]
    text = lines[-1].strip("'>") if lines else reason
    return text if len(text) <= limit else text[:limit] + "..."


def _weighted(values: list[float], weights: list[int]) -> float:
    if not values:
        return float("nan")
    return sum(v * w for v, w in zip(values, weights)) / float(sum(weights))


def checked_arrays(record: ArrayRecord, global_state: dict[str, torch.Tensor]) -> LazyState:
    """A reply's arrays, checked against the weights sent: known names, the same shapes, finite
    values. The checks read read-only views of the reply's bytes; an array is copied out of the
    message only when something reads it from the returned mapping.

    Raises:
        ValueError: the first problem found (the caller records the reply as malformed).
    """
    arrays = LazyState(record)
    unknown = set(arrays) - set(global_state)
    if unknown:
        raise ValueError(f"update names unknown parameters {sorted(unknown)[:5]}")
    for name in arrays:
        value = arrays.view(name)
        if value.shape != tuple(global_state[name].shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(global_state[name].shape)}")
        if not all_finite(value):
            raise ValueError(f"{name}: non-finite values (the client's update overflowed: a learning rate, "
                             "defence noise or model that diverges)")
    return arrays


def all_finite(values: np.ndarray) -> bool:
    """Whether every element of ``values`` is finite, reading them once in the common case.

    Any NaN or infinity makes the sum NaN or infinite, so a finite sum proves every element finite;
    a non-finite sum (a bad value, or finite values whose sum overflows) is settled exactly. The
    sum runs in the values' own precision: for a DeiT-S gradient a float64 accumulation takes 13.9 ms
    of CPU against 9.0 ms, and an overflow only sends a rare case to the exact check. (Decoding each
    reply and summing it in torch costs 47.6 ms of CPU per reply; views and this: 10.3 ms.)
    """
    if values.dtype.kind not in "fc":  # integers and booleans are always finite
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(values.sum())) or bool(np.isfinite(values).all())

"""Flower ClientApp: one MJP client's round on its private partition.

It receives the global weights (ArrayRecord "arrays") and the round config (ConfigRecord
"config"), runs :func:`clients.defence.defended_local_update` (the run's defence, if any) on CUDA when present (else CPU) and replies with
the gradients (FedSGD) or the weight delta (FedAvg) plus a MetricRecord "metrics" holding
num-examples, loss, and the client's self-reported partition-id (used only by the benchmark's
ground-truth lookup). ``fail-partition`` / ``slow-partition`` in the config inject a raise or a
delay into that partition's client, for fault tests.

Under secure aggregation (``secagg = true``) the train handler runs inside Flower's
``secaggplus_mod`` (:class:`clients.secagg.SecAggMod`): the messages are then legacy FitIns /
FitRes records (:mod:`clients.secagg`), and the reply's arrays leave the client only quantised and
masked.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping, Optional

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedmjp.allocator import tune_malloc

from .defence import defended_local_update
from .records import DecodeCache, encode_state
from .runconfig import resolve_config
from .secagg import SecAggMod, is_legacy_fit, legacy_fit_inputs, legacy_fit_reply, named_state

_logger = logging.getLogger(__name__)


_decoders = threading.local()


def global_state(record: ArrayRecord) -> dict:
    """The weights a message carries, decoded once per thread for a record sent again unchanged
    (:class:`clients.records.DecodeCache`; the in-process engine runs clients in threads). Read-only."""
    cache = getattr(_decoders, "cache", None)
    if cache is None:
        cache = _decoders.cache = DecodeCache()
    return cache(record)


class InjectedClientFailure(RuntimeError):
    """Raised on purpose by the client named in ``fail-partition``."""


def make_client_app(run_config: Optional[Mapping[str, Any]] = None) -> ClientApp:
    """A ClientApp whose config is ``context.run_config`` overlaid with ``run_config`` and the
    round config the server sends."""
    overrides = dict(run_config or {})
    app = ClientApp()

    @app.train(mods=[SecAggMod(overrides)])
    def train(msg: Message, context: Context) -> Message:
        tune_malloc()  # once per process (a Ray worker or flwr-clientapp): see fedmjp/allocator.py
        legacy = is_legacy_fit(msg)
        if legacy:  # SecAgg+'s train message: unnamed arrays, their names in the round config
            round_config, arrays, state_names, update_names = legacy_fit_inputs(msg)
        else:
            round_config, arrays = dict(msg.content["config"]), msg.content["arrays"]
        server_round = int(round_config.pop("server-round"))
        cfg = resolve_config({**dict(context.run_config), **overrides, **round_config})
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
        if partition_id == cfg.fail_partition:
            raise InjectedClientFailure(f"injected failure in partition {partition_id}, round {server_round}")
        if partition_id == cfg.slow_partition:
            time.sleep(cfg.slow_seconds)
        state = global_state(arrays)
        if legacy:
            state = named_state(state, state_names)
        update, loss, batch, info = defended_local_update(cfg, state, partition_id, server_round, num_partitions)
        values = {
            "num-examples": int(batch.labels.numel()), "loss": loss, "partition-id": partition_id,
            "num-partitions": num_partitions, "server-round": server_round, **info,
        }
        if legacy:
            return legacy_fit_reply(msg, update, update_names, int(batch.labels.numel()), values)
        metrics = MetricRecord(values)
        return Message(RecordDict({"arrays": encode_state(update), "metrics": metrics}), reply_to=msg)

    return app


app = make_client_app()

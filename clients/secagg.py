"""The client's side of Flower's SecAgg+ (``secagg = true``; the server's is :mod:`server.secagg`).

flwr 1.41 implements SecAgg+ for the legacy message layout only: the server's
``SecAggPlusWorkflow`` sends ``FitIns`` records (``fitins.parameters``, ``fitins.config``) and
Flower's ``secaggplus_mod`` reads the train handler's reply as a ``FitRes`` record, quantises and
masks its arrays and sends only the masked vector. This module holds what the ClientApp needs for
that: :class:`SecAggMod`, which hands the protocol's messages to ``secaggplus_mod`` and every other
message straight to the handler, and the conversions between the legacy records and the client's
named state dicts. Legacy arrays carry no names, so the server sends them in the round config
(``state-names``, ``update-names``) and the client replies in the ``update-names`` order.

Reproducibility: ``secaggplus_mod`` quantises with stochastic rounding from NumPy's global
generator, unseeded. :class:`SecAggMod` seeds it by (seed, partition, round) just before the
quantisation (after the client's own compute, which does not draw from it) and holds a lock until
the masked vector is made, so client threads of the in-process engine do not interleave their
draws. The masks themselves come from keys drawn with ``os.urandom`` and cancel exactly in the sum:
the aggregate depends only on the updates and the (seeded) rounding.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat

from .partition import stable_seed
from .runconfig import resolve_config

#: The legacy FitIns records the SecAgg+ workflow sends.
FITINS_CONFIG, FITINS_PARAMETERS = "fitins.config", "fitins.parameters"
STATE_NAMES_KEY, UPDATE_NAMES_KEY = "state-names", "update-names"

_rounding = threading.Lock()


def is_secagg_message(msg: Message) -> bool:
    """Whether ``msg`` belongs to the SecAgg+ protocol (it carries the protocol's config record)."""
    return msg.has_content() and RECORD_KEY_CONFIGS in msg.content.config_records


class SecAggMod:
    """A ClientApp mod: SecAgg+ messages go through Flower's ``secaggplus_mod`` (stochastic rounding
    seeded by (seed, partition, round)); any other message goes to the handler unchanged.

    A class at module level, not a closure, so Ray pickles it by reference (a closure would carry
    the module's rounding lock by value, which cannot be pickled).

    Args:
        run_config: the ClientApp's config overrides (laid over ``context.run_config`` for the seed).
    """

    def __init__(self, run_config: Mapping[str, Any]) -> None:
        self.run_config = dict(run_config)

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not is_secagg_message(msg):
            return call_next(msg, context)
        holding: list[bool] = []
        stage = msg.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE)

        def handler_then_seed(inner: Message, ctx: Context) -> Message:
            reply = call_next(inner, ctx)
            if stage == Stage.COLLECT_MASKED_VECTORS and reply.has_content():
                seed = resolve_config({**dict(ctx.run_config), **self.run_config}).seed
                part = int(ctx.node_config["partition-id"])
                server_round = int(inner.content.config_records[FITINS_CONFIG]["server-round"])
                _rounding.acquire()
                holding.append(True)
                np.random.seed(stable_seed(seed, "secagg-rounding", part, server_round) % 2 ** 32)
            return reply

        try:
            return secaggplus_mod(msg, context, handler_then_seed)
        finally:
            if holding:
                _rounding.release()


def is_legacy_fit(msg: Message) -> bool:
    """Whether ``msg`` is a legacy FitIns (the SecAgg+ workflow's train message)."""
    return FITINS_CONFIG in msg.content.config_records


def legacy_fit_inputs(msg: Message) -> tuple[dict[str, Any], ArrayRecord, list[str], list[str]]:
    """(round config, the weights' record, state names, update names) of a legacy FitIns.

    Raises:
        ValueError: the config lacks the names the server must send with unnamed arrays.
    """
    config = dict(msg.content.config_records[FITINS_CONFIG])
    try:
        state_names = json.loads(str(config.pop(STATE_NAMES_KEY)))
        update_names = json.loads(str(config.pop(UPDATE_NAMES_KEY)))
    except KeyError as err:
        raise ValueError(f"a SecAgg+ train message must name its arrays in the round config ({err})") from err
    return config, msg.content.array_records[FITINS_PARAMETERS], state_names, update_names


def named_state(decoded: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """The legacy record's arrays (keys "0", "1", ... in order) under the state's names."""
    if len(decoded) != len(names):
        raise ValueError(f"the weights hold {len(decoded)} arrays, the round config names {len(names)}")
    return dict(zip(names, decoded.values()))


def legacy_fit_reply(msg: Message, update: Mapping[str, torch.Tensor], update_names: list[str],
                     num_examples: int, metrics: Mapping[str, Any]) -> Message:
    """The FitRes reply ``secaggplus_mod`` masks: the update's arrays in ``update_names`` order."""
    missing = [n for n in update_names if n not in update]
    if missing or len(update) != len(update_names):
        raise ValueError(f"the update's parameters differ from the server's update-names (missing {missing[:5]})")
    arrays = [update[name].detach().cpu().numpy() for name in update_names]
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), int(num_examples), dict(metrics))
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)

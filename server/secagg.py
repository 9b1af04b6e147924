"""Secure aggregation with Flower's SecAgg+: the honest-but-curious server sees only the aggregate.

With ``secagg = true`` the ServerApp runs Flower's own protocol instead of the message-based
strategy of :mod:`server.strategy`: ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` over
a :class:`~flwr.server.LegacyContext` (flwr 1.41 implements SecAgg+ only as a workflow of the legacy
``Strategy`` API), and the clients wrap their train handler in ``secaggplus_mod``
(:mod:`clients.secagg`). Per round the four stages run: key set-up, key-share exchange, collection of
the masked, quantised updates, unmasking. What reaches :meth:`SecAggStrategy.aggregate_fit` is the
unmasked, dequantised *example-weighted mean* of the clients' updates (Flower replaces every
client's parameters by that one aggregate before calling the strategy); no client's own update is
ever decrypted on the server. The tap is called once per round with that aggregate as a
:class:`~server.tap.TappedUpdate` whose ``num_clients`` is K, ``num_examples`` the K*B images
it averages, and ``node_ids`` / ``partition_ids`` the clients it covers (their metrics, sent in the
clear beside the masked vector, name them). docs/federation.md has the threat model.

Protocol choices, and why:

* ``max_weight`` is the run's ``batch-size``: each client weighs its update by num-examples /
  max_weight before quantising, so a full batch has weight exactly 1 and the quantisation step on
  the update is the protocol's finest (2 * clipping-range / quantization-range). Flower's default
  (1000) would scale a batch-1 update by 1/1000 before quantising it: 1000 times coarser.
* Failures: SecAgg+ gives no node id for a client that dropped; a failure of this module records the
  round and the reason with node id -1. A round the protocol halts (fewer than the reconstruction
  threshold of a client's neighbours answered) has no aggregate: it is a failed round and the
  global weights stay as they were.
* Server-side evaluation (``server-eval``) uses the legacy ``evaluate`` hook on the public split.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
from flwr.app import Context
from flwr.common import (EvaluateIns, EvaluateRes, FitIns, FitRes, Parameters, Scalar, ndarrays_to_parameters,
                         parameters_to_ndarrays)
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import Grid

from clients.runconfig import ROUND_KEYS, SECAGG_MODULUS, RunConfig

from .strategy import all_finite, short_reason
from .tap import AGGREGATE_ID, Failure, Tap, TappedUpdate

_logger = logging.getLogger(__name__)

#: Round-config keys (the FitIns config) naming the arrays of the legacy messages, which carry
#: lists of arrays without names: the global state's names in order, and the update's.
STATE_NAMES_KEY = "state-names"
UPDATE_NAMES_KEY = "update-names"


class SecAggStrategy(Strategy):
    """FedSGD / FedAvg on the SecAgg+ aggregate, with the tap on that aggregate (legacy Strategy API).

    Args:
        cfg: the resolved run config (mode, lr, fraction-train, min-nodes, round keys).
        model: the global model (its state is the initial global state; its trainable parameters,
            in order, are the names of every update).
        tap: called with each round's aggregate, before it is applied (None: no tap).
        metadata: what the server knows, copied into every :class:`TappedUpdate`.
        evaluate_fn: (round, state) -> metrics on the public split, or None for no evaluation.
    """

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, tap: Optional[Tap], metadata: dict[str, Any],
                 evaluate_fn: Optional[Callable[[int, dict[str, torch.Tensor]], dict[str, float]]] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tap = tap
        self.metadata = {**metadata, "aggregation": "secaggplus-mean"}
        self.evaluate_fn = evaluate_fn
        self.state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        self.update_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.update_dtype = getattr(torch, cfg.precision)
        self.failures: list[Failure] = []
        self.node_partitions: dict[int, int] = {}
        self.rounds: dict[int, dict[str, Any]] = {}
        self._sampled: dict[int, int] = {}
        self._started = 0.0

    # ------------------------------------------------------------------------- parameters
    def _parameters(self) -> Parameters:
        return ndarrays_to_parameters([v.numpy() for v in self.state.values()])

    def initialize_parameters(self, client_manager: ClientManager) -> Optional[Parameters]:
        """The global model's state, in state-dict order (the names travel in the round config)."""
        return self._parameters()

    # ------------------------------------------------------------------------- training round
    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                      ) -> list[tuple[ClientProxy, FitIns]]:
        """Every round: wait for min-nodes, sample fraction-train of the nodes (at least 2, as
        SecAgg+ needs), send the weights and the round config (with the arrays' names)."""
        self._started = time.perf_counter()
        client_manager.wait_for(self.cfg.min_nodes)
        available = client_manager.num_available()
        k = min(available, max(2, int(self.cfg.fraction_train * available)))
        if k * self.cfg.secagg_quantization_range > SECAGG_MODULUS:
            _logger.warning("round %d: %d clients x secagg-quantization-range %d exceed SecAgg+'s modulus 2**32; "
                            "the aggregate may overflow", server_round, k, self.cfg.secagg_quantization_range)
        proxies = client_manager.sample(num_clients=k, min_num_clients=self.cfg.min_nodes)
        self._sampled[server_round] = len(proxies)
        config: dict[str, Scalar] = {key: value for key, value in self.cfg.wire().items() if key in ROUND_KEYS}
        config.update({"server-round": server_round, STATE_NAMES_KEY: json.dumps(list(self.state)),
                       UPDATE_NAMES_KEY: json.dumps(self.update_names)})
        fit_ins = FitIns(parameters, config)
        return [(proxy, fit_ins) for proxy in proxies]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Optional[Parameters], dict[str, Scalar]]:
        """Tap the SecAgg+ aggregate (the same parameters in every result), then apply it."""
        # Flower's collect-masked-vectors stage appends each error reply twice (two loops over the
        # replies): one failure per distinct reason.
        for reason in dict.fromkeys(short_reason(str(f)) for f in failures):
            self._fail(server_round, -1, f"client error: {reason}")
        if not results:
            return None, {}
        aggregate = self._checked(parameters_to_ndarrays(results[0][1].parameters))
        by_node = {proxy.node_id: fit for proxy, fit in results}
        # Listed in partition order (the clients' self-reported ids, sent in the clear beside the mask).
        node_ids = sorted(by_node, key=lambda n: (int(by_node[n].metrics.get("partition-id", -1)), n))
        partitions = [int(by_node[n].metrics.get("partition-id", -1)) for n in node_ids]
        for node_id, part in zip(node_ids, partitions):
            if part >= 0:
                self.node_partitions[node_id] = part
        counts = [int(by_node[n].num_examples) for n in node_ids]
        losses = [float(by_node[n].metrics.get("loss", float("nan"))) for n in node_ids]
        total = sum(counts)
        loss = sum(v * c for v, c in zip(losses, counts)) / total if total else float("nan")
        update = TappedUpdate(
            server_round, AGGREGATE_ID, AGGREGATE_ID, "gradients" if self.cfg.mode == "fedsgd" else "delta",
            aggregate, self.state, total, {"loss": loss, "num-examples": float(total), "num-clients": len(results)},
            dict(self.metadata), num_clients=len(results), node_ids=node_ids, partition_ids=partitions)
        if self.tap is not None:
            self.tap(update)
        self.rounds[server_round] = {
            "round": server_round, "sampled": self._sampled.get(server_round, len(results)),
            "replies": len(results), "failures": self._sampled.get(server_round, len(results)) - len(results),
            "train-loss": loss, "seconds": time.perf_counter() - self._started,
        }
        if self.cfg.mode == "fedsgd" and self.cfg.lr == 0.0:
            return self._parameters(), {}
        sign = -self.cfg.lr if self.cfg.mode == "fedsgd" else 1.0
        self.state = {name: (value.double() + sign * aggregate[name].double()).to(value.dtype)
                      if name in aggregate else value for name, value in self.state.items()}
        return self._parameters(), {}

    def _checked(self, arrays: list[np.ndarray]) -> dict[str, torch.Tensor]:
        """The aggregate by parameter name, checked: one array per update name, its shape, finite."""
        if len(arrays) != len(self.update_names):
            raise ValueError(f"SecAgg+ aggregate has {len(arrays)} arrays, the model {len(self.update_names)} "
                             "trainable parameters")
        out = {}
        for name, arr in zip(self.update_names, arrays):
            if tuple(arr.shape) != tuple(self.state[name].shape):
                raise ValueError(f"{name}: aggregate shape {tuple(arr.shape)} != {tuple(self.state[name].shape)}")
            if not all_finite(arr):
                raise ValueError(f"{name}: non-finite values in the aggregate")
            out[name] = torch.from_numpy(np.ascontiguousarray(arr)).to(self.update_dtype)
        return out

    def end_round(self, server_round: int) -> None:
        """Called after each round's workflow: a round that produced no aggregate is recorded failed."""
        if server_round in self.rounds:
            return
        sampled = self._sampled.get(server_round, 0)
        self._fail(server_round, -1, "secure aggregation halted: too few clients answered a SecAgg+ stage "
                                     "(fewer than the reconstruction threshold) or none replied in time")
        self.rounds[server_round] = {"round": server_round, "sampled": sampled, "replies": 0, "failures": sampled,
                                     "train-loss": float("nan"), "seconds": time.perf_counter() - self._started}

    def _fail(self, server_round: int, node_id: int, reason: str) -> None:
        _logger.warning("round %d: %s", server_round, reason)
        self.failures.append(Failure(server_round, node_id, None, reason))

    # ------------------------------------------------------------------------- evaluation
    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                           ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """No federated evaluation (the clients' data is private)."""
        return []

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list[Any]) -> tuple[Optional[float], dict[str, Scalar]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> Optional[tuple[float, dict[str, Scalar]]]:
        """``server-eval``: the global model on the public split after each round (not round 0)."""
        if self.evaluate_fn is None or server_round == 0:
            return None
        metrics = self.evaluate_fn(server_round, self.state)
        self.rounds.setdefault(server_round, {"round": server_round}).update(metrics)
        return float(metrics["eval-loss"]), dict(metrics)


def run_secagg(grid: Grid, context: Context, strategy: SecAggStrategy) -> None:
    """``num-server-rounds`` rounds of Flower's ``DefaultWorkflow`` with ``SecAggPlusWorkflow`` as
    its fit workflow (the SecAgg+ parameters from the run config; ``max_weight`` = batch-size)."""
    cfg = strategy.cfg
    secagg = SecAggPlusWorkflow(
        num_shares=cfg.secagg_num_shares, reconstruction_threshold=cfg.secagg_reconstruction_threshold,
        max_weight=float(cfg.batch_size), clipping_range=cfg.secagg_clipping_range,
        quantization_range=cfg.secagg_quantization_range, modulus_range=SECAGG_MODULUS,
        timeout=cfg.round_timeout)

    def fit_workflow(grid: Grid, legacy: Context) -> None:
        assert isinstance(legacy, LegacyContext)
        from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, Key

        server_round = int(legacy.state.config_records[MAIN_CONFIGS_RECORD][Key.CURRENT_ROUND])
        secagg(grid, legacy)
        strategy.end_round(server_round)

    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=cfg.num_server_rounds,
                                                                round_timeout=cfg.round_timeout),
                           strategy=strategy)
    DefaultWorkflow(fit_workflow=fit_workflow)(grid, legacy)

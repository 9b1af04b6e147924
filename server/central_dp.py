"""Central DP with Flower's server-side wrapper, tapped the way a curious server taps.

:class:`TappedCentralDp` is Flower's :class:`~flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping`
around our :class:`~server.strategy.TappedFedAvg` / :class:`~server.strategy.FedSGD`, with two
adaptations, both stated here because they change what the wrapper is given:

* Flower's wrapper clips ``reply - weights sent`` (it expects replies to be full weights). Our
  clients reply FedSGD gradients or FedAvg deltas, which already are the update, so the reference
  it subtracts is set to zeros: it clips each reply to L2 norm ``clip`` over all arrays, and adds
  Gaussian noise of std ``sigma * clip / num_sampled_clients`` to the aggregated weights (Flower's
  own code). Under FedSGD the noise lands on the weights unscaled by lr (as Flower adds it).
* The honest-but-curious server reads every reply as it arrives, before its DP code runs: the tap
  is called with the raw replies first. That is the point of including central DP in the table: it
  protects the released model against third parties, not the update against the server (expected
  and measured: the tapped update equals the undefended one).
* Flower draws the noise from NumPy's global random state, unseeded, so a run's global weights after
  a noised round (and every row attacked on them) differed from run to run and between a run and
  its resume. Here the noise is Flower's formula (``compute_stdv``: std ``sigma * clip /
  num_sampled_clients``, i.i.d. Gaussian per entry, in each array's dtype) drawn from a generator
  seeded by (the run's seed, the round).

The noised global weights are checked right after the noise is added: when they are not all finite
(a sigma so large that the noise overflows the weights' dtype), the error is logged and every
client failure of the following rounds (the clients train on those weights and reply non-finite
updates) names the cause first: the round, ``central_dp``, its sigma and clip, and the noise std.

Flower's wrapper skips the whole aggregation of a round in which any client replied with an error
(``validate_replies``): such a round leaves the global weights unchanged.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Optional

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping
from flwr.supercore.differential_privacy import compute_stdv

from clients.records import encode_state

from .strategy import TappedFedAvg, all_finite

_logger = logging.getLogger(__name__)


class TappedCentralDp(DifferentialPrivacyServerSideFixedClipping):
    """Flower's server-side fixed-clipping DP around a tapped strategy; the tap sees raw replies.

    Args:
        strategy: the tapped FedAvg/FedSGD strategy (its tap is moved to this wrapper).
        noise_multiplier: sigma.
        clipping_norm: clip, the per-reply L2 bound.
        num_sampled_clients: clients per round (scales the noise on the mean).
        seed: the run's seed; round r's noise is drawn from a generator seeded by (seed, r).
    """

    def __init__(self, strategy: TappedFedAvg, noise_multiplier: float, clipping_norm: float,
                 num_sampled_clients: int, seed: int = 0) -> None:
        super().__init__(strategy, noise_multiplier, clipping_norm, num_sampled_clients)
        self.tap, strategy.tap = strategy.tap, None
        self.inner = strategy
        self.seed = int(seed)
        self.server_round = 0
        #: Why the global weights are not finite (set when the noise of a round made them so), else None.
        self.global_fault: Optional[str] = None

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = super().configure_train(server_round, arrays, config, grid)
        # Replies are gradients or deltas: the update Flower clips is the reply itself.
        # (Flower's wrapper ran the inner strategy's configure_train, which decoded this round's weights.)
        self.current_arrays = encode_state({k: torch.zeros_like(v) for k, v in self.inner.global_state.items()})
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """Tap every usable raw reply, then Flower's clip -> inner aggregation -> noise."""
        self.server_round = int(server_round)
        replies = list(replies)
        if self.tap is not None:
            parsed = []
            for msg in replies:
                if msg.has_error():
                    continue
                try:
                    parsed.append(self.inner._parse(server_round, msg.metadata.src_node_id, msg))
                except (KeyError, ValueError, TypeError) as err:  # the inner strategy records it as a failure
                    _logger.debug("round %d: reply not tapped: %r", server_round, err)
            for update in sorted(parsed, key=lambda u: u.node_id):
                self.tap(update)
        fault, failures = self.global_fault, self.inner.failures
        first_new = len(failures)
        result = super().aggregate_train(server_round, replies)
        if fault is not None:  # the clients of this round were sent non-finite weights
            failures[first_new:] = [dataclasses.replace(f, reason=f"{fault}; {f.reason}") for f in failures[first_new:]]
        return result

    def _add_noise_to_aggregated_arrays(self, aggregated_arrays: ArrayRecord) -> ArrayRecord:
        """Flower's noise (same std, distribution and dtypes) from a generator seeded by (seed, round)
        instead of NumPy's unseeded global state (tests/test_defences.py fails if Flower stops calling this hook)."""
        rng = np.random.default_rng([self.seed, self.server_round])
        std = compute_stdv(self.noise_multiplier, self.clipping_norm, self.num_sampled_clients)
        arrays = aggregated_arrays.to_numpy_ndarrays()
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported below, with its cause
            for array in arrays:
                array += rng.normal(0.0, std, array.shape).astype(array.dtype)
        bad = [(k, v.dtype) for k, v in zip(aggregated_arrays.keys(), arrays) if not all_finite(v)]
        if bad:
            self.global_fault = (
                f"global model non-finite after round {self.server_round}'s central_dp noise "
                f"(defence central_dp sigma={self.noise_multiplier:g}, clip={self.clipping_norm:g}: "
                f"noise std {std:g} overflows {bad[0][1]}; first array {bad[0][0]})")
            _logger.error("%s; lower the defence's sigma", self.global_fault)
        else:
            self.global_fault = None
        return ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(aggregated_arrays.keys(), arrays)})

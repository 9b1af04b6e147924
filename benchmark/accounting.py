"""(epsilon, delta) of a utility federation's DP defence, from Opacus' RDP accountant.

One accountant for the three DP defences (``defences.spec``), each at the protocol the federation ran
(``rounds`` rounds, every client in every round, ``local_steps`` steps per round on one batch):

* ``dp_sgd``: per client, the Poisson-subsampled Gaussian mechanism (sampling rate q = batch size /
  partition size) once per round; the ``local_steps`` noisy steps of a round reuse that round's batch, so
  together they are one Gaussian mechanism of noise multiplier sigma / sqrt(local_steps) on the sample
  (RDP composes additively: S x alpha / (2 sigma^2) = alpha / (2 (sigma / sqrt(S))^2)), subsampled once.
  Record-level DP of one client's data; at ``local_steps`` 1 it is the figure ``defences.dp`` reports.
* ``local_dp`` (Gaussian noise): each round the client releases clip(u) + N(0, (sigma clip)^2 I). Two
  data sets of one client can give any two clipped updates, at most 2 clip apart (L2), so each release
  is a Gaussian mechanism of noise multiplier sigma / 2, composed over the rounds (q = 1). Client-level
  DP against the server itself. Laplace noise has no Gaussian accounting here: epsilon NaN.
* ``central_dp`` (Flower's ``DifferentialPrivacyServerSideFixedClipping``: every reply clipped to clip,
  the mean noised with std sigma clip / n): on the sum, adding or removing one client moves it by at
  most clip, so each round is a Gaussian mechanism of noise multiplier sigma, composed over the rounds
  (q = 1, every client sampled). Client-level DP of the released global models, not against a server
  that taps the replies (which are clean).

Every figure is Opacus' RDP accountant (``opacus.accountants.analysis.rdp``: ``compute_rdp`` and
``get_privacy_spent``, Opacus' default orders), by :func:`defences.dp.dp_sgd_epsilon`; q = 1 is the plain
Gaussian mechanism there.
"""
from __future__ import annotations

import math
from typing import Any

from defences.dp import dp_sgd_epsilon
from defences.spec import CentralDp, DefenceSpec, DpSgd, LocalDp


def gaussian_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """epsilon of ``releases`` adaptive Gaussian mechanisms of noise std ``noise_multiplier`` x the L2
    sensitivity, at ``delta`` (Opacus' RDP accountant with q = 1)."""
    return dp_sgd_epsilon(1.0, noise_multiplier, releases, delta)


def federation_epsilon(spec: DefenceSpec, rounds: int, local_steps: int, batch_size: int, partition_size: int,
                       delta: float) -> dict[str, Any]:
    """{"dp_epsilon", "dp_delta", "dp_accounting"} of a federation with defence ``spec`` (module
    docstring); {} for a defence that is not DP.

    Args:
        partition_size: images a client owns (the smallest partition under a non-IID split: the
            largest sampling rate).
        delta: local and central DP's delta; dp_sgd uses its own ``spec.delta``.
    """
    if isinstance(spec, DpSgd):
        q = min(1.0, batch_size / max(1, partition_size))
        z = spec.sigma / math.sqrt(local_steps)
        return {"dp_epsilon": dp_sgd_epsilon(q, z, rounds, spec.delta), "dp_delta": spec.delta,
                "dp_accounting": f"dp_sgd record-level: subsampled Gaussian, q={q:.4g}, noise multiplier "
                                 f"{spec.sigma:g}/sqrt({local_steps}), {rounds} rounds (Opacus RDP)"}
    if isinstance(spec, LocalDp):
        if spec.noise != "gaussian":
            return {"dp_epsilon": math.nan, "dp_delta": delta,
                    "dp_accounting": f"local_dp {spec.noise} noise: no Gaussian accounting"}
        return {"dp_epsilon": gaussian_epsilon(spec.sigma / 2.0, rounds, delta), "dp_delta": delta,
                "dp_accounting": f"local_dp client-level: Gaussian mechanism, sensitivity 2 clip, noise multiplier "
                                 f"{spec.sigma:g}/2, {rounds} rounds (Opacus RDP, q=1)"}
    if isinstance(spec, CentralDp):
        return {"dp_epsilon": gaussian_epsilon(spec.sigma, rounds, delta), "dp_delta": delta,
                "dp_accounting": f"central_dp client-level: Gaussian mechanism on the sum, sensitivity clip, "
                                 f"noise multiplier {spec.sigma:g}, {rounds} rounds (Opacus RDP, q=1)"}
    return {}

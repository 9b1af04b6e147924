"""Secure aggregation in the benchmark: a round's K-client aggregate is attacked as one batch.

With ``federation.secagg`` the server's tap sees one update per round, the SecAgg+ aggregate of the
round's clients (:mod:`server.secagg`; its node and partition id are
:data:`server.tap.AGGREGATE_ID`). The attackers get it as an update of one batch of K*B images:
the clients' private batches concatenated in partition order, which is also the ground truth its
rows are scored against. (FedSGD with mean-reduced losses: the example-weighted mean of the
clients' gradients is the gradient of the mean loss over all K*B images.) Attackers that need a
batch of one image fail those rows with their reason.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from clients.partition import PrivateBatch, private_batch
from clients.runconfig import RunConfig
from fedmjp.jigsaw import JigsawPlan
from server.tap import AGGREGATE_ID


def tapped_partitions(cfg: Any) -> list[int]:
    """The partition ids of the updates the tap sees each round: every client's, or the aggregate's."""
    return [AGGREGATE_ID] if cfg.federation.secagg else list(range(cfg.federation.clients))


def tapped_batch(run_config: RunConfig, partition: int, server_round: int, clients: int,
                 covers: Optional[Sequence[int]] = None) -> PrivateBatch:
    """The private batch behind a tapped update: the client's own (:func:`private_batch`), or for the
    aggregate the batches of the partitions it ``covers`` (default: all ``clients``) concatenated."""
    if partition != AGGREGATE_ID:
        return private_batch(run_config, partition, server_round, clients)
    parts = list(covers) if covers else list(range(clients))
    return concat_batches([private_batch(run_config, p, server_round, clients) for p in parts])


def concat_batches(batches: Sequence[PrivateBatch]) -> PrivateBatch:
    """One batch holding ``batches`` in order (each image keeps its own shuffle and E_unk mask)."""
    first = batches[0]
    plans = [b.plan for b in batches]
    plan = None
    if all(p is not None for p in plans):
        pixel = [p.pixel_perm for p in plans]  # type: ignore[union-attr]
        plan = JigsawPlan(torch.cat([p.mask for p in plans]), torch.cat([p.perm for p in plans]),  # type: ignore[union-attr]
                          None if any(x is None for x in pixel) else torch.cat(pixel))  # type: ignore[arg-type]
    shuffled = None if any(b.shuffled is None for b in batches) else torch.cat([b.shuffled for b in batches])  # type: ignore[misc]
    return PrivateBatch(images=torch.cat([b.images for b in batches]), labels=torch.cat([b.labels for b in batches]),
                        image_ids=[i for b in batches for i in b.image_ids],
                        indices=torch.cat([b.indices for b in batches]), plan=plan, shuffled=shuffled,
                        gamma=first.gamma)

"""block0_roots on a perturbed update: where quantisation (SecAgg+'s, or the `quantize` defence's)
sinks block 0's smaller singular values into its floor, the read refuses and its reason names the
numerical ranks it measured, not a rank of 0."""
from __future__ import annotations

import re

import torch

import attacks
from test_attack_contracts import FEW_STEPS, SIZE, tiny_model
from helpers import MEAN, STD, bundled_images, normalize


def test_a_quantised_update_is_refused_naming_the_ranks_it_has() -> None:
    model = tiny_model("standard", "plain")
    update = attacks.compute_update(model, normalize(bundled_images(1, SIZE)), torch.arange(1))
    step = 1e-3 * max(float(v.abs().max()) for v in update.values())  # a coarse grid: most entries move
    rounded = {k: torch.round(v / step) * step for k, v in update.items()}
    meta = attacks.AttackMetadata(1, (3, SIZE, SIZE), MEAN.double(), STD.double(), None)
    attack = attacks.create_attack("block0_roots", **FEW_STEPS["block0_roots"])
    result = attack.reconstruct(model, rounded, meta)
    assert result.failed and "numerical ranks" in result.reason, result.reason
    T = int(model.pos_embed.shape[1])
    ranks = [int(r) for r in re.findall(r"'blocks\.0\.mlp\.fc[12]': (\d+)", result.reason)]
    assert len(ranks) == 2 and all(0 < r < T for r in ranks), result.reason
    assert not attack.reconstruct(model, update, meta).failed  # the same update unrounded is read

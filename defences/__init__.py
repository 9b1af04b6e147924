"""Client-side defences against gradient inversion, composable with MJP (pure torch, no Flower).

See :mod:`defences.spec` for the names and keys, :mod:`defences.transforms` for update transforms
(local DP, pruning, quantisation), :mod:`defences.dp` for DP-SGD and its accountant and
:mod:`defences.mixing` for input mixing. Central DP is Flower's server-side wrapper (server/central_dp.py).
"""
from .dp import dp_sgd_epsilon, private_gradient
from .mixing import Mixed, mix_batch
from .spec import DEFENCES, UPDATE_TRANSFORMS, defence_label, validate_defence
from .transforms import (add_noise, apply_update_defence, clip_update, cosine_similarity, local_dp,
                         prune_update, quantize_tensor, quantize_update, update_norm)

__all__ = ["DEFENCES", "UPDATE_TRANSFORMS", "Mixed", "add_noise", "apply_update_defence", "clip_update",
           "cosine_similarity", "defence_label", "dp_sgd_epsilon", "local_dp", "mix_batch", "private_gradient",
           "prune_update", "quantize_tensor", "quantize_update", "update_norm",
           "validate_defence"]

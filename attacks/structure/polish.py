"""The span polish of the block-0 read's design-A answer (:mod:`attacks.structure.block0_roots`).

The position-structured solve's answer (:func:`attacks.structure.design_a.structured_tokens`) rests
on c, whose noise (the roots' floor amplified through step 2) keeps it close to x~ but not on it;
refining the roots on block 0's MLP update does not help (docs/attacks.md, `block0_roots`). Every
layer's input span does: the span residual's Jacobian has full column rank at x~, and
Levenberg-Marquardt on it converges from close by (:func:`attacks.optimization.span_fit.span_lm`,
the final stage of ``mjp_adaptive``), holding x~ to the update's own precision.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn as nn

#: design A: Levenberg-Marquardt Jacobians of the span polish after the structured solve at most
#: (tests/test_block0_roots.py: test_the_span_polish_takes_a_close_answer_to_x_tilde converges within 6)
SPAN_POLISH_JACOBIANS = 6


@dataclass
class SpanPolish:
    """Outcome of :func:`span_polish`: the model input [1, C, H, W], the span residual before and after,
    and the Levenberg-Marquardt Jacobians taken."""

    image: torch.Tensor
    residual_before: float
    residual_after: float
    jacobians: int


def span_polish(vit: nn.Module, grads: Mapping[str, torch.Tensor], image: torch.Tensor, shuffled: torch.Tensor,
                jacobians: int) -> SpanPolish:
    """Design A, B = 1: x~ from a close estimate, to the precision the whole update holds (module doc).

    The estimate ``image`` (model input) is taken to the reduced coordinates of APRIL's qkv equations
    on the shuffled set ``shuffled`` [N] (the E_unk tokens'; the span residual does not see their
    order) and fitted there for at most ``jacobians`` Levenberg-Marquardt Jacobians."""
    from ..closed_form.mjp_update import read_mjp_update
    from ..optimization.span_fit import span_lm, span_problem, truth_coordinates

    g = {k: v.to(torch.float64) for k, v in grads.items()}
    if getattr(vit, "unk_embed", None) is not None:
        _, g, _ = read_mjp_update(vit, g)  # dL/dP without the DAL term (G_Z below)
        g = {k: g[k] for k in grads}
    prob = span_problem(vit, g, shuffled)
    red = prob.red
    b, a = truth_coordinates(red, image, prob.patch)  # any image's coordinates, the estimate's here
    with torch.no_grad():
        before = float(prob.residual.value(prob.image(b, a))[0])
    taken, after = 0, before
    if red.null_basis.shape[1]:  # else the qkv equations alone fix every patch: nothing left to fit
        b, a, out = span_lm(prob.residual, red, b, a, prob.grid, prob.channels, prob.patch, max_jacobians=jacobians)
        taken, after = out.jacobians, out.value
    with torch.no_grad():
        polished = prob.image(b, a)
    return SpanPolish(polished, before, after, taken)

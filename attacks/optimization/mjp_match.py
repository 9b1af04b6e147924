"""``mjp_adaptive``'s ``refine="match"``: gradient matching over the reduced parameters (b, a) of
:class:`attacks.closed_form.mjp_maths.Reduction` with the attacker's forward at ``unk_mask = S``
(float64, L-BFGS in alternating blocks: the shuffled patches a with the unshuffled b fixed, then both)."""
from __future__ import annotations

import copy
import logging
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from ..closed_form.mjp_maths import Reduction, assemble, neighbour_diffs, patches_to_image

_logger = logging.getLogger(__name__)


def matching_objective(vit: nn.Module, grads: dict, red: Reduction, labels: torch.Tensor, grid, C: int, p: int,
                       std: torch.Tensor, prior_weight: float) -> tuple[Callable, int]:
    """((b, a) -> the mean over matched parameters of ||dL/dtheta - target||^2 / ||target||^2, plus
    ``prior_weight`` times the mean squared neighbour difference of the unshuffled region; the
    number of matched parameters). Matched: every parameter of the update except the DAL head's
    with a nonzero gradient."""
    dev = red.device
    work = copy.deepcopy(vit).to(dev, torch.float64).eval()
    for blk in work.blocks:
        if hasattr(blk.attn, "fused_attn"):
            blk.attn.fused_attn = False
    names = [n for n, q in work.named_parameters() if n in grads and not n.startswith("dal_head.")
             and float(grads[n].abs().max()) > 0]
    params = {n: q.detach().requires_grad_(True) for n, q in work.named_parameters()}
    buffers = dict(work.named_buffers())
    targets = {n: grads[n].to(dev, torch.float64) for n in names}
    norms = {n: float(t.pow(2).sum()) for n, t in targets.items()}
    mask = red.shuffled[None]
    y = labels.reshape(1).to(dev)
    valid = patches_to_image((~red.shuffled).double()[:, None].expand(-1, C * p * p), grid, C, p)[0] > 0
    scale = std.to(dev).repeat_interleave(p * p)

    def objective(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = assemble(red, b, a, grid, C, p)
        out = functional_call(work, (params, buffers), (x,), {"unk_mask": mask})
        loss = F.cross_entropy(out, y)
        g = torch.autograd.grad(loss, [params[n] for n in names], create_graph=True)
        obj = sum((gi - targets[n]).pow(2).sum() / norms[n] for gi, n in zip(g, names)) / len(names)
        if prior_weight > 0:
            xu = torch.zeros(red.shuffled.numel(), C * p * p, dtype=torch.float64, device=dev)
            xu = xu.index_put((torch.nonzero(~red.shuffled).flatten(),),
                              (red.x_unshuffled + b @ red.null_basis.T) * scale)
            d = neighbour_diffs(patches_to_image(xu, grid, C, p), valid)
            obj = obj + prior_weight * d.pow(2).mean()
        return obj

    return objective, len(names)


def match_reduced(objective: Callable, b0: torch.Tensor, a0: torch.Tensor, rounds: int,
                  iterations: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Minimise ``objective(b, a)`` from (b0, a0): ``rounds`` of L-BFGS (``iterations`` each) over a,
    then over (b, a). Returns (b, a, {objective, objective_first, iterations})."""
    b, a = b0.clone(), a0.clone()
    first = float(objective(b, a).detach())
    iters = 0
    for _ in range(rounds):
        for block in ("a", "ab"):
            vb = b.clone().requires_grad_("b" in block)
            va = a.clone().requires_grad_(True)
            opt_vars = [va] + ([vb] if "b" in block else [])
            opt = torch.optim.LBFGS(opt_vars, lr=1.0, max_iter=iterations, history_size=50,
                                    line_search_fn="strong_wolfe", tolerance_grad=1e-14,
                                    tolerance_change=1e-18)

            def closure():
                opt.zero_grad()
                obj = objective(vb, va)
                obj.backward()
                return obj

            opt.step(closure)
            iters += opt.state[opt.param_groups[0]["params"][0]].get("n_iter", 0)
            b, a = vb.detach(), va.detach()
    last = float(objective(b, a).detach())
    _logger.debug("mjp_adaptive matching: %.3e -> %.3e in %d iterations", first, last, iters)
    return b, a, dict(objective=last, objective_first=first, iterations=iters)

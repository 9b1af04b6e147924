"""The block-0 read's last steps (:mod:`attacks.structure.block0_roots`): the span polish of its
design-A answer, and past B T = D - 1 the membership repair and the root polish, which take the
linear steps' close answer to the roots' rounding floor (:func:`refit_membership`, :func:`root_polish`).

**Span polish (design A).**

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


#: past the floor: Levenberg-Marquardt Jacobians of the root polish per image at most
#: (tests/test_block0_completion.py: test_a_b3_batch_follows_from_its_roots_in_any_order reaches the
#: rounding floor within 4 from the linear steps' 74-82 dB)
ROOT_POLISH_JACOBIANS = 8
#: the root polish stops once ||u(x) - u||^2 is below this times ||u||^2: Gauss-Newton is then one
#: step from the roots' rounding floor (~1e-31 relative), the patches past 200 dB
ROOT_POLISH_FLOOR = 1e-20
#: past the floor the images count as read where every image's polished squared root residual is
#: below this times ||u||^2 (measured 1e-21 relative with every token in its image, 2e-3 to 6e-3
#: with MJP's membership wrong before :func:`refit_membership`: tests/test_block0_completion.py)
ROOT_POLISH_FIT = 1e-12
#: past the floor: sweeps of the membership repair at most (:func:`refit_membership`)
MEMBERSHIP_SWEEPS = 4
#: Jacobian columns per vmapped forward-mode pass of the root polish (one image: ~100 MB of tangents)
ROOT_POLISH_CHUNK = 256


@dataclass
class RootPolish:
    """Outcome of :func:`root_polish`: every token's patch [n, C p^2] (the class tokens' zero), and per
    image the squared root residual before and after [B], the Jacobians taken [B] and ||u||^2 of its
    roots [B]."""

    patches: torch.Tensor
    residual_before: torch.Tensor
    residual_after: torch.Tensor
    jacobians: list[int]
    norms: torch.Tensor

    @property
    def relative(self) -> float:
        """The largest polished residual relative to its image's ||u||^2."""
        return float((self.residual_after / self.norms).max())


def block0_roots_of(block: nn.Module, Z: torch.Tensor) -> torch.Tensor:
    """Block 0's fc1 inputs norm2(z + attention(norm1(z))) [n, D] for one image's embeddings Z [n, D]
    (every token attends to every other; the order of the tokens is free: attention is
    permutation-equivariant and the embeddings carry the positions)."""
    from .attention import attention_output

    attn = block.attn
    c = attention_output(attn, block.norm1(Z))
    c = getattr(attn, "norm", nn.Identity())(c)
    return block.norm2(Z + block.ls1(attn.proj(c)))


def root_polish(vit: nn.Module, roots: torch.Tensor, position: torch.Tensor, image: torch.Tensor,
                patches: torch.Tensor, jacobians: int = ROOT_POLISH_JACOBIANS,
                fitted: torch.Tensor | None = None) -> RootPolish:
    """Past B T = D - 1: every image's patches refit so that block 0 maps them onto their own roots.

    Once each root's image and position are known (steps 3 and 4), image b's tokens are a function
    of its patches alone, Z_b = off[p] + W_e x (the class token: cls + P_0; an E_unk token: E_unk +
    b_e), and its roots u_t = norm2(z_t + attention(norm1(Z_b))_t) are T D equations in (T - 1) C p^2
    unknowns whose Jacobian has full column rank (W_e does, and norm2 removes two directions per
    token only). The linear steps leave the patches close but not exact past the floor (the part of
    the attention outputs the position equations leave free); Gauss-Newton on these equations,
    image by image, takes them to the rounding floor of the roots (Levenberg-Marquardt,
    :func:`attacks.solvers.lm.dense_lm`, at most ``jacobians`` per image).

    ``fitted`` [n] bool: the tokens whose row of ``roots`` is a root; the others (stand-ins for tokens
    the read has no root of, :mod:`attacks.structure.noisy`) keep their patches and enter the fit
    only through attention (None: every token is fitted)."""
    from torch.func import jvp, vmap

    from ..solvers.lm import dense_lm
    from .linear import token_offsets

    blk = vit.blocks[0]
    We, off, _, _ = token_offsets(vit)
    out = patches.clone()
    batch = int(image.max()) + 1
    before = torch.zeros(batch, dtype=torch.float64)
    after = torch.zeros(batch, dtype=torch.float64)
    norms = torch.zeros(batch, dtype=torch.float64)
    taken = []
    for b in range(batch):
        idx = (image == b).nonzero().flatten()
        own = idx[position[idx] != 0]  # the patch tokens (the class token's embedding is fixed)
        order = torch.cat([idx[position[idx] == 0], own])
        base, target = off[position[order]], roots[order].to(torch.float64)
        fit = torch.ones(len(position), dtype=torch.bool) if fitted is None else fitted.to(torch.bool)
        rows, free = fit[order], fit[own]
        held = torch.where(free[:, None], 0.0, patches[own].to(torch.float64))  # the stand-ins' patches
        pick = torch.eye(own.numel(), dtype=torch.float64)[:, free]  # free patch -> its token
        shape = patches[own][free].shape
        target = target[rows]

        def fun(x: torch.Tensor) -> torch.Tensor:
            X = held + pick @ x.reshape(shape)
            Z = base + torch.cat([torch.zeros(1, We.shape[0], dtype=x.dtype), X @ We.T])
            return (block0_roots_of(blk, Z)[rows] - target).reshape(-1)

        def jacobian(x: torch.Tensor) -> torch.Tensor:
            eye = torch.eye(x.numel(), dtype=torch.float64)
            column = lambda t: jvp(fun, (x,), (t,))[1]  # noqa: E731
            return torch.cat([vmap(column)(eye[i:i + ROOT_POLISH_CHUNK])
                              for i in range(0, x.numel(), ROOT_POLISH_CHUNK)]).T

        with torch.no_grad():
            res = dense_lm(fun, jacobian, patches[own][free].reshape(-1).to(torch.float64), max_jacobians=jacobians,
                           floor=ROOT_POLISH_FLOOR * float(target.pow(2).sum()))
        out[own[free]] = res.theta.reshape(shape).to(out.dtype)
        before[b], after[b], norms[b] = res.value_first, res.value, float(target.pow(2).sum())
        taken.append(res.jacobians)
    return RootPolish(out, before, after, taken, norms)


def refit_membership(vit: nn.Module, roots: torch.Tensor, position: torch.Tensor, image: torch.Tensor,
                     patches: torch.Tensor, sweeps: int = MEMBERSHIP_SWEEPS,
                     missing: bool = False) -> tuple[torch.Tensor, int]:
    """Past B T = D - 1: the membership ``image`` [n] repaired where its linear solve was wrong.

    The linear steps' patches are close whatever the membership (steps 3 and 4 are separate), and
    block 0 maps an image's patches onto its own roots only with every token in its image, so the
    sum over images of ||u(Z_b) - u_b||^2 (:func:`block0_roots_of`, patches as given) is an objective
    for the membership alone. Coordinate descent on it: at every position the holders' images are
    permuted, a holder moved to an image whose position p was shuffled with one of that image's E_unk
    tokens moved back, and every pair of E_unk tokens in different images swapped, each change kept where
    the sum falls, for at most ``sweeps`` sweeps or until one changes nothing. Each image keeps its
    class token and its shuffled positions. ``missing`` (a plain client's roots read to a defence's
    noise, some tokens without one): a position with fewer holders than images has roots missing, not
    shuffled, and a holder is also moved alone to an image that holds none there. Returns (the
    membership, the changes made)."""
    from itertools import permutations

    from .linear import token_offsets

    blk = vit.blocks[0]
    We, off, _, _ = token_offsets(vit)
    T = int(vit.pos_embed.shape[1])
    Z_all = off[position] + patches.to(torch.float64) @ We.T  # the class tokens' patches are zero
    target = roots.to(torch.float64)
    image = image.clone()
    batch = int(image.max()) + 1

    def cost(b: int, img: torch.Tensor) -> float:
        idx = (img == b).nonzero().flatten()
        with torch.no_grad():
            return float((block0_roots_of(blk, Z_all[idx]) - target[idx]).pow(2).sum())

    costs = [cost(b, image) for b in range(batch)]
    changes = 0
    for _ in range(sweeps):
        changed = 0
        groups = [(position == p).nonzero().flatten() for p in range(1, T)]
        for idx in groups:
            if idx.numel() < 2:
                continue
            holders = image[idx].tolist()
            best, pick = sum(costs[b] for b in holders), None
            for perm in permutations(holders):
                if list(perm) == holders:
                    continue
                trial = image.clone()
                trial[idx] = torch.tensor(perm)
                c = {b: cost(b, trial) for b in holders}
                if sum(c.values()) < best:
                    best, pick = sum(c.values()), (trial, c)
            if pick is not None:
                image = pick[0]
                for b, c_ in pick[1].items():
                    costs[b] = c_
                changed += 1
        if missing:  # a lone holder to an image with no root at its position
            for idx in groups:
                if idx.numel() in (0, batch):
                    continue
                for s in idx.tolist():
                    a = int(image[s])
                    for c in sorted(set(range(batch)) - set(image[idx].tolist())):
                        trial = image.clone()
                        trial[s] = c
                        ca, cc = cost(a, trial), cost(c, trial)
                        if ca + cc < costs[a] + costs[c]:
                            image, costs[a], costs[c] = trial, ca, cc
                            a = c
                            changed += 1
        unk = (position == T).nonzero().flatten().tolist()
        for idx in groups:  # a token to an image whose position p was shuffled, an E_unk token back
            if not unk or idx.numel() in (0, batch):
                continue
            for s in idx.tolist():
                a = int(image[s])
                for c in sorted(set(range(batch)) - set(image[idx].tolist())):
                    best, pick = costs[a] + costs[c], None
                    for t in unk:
                        if int(image[t]) != c:
                            continue
                        trial = image.clone()
                        trial[s], trial[t] = c, a
                        ca, cc = cost(a, trial), cost(c, trial)
                        if ca + cc < best:
                            best, pick = ca + cc, (trial, ca, cc)
                    if pick is not None:
                        image, costs[a], costs[c] = pick
                        a = c
                        changed += 1
        for i, s in enumerate(unk):
            for t in unk[i + 1:]:
                a, b = int(image[s]), int(image[t])
                if a == b:
                    continue
                trial = image.clone()
                trial[s], trial[t] = b, a
                ca, cb = cost(a, trial), cost(b, trial)
                if ca + cb < costs[a] + costs[b]:
                    image, costs[a], costs[b] = trial, ca, cb
                    changed += 1
        changes += changed
        if not changed:
            break
    return image, changes

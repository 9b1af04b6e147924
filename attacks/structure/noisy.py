"""The block-0 read of a defended batch-1 update (:mod:`attacks.structure.block0_roots` under a
perturbing defence the server knows: quantisation, pruning, local DP, DP-SGD).

A perturbed update lifts the weight gradients' smaller singular values off zero, so the exact read's
rank test sees no span of rank T and refuses. The update still holds what the read needs, to the
defence's noise (docs/results/structure.md, "Under defences"):

1. **Spans to the known rank.** fc1's and fc2's weight updates have rank T before the defence, so
   their top T right singular vectors are their spans' total-least-squares estimate
   (:func:`attacks.solvers.spans.truncated_span`).
2. **Roots to the noise.** On those spans a true token is no longer an exact root of block 0's
   per-token problem, but a minimum next to it: the root search keeps a start whose squared residual
   is below :data:`NOISY_TOL`, and stops after :data:`NOISY_PATIENCE` rounds in a row that add none
   (a token without a minimum next to it is never found).
3. **Best fits.** Step 2 of the exact read holds as it is on the defended update; every root's
   embedding is then fitted at every position, and the roots take positions by an optimal assignment
   on the log of their residuals, one root per position: a root a little off its token fits its own
   position best far more often than any other. On MJP the positions whose dL/dP row sits at the
   defence's zero level are the shuffled ones
   (:func:`attacks.closed_form.mjp_update.read_defended_mjp_update`): they take the roots assigned to
   E_unk, and no other.
4. **The image prior where no root fits.** A token whose near-root the search did not reach leaves
   its position empty; the read fills it from the positioned patches around it by biharmonic
   inpainting (scikit-image's ``inpaint_biharmonic``).
5. **Starts from the filled image.** Block 0's forward at that image gives every token's fc1 input,
   the empty positions' near their tokens' (a token's fc1 input depends on the others only through
   attention's averages): solved on the truncated spans from there, a start in its token's basin
   reaches a near-root the random starts missed (:func:`refine_from_prior`), and steps 3 and 4 run
   again, until no position is empty or a round adds no root.
6. **The patches refit to their roots.** Step 2's linear solves carry every root's error into every
   token's output gradient (fc2's update holds them all), and a token without a root biases them
   all; block 0 maps the patches onto the roots directly, so the patches are refit to the roots
   found (:func:`attacks.structure.polish.root_polish`), the positions without a root held at the
   prior's patches and entering through attention only.

What is still empty after step 5 is the prior's, not the update's, and the read says how many
positions that is.

**Batches (plain clients, B T <= D - 1).** The spans are truncated to rank B T, the assignment of
step 3 takes B roots per position, and each root's image comes from the exact read's attention
indicators (which tokens share a class token's image) by an assignment per position, repaired by
the root-residual coordinate descent of the read past D - 1
(:func:`attacks.structure.polish.refit_membership`, where a lone holder of a position may also move
to the image that holds none there: :func:`noisy_membership`); steps 4 to 6 run image by image. A
root left out biases step 2's solves for every token: at B = 2 two of 130 cost about 25 positions
(tests/test_block0_noisy.py), against none at B = 1. An MJP batch is refused (its E_unk tokens'
images under noise are not read yet).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, cast

import numpy as np
import torch
import torch.nn as nn
from scipy.optimize import linear_sum_assignment
from skimage.restoration import inpaint_biharmonic

from patchgrid import patchify, unpatchify

from ..api.base import AttackFailure, AttackMetadata
from ..api.progress import report
from ..closed_form.first_layer import is_design_a
from ..closed_form.mjp_update import read_defended_mjp_update
from ..solvers.spans import truncated_span
from .linear import embeddings_less_shift, token_equations, token_offsets
from .placement import assign_images, image_indicators, needs_gradient_placement, patch_at, position_residuals
from .polish import ROOT_POLISH_JACOBIANS, refit_membership, root_polish
from .roots import RootSearch, dedupe, find_roots
from .token_roots import MLPSpans
from .warm import closed_form_tokens, fc1_inputs, warm_roots

#: the root search keeps a start on a defended update's truncated spans where its squared residual in
#: block 0's per-token problem is below this: the minima next to true tokens sit at 1e-6 to 1e-4 after
#: 16-bit rounding (tests/test_block0_noisy.py: test_a_16_bit_update_of_an_mjp_client_gives_x_tilde)
NOISY_TOL = 1e-3
#: the root search stops after this many rounds in a row that add no root (module doc, step 2)
NOISY_PATIENCE = 2
#: rounds of step 5 at most (module doc): each adds the near-roots its filled image's tokens reach
PRIOR_ROUNDS = 4


@dataclass(frozen=True)
class NoisyRead:
    """Outcome of :func:`read_defended`.

    Attributes:
        images: [B, C, H, W] the model inputs read (x~ on an MJP client, its shuffled patches in the
            shuffled positions in root order).
        position: [n] each root's position (0: a class token, T: E_unk), -1 where it took none (more
            roots than positions).
        residual: [n] each root's relative residual at its position.
        filled: [B, T - 1] bool, the patch positions no root took, filled from the image prior.
        shuffled: [T - 1] bool, the positions that carried E_unk (all False on a plain client).
    """

    images: torch.Tensor
    position: torch.Tensor
    residual: torch.Tensor
    filled: torch.Tensor
    shuffled: torch.Tensor


def noisy_spans(grads: Mapping[str, torch.Tensor], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 (module doc): fc1's and fc2's input spans [D, T] and [4D, T], truncated to ``tokens``."""
    return cast(tuple[torch.Tensor, torch.Tensor], tuple(
        truncated_span(grads[f"blocks.0.mlp.{k}.weight"].to("cpu", torch.float64), tokens) for k in ("fc1", "fc2")))


@dataclass(frozen=True)
class Fits:
    """Outcome of :func:`best_fits`: each root's position [n] (0: the class token, T: E_unk; -1: none),
    its relative residual there [n], the patches [B, T - 1, C p^2] of the grid positions a root took
    (zero elsewhere), each root's grid position [n] (an E_unk root's shuffled position; 0: the class
    token; -1: none) and its image [n]."""

    position: torch.Tensor
    residual: torch.Tensor
    patches: torch.Tensor
    spot: torch.Tensor
    image: torch.Tensor


def best_fits(vit: nn.Module, grads: Mapping[str, torch.Tensor], roots: torch.Tensor, shuffled: torch.Tensor,
              batch: int = 1) -> Fits:
    """Step 3 (module doc): every root's position by an optimal assignment on the log of its
    residuals (``batch`` roots per position, E_unk once per ``shuffled`` [T - 1] position) and its
    patch there; the E_unk roots take the shuffled positions in the order of their residuals. At
    ``batch`` > 1 (plain clients) each root's image by :func:`noisy_membership`."""
    T = int(vit.pos_embed.shape[1])
    blk = cast(nn.Module, vit.blocks[0])
    eq = token_equations(vit, grads, roots)
    base = embeddings_less_shift(blk.attn, eq)
    _, off, M, Qm = token_offsets(vit)
    res = position_residuals(base, off, Qm)
    cols = torch.cat([torch.arange(T)[torch.cat([torch.tensor([True]), ~shuffled])],
                      torch.full((int(shuffled.sum()),), T)]).repeat(batch)  # E_unk once per shuffled position
    rows, picked = linear_sum_assignment(res[:, cols].detach().clamp_min(1e-300).log().numpy())
    rows_t, cols_t = torch.as_tensor(rows, dtype=torch.long), cols[torch.as_tensor(picked, dtype=torch.long)]
    position = torch.full((roots.shape[0],), -1, dtype=torch.long)
    position[rows_t] = cols_t
    residual = res[torch.arange(roots.shape[0]), position.clamp_min(0)]
    shift_patch = [patch_at(M, off[int(at)], base[j]) if 0 < int(at) else None for j, at in enumerate(position)]
    image = torch.zeros_like(position)
    if batch > 1:
        tokens = torch.stack([base[j] + sp[0] if sp is not None else off[0] for j, sp in enumerate(shift_patch)])
        patches_all = torch.stack([sp[1] if sp is not None else torch.zeros(M.shape[1] - 1, dtype=torch.float64)
                                   for sp in shift_patch])
        image = noisy_membership(vit, roots, tokens, eq.outputs, position, patches_all, batch)
    slots = (shuffled.nonzero().flatten() + 1).tolist()
    patches = torch.zeros(batch, T - 1, M.shape[1] - 1, dtype=torch.float64)
    spot = torch.full_like(position, -1)
    for j in torch.argsort(residual).tolist():
        at = int(position[j])
        if at < 0:
            continue
        spot[j] = slots.pop(0) if at == T else at
        sp = shift_patch[j]
        if spot[j] and sp is not None:
            patches[image[j], spot[j] - 1] = sp[1]
    return Fits(position, residual, patches, spot, image)


def noisy_membership(vit: nn.Module, roots: torch.Tensor, tokens: torch.Tensor, outputs: torch.Tensor,
                     position: torch.Tensor, patches: torch.Tensor, batch: int) -> torch.Tensor:
    """Step 3's image of each root [n] at ``batch`` > 1 (-1 where it took no position): the exact read's
    attention indicators (:func:`attacks.structure.placement.image_indicators`: the tokens that share
    a class token's image) decide each position's holders by an optimal assignment, and the
    root-residual coordinate descent (:func:`attacks.structure.polish.refit_membership`, holders of a
    position permuted or a lone holder moved to an image with no root there) repairs what the
    noise put wrong. ``tokens`` [n, D] the embeddings, ``outputs`` [n, D] the attention outputs,
    ``patches`` [n, C p^2] each root's patch at its position."""
    blk = cast(nn.Module, vit.blocks[0])
    T = int(vit.pos_embed.shape[1])
    image = torch.full_like(position, -1)
    idx = (position >= 0).nonzero().flatten()
    pos = position[idx]
    if int((pos == 0).sum()) != batch:
        raise AttackFailure(f"{int((pos == 0).sum())} of the {batch} class tokens were found to the noise: no anchor "
                            "for each image's membership")
    own, _, _ = assign_images(image_indicators(blk, tokens[idx], outputs[idx], pos, batch), pos, T, missing=True)
    own, _ = refit_membership(vit, roots[idx], pos, own, patches[idx], missing=True)
    image[idx] = own
    return image


def fill_from_prior(vit: nn.Module, patches: torch.Tensor, known: torch.Tensor,
                    trusted: torch.Tensor) -> torch.Tensor:
    """Step 4 (module doc): the image [1, C, H, W] of ``patches`` [T - 1, C p^2] with the positions not
    ``known`` [T - 1] inpainted (biharmonic) from the ``trusted`` ones' pixels alone (on MJP the
    positioned patches: a shuffled patch's place is arbitrary); the model input's mean colour (0)
    where none is trusted."""
    C = int(vit.patch_embed.proj.weight.shape[1])
    p = int(vit.patch_embed.patch_size[0])
    grid = lambda t: unpatchify(t.reshape(1, -1, C, p, p), tuple(vit.patch_embed.grid_size))[0]  # noqa: E731
    image = grid(torch.where(known[:, None], patches, 0.0))
    if bool((~known).any()) and bool(trusted.any()):
        unknown = grid((~trusted)[:, None].expand(-1, C * p * p).to(torch.float64))[0] > 0.5
        painted = inpaint_biharmonic(image.permute(1, 2, 0).numpy(), unknown.numpy(), channel_axis=-1)
        fill = torch.from_numpy(np.ascontiguousarray(painted)).permute(2, 0, 1)
        cover = grid((~known)[:, None].expand(-1, C * p * p).to(torch.float64)) > 0.5
        image = torch.where(cover, fill, image)
    return image[None]


def read_defended(vit: nn.Module, grads: Mapping[str, torch.Tensor], roots: torch.Tensor,
                  shuffled: torch.Tensor | None, polish_jacobians: int = ROOT_POLISH_JACOBIANS,
                  batch: int = 1) -> NoisyRead:
    """Steps 3, 4 and 6 (module doc) from the roots [n, D] a search on the truncated spans found, the
    float64 ``vit`` and the (defended) update of ``batch`` images; ``shuffled`` [T - 1] bool, the MJP
    client's shuffled positions (None: a plain client); ``polish_jacobians`` 0: no step 6."""
    T = int(vit.pos_embed.shape[1])
    shuffled = torch.zeros(T - 1, dtype=torch.bool) if shuffled is None else shuffled.to(torch.bool)
    with torch.no_grad():
        fits = best_fits(vit, grads, roots, shuffled, batch)
        taken = torch.zeros(batch, T, dtype=torch.bool)
        has = fits.spot >= 0
        taken[fits.image[has], fits.spot[has]] = True
        known = taken[:, 1:]
        images = torch.cat([fill_from_prior(vit, fits.patches[b], known[b], known[b] & ~shuffled)
                            for b in range(batch)])
        if polish_jacobians:
            images = _polished(vit, roots, fits, images, shuffled, polish_jacobians)
    return NoisyRead(images, fits.position, fits.residual, ~known, shuffled)


def _polished(vit: nn.Module, roots: torch.Tensor, fits: Fits, images: torch.Tensor, shuffled: torch.Tensor,
              jacobians: int) -> torch.Tensor:
    """Step 6 (module doc): the images [B, C, H, W] whose patches block 0 maps onto the roots, from
    ``images`` (the read's); the grid positions without a root keep their patches and enter
    through attention only."""
    T = int(vit.pos_embed.shape[1])
    p = int(vit.patch_embed.patch_size[0])
    grid = patchify(images, p).flatten(2)  # [B, T - 1, C p^2]
    if not bool((fits.spot > 0).any()):  # no patch has a root: nothing to refit
        return images
    spots, kinds, owner, fitted, held = [], [], [], [], []
    for b in range(images.shape[0]):
        has = ((fits.spot >= 0) & (fits.image == b)).nonzero().flatten()
        taken = torch.zeros(T, dtype=torch.bool)
        taken[fits.spot[has]] = True
        missing = (~taken).nonzero().flatten()
        spots += [fits.spot[has], missing]
        kinds += [fits.position[has], torch.where(missing == 0, 0, torch.where(
            shuffled[(missing - 1).clamp_min(0)], T, missing))]
        owner.append(torch.full((has.numel() + missing.numel(),), b, dtype=torch.long))
        fitted += [torch.ones(has.numel(), dtype=torch.bool), torch.zeros(missing.numel(), dtype=torch.bool)]
        held += [roots[has], torch.zeros(missing.numel(), roots.shape[1], dtype=roots.dtype)]  # never compared
    spot, image = torch.cat(spots), torch.cat(owner)
    padded = torch.cat([torch.zeros(grid.shape[0], 1, grid.shape[2], dtype=grid.dtype), grid], 1)
    polish = root_polish(vit, torch.cat(held), torch.cat(kinds), image, padded[image, spot], jacobians,
                         torch.cat(fitted))
    out = grid.clone()
    at = spot >= 1
    out[image[at], spot[at] - 1] = polish.patches[at].to(out.dtype)
    return unpatchify(out.reshape(*out.shape[:2], -1, p, p), tuple(vit.patch_embed.grid_size))


def refine_from_prior(vit: nn.Module, grads: Mapping[str, torch.Tensor], problem: MLPSpans, roots: torch.Tensor,
                      shuffled: torch.Tensor | None, iterations: int,
                      rounds: int = PRIOR_ROUNDS, batch: int = 1) -> tuple[NoisyRead, torch.Tensor, list[int]]:
    """Steps 3 to 6 (module doc) from the roots [n, D] found so far on the truncated spans of
    ``problem``: (the read, every root found, the roots each round of step 5 added)."""
    read = read_defended(vit, grads, roots, shuffled, batch=batch)
    added: list[int] = []
    for _ in range(rounds):
        if not bool(read.filled.any()):
            break
        starts = torch.cat([fc1_inputs(vit, read.images[b:b + 1], read.shuffled) for b in range(batch)])
        before = roots.shape[0]
        roots = dedupe(roots, warm_roots(problem, problem.S1, starts, iterations, NOISY_TOL))
        added.append(roots.shape[0] - before)
        if not added[-1]:
            break
        read = read_defended(vit, grads, roots, shuffled, batch=batch)
    return read, roots, added


@dataclass(frozen=True)
class DefendedRead:
    """Outcome of :func:`read_defended_update`: the read, the search (steps 1 and 2), every root found
    (the search's and step 5's), the roots each round of step 5 added, the MJP client's shuffled
    positions [T - 1] (None: a plain client), the patches placed, the positions from the prior, and
    the notes on what was read off the update."""

    read: NoisyRead
    search: RootSearch
    roots: torch.Tensor
    prior_added: list[int]
    shuffled: torch.Tensor | None
    placed: int
    filled: int
    notes: list[str]


def read_defended_update(work: nn.Module, grads: Mapping[str, torch.Tensor], meta: AttackMetadata, starts: int,
                         rounds: int, iterations: int, generator: torch.Generator,
                         warm_start: bool = True) -> DefendedRead:
    """Steps 1 to 6 (module doc) on the float64 copy ``work`` and its defended batch-1 update, the
    defence in ``meta``; the search runs ``starts`` starts a round, ``rounds`` rounds at most,
    ``iterations`` Levenberg-Marquardt steps a start, first from the closed form's read where
    ``warm_start`` (:mod:`attacks.structure.warm`).

    Raises:
        AttackFailure: B > 1, design A, a geometry whose positions the patch least squares cannot tell
            apart, no root found, or more positions from the prior than from the update.
    """
    assert meta.defence is not None
    T, D, B = int(work.pos_embed.shape[1]), int(work.embed_dim), meta.num_images
    what = meta.defence.label
    unk = [nm for nm in grads if nm.split(".")[-1] == "unk_embed"]
    mjp = bool(unk) and float(grads[unk[0]].abs().max()) > 0
    if (B != 1 and mjp) or B * T > D - 1 or is_design_a(work.blocks[0]) or needs_gradient_placement(work):
        why = (f"B = {B} MJP clients: the membership step under noise reads plain clients only" if B != 1 and mjp
               else f"B = {B}: B T = {B * T} > D - 1 = {D - 1}, no token is a root of the truncated spans past it"
               if B * T > D - 1 else "design A's attention solve" if is_design_a(work.blocks[0]) else
               f"the patch least squares cannot tell positions apart here (1 + C p^2 >= D = {D})")
        raise AttackFailure(f"block0_roots reads a defended update ({what}) on the standard block with B T <= D - 1 "
                            f"(B = 1 on an MJP client) only; {why} (noise_aware=False: the exact read, which "
                            "refuses a perturbed update)")
    notes: list[str] = []
    shuffled = None
    if mjp:  # an MJP client: its shuffled positions first
        shuffled, _, _, level = read_defended_mjp_update(work, dict(grads), meta)
        notes.append(f"MJP client: {int(shuffled.sum())} shuffled positions read off dL/dP's rows at the "
                     f"{level} level")
    fc1, fc2 = noisy_spans(grads, B * T)
    problem = MLPSpans(work.blocks[0], fc1, fc2)
    found = None
    if warm_start and B == 1:  # the closed form's read, as at the exact read (its starts off a token converge to none)
        near = closed_form_tokens(work, grads)
        found = None if near is None else warm_roots(problem, fc1, near, iterations, NOISY_TOL)
    report("block0_roots", 0, rounds, f"root search on the spans truncated to rank {B * T} ({what})")
    search = find_roots(work.blocks[0], fc1, fc2, grads["blocks.0.mlp.fc1.weight"].to(torch.float64),
                        grads["blocks.0.mlp.fc2.weight"].to(torch.float64), B * T, starts, rounds, iterations,
                        generator, tol=NOISY_TOL, found=found, patience=NOISY_PATIENCE)
    if not search.roots.shape[0]:
        raise AttackFailure(f"under {what} no start of the root search on fc1's and fc2's spans truncated to "
                            f"rank {B * T} came below a squared residual of {NOISY_TOL:g} in "
                            f"{len(search.per_round)} rounds of {starts} starts: the defence's noise "
                            "leaves no minimum next to a token")
    report("block0_roots", 0, None, "positions and patches by their best fit, starts from the image prior")
    read, roots, prior_added = refine_from_prior(work, grads, problem, search.roots, shuffled, iterations, batch=B)
    placed = int((read.position > 0).sum())
    filled = int(read.filled.sum())
    if filled > placed:
        raise AttackFailure(f"under {what} {roots.shape[0]} of block 0's {B * T} MLP roots were found to the noise "
                            f"(squared residual < {NOISY_TOL:g}): {placed} patches placed, {filled} positions "
                            "would be the image prior's, more than the update's; the defence's noise leaves most "
                            "tokens without a minimum next to them")
    return DefendedRead(read, search, roots, prior_added, shuffled, placed, filled, notes)

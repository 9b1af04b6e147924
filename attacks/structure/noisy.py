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
positions that is. Batch 1 only: the membership step (which image) of a batch has no noise-aware form yet.
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
from .placement import needs_gradient_placement, patch_at, position_residuals
from .polish import ROOT_POLISH_JACOBIANS, root_polish
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
        images: [1, C, H, W] the model input read (x~ on an MJP client, its shuffled patches in the
            shuffled positions in root order).
        position: [n] each root's position (0: a class token, T: E_unk), -1 where it took none (more
            roots than positions).
        residual: [n] each root's relative residual at its position.
        filled: [T - 1] bool, the patch positions no root took, filled from the image prior.
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
    its relative residual there [n], the patches [T - 1, C p^2] of the grid positions a root took (zero
    elsewhere) and each root's grid position [n] (an E_unk root's shuffled position; 0: the class
    token; -1: none)."""

    position: torch.Tensor
    residual: torch.Tensor
    patches: torch.Tensor
    spot: torch.Tensor


def best_fits(vit: nn.Module, grads: Mapping[str, torch.Tensor], roots: torch.Tensor, shuffled: torch.Tensor) -> Fits:
    """Step 3 (module doc): every root's position by an optimal assignment on the log of its
    residuals (one root per position, E_unk once per ``shuffled`` [T - 1] position) and its patch
    there; the E_unk roots take the shuffled positions in the order of their residuals."""
    T = int(vit.pos_embed.shape[1])
    eq = token_equations(vit, grads, roots)
    base = embeddings_less_shift(cast(nn.Module, vit.blocks[0]).attn, eq)
    _, off, M, Qm = token_offsets(vit)
    res = position_residuals(base, off, Qm)
    cols = torch.cat([torch.arange(T)[torch.cat([torch.tensor([True]), ~shuffled])],
                      torch.full((int(shuffled.sum()),), T)])  # E_unk once per shuffled position
    rows, picked = linear_sum_assignment(res[:, cols].detach().clamp_min(1e-300).log().numpy())
    rows_t, cols_t = torch.as_tensor(rows, dtype=torch.long), cols[torch.as_tensor(picked, dtype=torch.long)]
    position = torch.full((roots.shape[0],), -1, dtype=torch.long)
    position[rows_t] = cols_t
    residual = res[torch.arange(roots.shape[0]), position.clamp_min(0)]
    slots = (shuffled.nonzero().flatten() + 1).tolist()
    patches = torch.zeros(T - 1, M.shape[1] - 1, dtype=torch.float64)
    spot = torch.full_like(position, -1)
    for j in torch.argsort(residual).tolist():
        at = int(position[j])
        if at < 0:
            continue
        spot[j] = slots.pop(0) if at == T else at
        if spot[j]:
            patches[spot[j] - 1] = patch_at(M, off[at], base[j])[1]
    return Fits(position, residual, patches, spot)


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
                  shuffled: torch.Tensor | None, polish_jacobians: int = ROOT_POLISH_JACOBIANS) -> NoisyRead:
    """Steps 3, 4 and 6 (module doc) from the roots [n, D] a search on the truncated spans found, the
    float64 ``vit`` and the (defended) update; ``shuffled`` [T - 1] bool, the MJP client's shuffled
    positions (None: a plain client); ``polish_jacobians`` 0: no step 6."""
    T = int(vit.pos_embed.shape[1])
    shuffled = torch.zeros(T - 1, dtype=torch.bool) if shuffled is None else shuffled.to(torch.bool)
    with torch.no_grad():
        fits = best_fits(vit, grads, roots, shuffled)
        taken = torch.zeros(T, dtype=torch.bool)
        taken[fits.spot[fits.spot >= 0]] = True
        known = taken[1:]
        images = fill_from_prior(vit, fits.patches, known, known & ~shuffled)
        if polish_jacobians:
            images = _polished(vit, roots, fits, images, shuffled, polish_jacobians)
    return NoisyRead(images, fits.position, fits.residual, ~known, shuffled)


def _polished(vit: nn.Module, roots: torch.Tensor, fits: Fits, images: torch.Tensor, shuffled: torch.Tensor,
              jacobians: int) -> torch.Tensor:
    """Step 6 (module doc): the image [1, C, H, W] whose patches block 0 maps onto the roots, from
    ``images`` (the read's); the grid positions without a root keep their patches and enter
    through attention only."""
    T = int(vit.pos_embed.shape[1])
    p = int(vit.patch_embed.patch_size[0])
    grid = patchify(images, p)[0].flatten(1)  # [T - 1, C p^2]
    has = fits.spot >= 0
    if not bool((fits.spot > 0).any()):  # no patch has a root: nothing to refit
        return images
    taken = torch.zeros(T, dtype=torch.bool)
    taken[fits.spot[has]] = True
    missing = (~taken).nonzero().flatten()
    spots = torch.cat([fits.spot[has], missing])
    kinds = torch.cat([fits.position[has], torch.where(missing == 0, 0, torch.where(
        shuffled[(missing - 1).clamp_min(0)], T, missing))])
    patches = torch.cat([torch.zeros(1, grid.shape[1], dtype=grid.dtype), grid])[spots]
    fitted = torch.cat([torch.ones(int(has.sum()), dtype=torch.bool), torch.zeros(missing.numel(), dtype=torch.bool)])
    no_root = torch.zeros(missing.numel(), roots.shape[1], dtype=roots.dtype)  # never compared (``fitted``)
    polish = root_polish(vit, torch.cat([roots[has], no_root]), kinds, torch.zeros_like(kinds), patches, jacobians,
                         fitted)
    out = grid.clone()
    at = spots >= 1
    out[spots[at] - 1] = polish.patches[at].to(out.dtype)
    return unpatchify(out.reshape(1, T - 1, -1, p, p), tuple(vit.patch_embed.grid_size))


def refine_from_prior(vit: nn.Module, grads: Mapping[str, torch.Tensor], problem: MLPSpans, roots: torch.Tensor,
                      shuffled: torch.Tensor | None, iterations: int,
                      rounds: int = PRIOR_ROUNDS) -> tuple[NoisyRead, torch.Tensor, list[int]]:
    """Steps 3 to 6 (module doc) from the roots [n, D] found so far on the truncated spans of
    ``problem``: (the read, every root found, the roots each round of step 5 added)."""
    read = read_defended(vit, grads, roots, shuffled)
    added: list[int] = []
    for _ in range(rounds):
        if not bool(read.filled.any()):
            break
        starts = fc1_inputs(vit, read.images, read.shuffled)
        before = roots.shape[0]
        roots = dedupe(roots, warm_roots(problem, problem.S1, starts, iterations, NOISY_TOL))
        added.append(roots.shape[0] - before)
        if not added[-1]:
            break
        read = read_defended(vit, grads, roots, shuffled)
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
    if B != 1 or is_design_a(work.blocks[0]) or needs_gradient_placement(work):
        why = (f"B = {B}: the membership step has no noise-aware form" if B != 1 else
               "design A's attention solve" if is_design_a(work.blocks[0]) else
               f"the patch least squares cannot tell positions apart here (1 + C p^2 >= D = {D})")
        raise AttackFailure(f"block0_roots reads a defended update ({what}) at B = 1 on the standard block with "
                            f"T <= D - 1 only; {why} (noise_aware=False: the exact read, which refuses a "
                            "perturbed update)")
    notes: list[str] = []
    shuffled = None
    unk = [nm for nm in grads if nm.split(".")[-1] == "unk_embed"]
    if unk and float(grads[unk[0]].abs().max()) > 0:  # an MJP client: its shuffled positions first
        shuffled, _, _, level = read_defended_mjp_update(work, dict(grads), meta)
        notes.append(f"MJP client: {int(shuffled.sum())} shuffled positions read off dL/dP's rows at the "
                     f"{level} level")
    fc1, fc2 = noisy_spans(grads, T)
    problem = MLPSpans(work.blocks[0], fc1, fc2)
    found = None
    if warm_start:  # the closed form's read, as at the exact read (its starts off a token converge to none)
        near = closed_form_tokens(work, grads)
        found = None if near is None else warm_roots(problem, fc1, near, iterations, NOISY_TOL)
    report("block0_roots", 0, rounds, f"root search on the spans truncated to rank {T} ({what})")
    search = find_roots(work.blocks[0], fc1, fc2, grads["blocks.0.mlp.fc1.weight"].to(torch.float64),
                        grads["blocks.0.mlp.fc2.weight"].to(torch.float64), T, starts, rounds, iterations,
                        generator, tol=NOISY_TOL, found=found, patience=NOISY_PATIENCE)
    if not search.roots.shape[0]:
        raise AttackFailure(f"under {what} no start of the root search on fc1's and fc2's spans truncated to "
                            f"rank {T} came below a squared residual of {NOISY_TOL:g} in "
                            f"{len(search.per_round)} rounds of {starts} starts: the defence's noise "
                            "leaves no minimum next to a token")
    report("block0_roots", 0, None, "positions and patches by their best fit, starts from the image prior")
    read, roots, prior_added = refine_from_prior(work, grads, problem, search.roots, shuffled, iterations)
    placed = int((read.position > 0).sum())
    filled = int(read.filled.sum())
    if filled > placed:
        raise AttackFailure(f"under {what} {roots.shape[0]} of block 0's {T} MLP roots were found to the noise "
                            f"(squared residual < {NOISY_TOL:g}): {placed} patches placed, {filled} positions "
                            "would be the image prior's, more than the update's; the defence's noise leaves most "
                            "tokens without a minimum next to them")
    return DefendedRead(read, search, roots, prior_added, shuffled, placed, filled, notes)

"""Jigsaw solver: put a set of recovered patches back at a set of free grid positions.

Given an image grid where some positions hold known patches and the positions ``S`` are free, and
``|S|`` candidate patches (in any order), find the assignment patch -> position that makes the image
most coherent. The cost of a placement is the dissimilarity of the boundary pixels it creates with
the known neighbours plus each candidate's distance to a harmonic fill of the holes from the known
pixels (both linear in the assignment: solved exactly by
:func:`scipy.optimize.linear_sum_assignment`); the boundaries between two free positions depend on
two placements at once, so iterated re-assignment and greedy pair swaps refine it on the full cost.
:func:`oracle_c` is the solver's own bound on setting (c): the solver given the true patches.

Patches are [C, p, p] tensors; positions are row-major indices on a (gh, gw) grid.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from scipy.sparse import coo_matrix
from scipy.sparse.linalg import spsolve

_logger = logging.getLogger(__name__)

# (d_row, d_col, edge of the patch at the position, facing edge of the neighbour)
_DIRECTIONS = ((-1, 0, "top", "bottom"), (1, 0, "bottom", "top"), (0, -1, "left", "right"), (0, 1, "right", "left"))


def _edges(patches: torch.Tensor, width: int = 1) -> dict[str, torch.Tensor]:
    """Boundary strips of [K, C, p, p] patches, each [K, C * p * width] (outermost line first).

    The inner lines let the cost extrapolate the image gradient across the boundary (see
    :func:`edge_cost`)."""
    top = patches[:, :, :width, :].flip(2)
    bottom = patches[:, :, -width:, :]
    left = patches[:, :, :, :width].flip(3).transpose(2, 3)
    right = patches[:, :, :, -width:].transpose(2, 3)
    return {"top": top, "bottom": bottom, "left": left, "right": right}


#: Boundary costs :func:`edge_cost` knows.
COSTS = ("l2", "prediction", "mgc", "lp")
#: Ridge added to the 3 x 3 colour covariance of a strip's p gradient samples (``mgc``): p = 4 samples
#: cannot make it full rank (Gallagher adds dummy gradients for the same reason); pixel units^2.
MGC_RIDGE = 1e-3


#: The default weight of the harmonic-fill term of :func:`solve_jigsaw` is INPAINT_SCALE / p^3 (the
#: fill's error grows inwards from the known border, so larger patches need less of it): the weight
#: that placed the true patches best at 32 px and 224 px (docs/results/attacks.md, "The jigsaw").
INPAINT_SCALE = 1024.0


#: Patch side from which :func:`default_cost` is ``mgc`` (Gallagher's gradient compatibility) rather
#: than ``l2``: the cost that placed the true patches best at p = 16, where l2 did at p = 4
#: (docs/results/attacks.md, "The jigsaw"); tests/test_jigsaw_oracle.py pins the switch.
MGC_FROM_PATCH = 8


def default_cost(patch_size: int) -> str:
    """The boundary cost :func:`solve_jigsaw` uses unless told: ``mgc`` for patches of side
    :data:`MGC_FROM_PATCH` or more (enough pixels per edge for its gradient statistics), else ``l2``."""
    return "mgc" if patch_size >= MGC_FROM_PATCH else "l2"


def default_inpaint(patch_size: int) -> float:
    """The default weight of :func:`solve_jigsaw`'s harmonic-fill term for p x p patches."""
    return INPAINT_SCALE / float(patch_size) ** 3


def _cost_name(cost: "bool | str") -> str:
    name = {False: "l2", True: "prediction"}.get(cost, cost) if isinstance(cost, bool) else cost
    if name not in COSTS:
        raise ValueError(f"jigsaw cost must be one of {COSTS}, got {cost!r}")
    return name


def _mahalanobis_gradient(a0: torch.Tensor, a1: torch.Tensor, b0: torch.Tensor) -> torch.Tensor:
    """One direction of Gallagher's (2012) Mahalanobis gradient compatibility: a0, a1 [K, C, p] the
    outer and inner lines of side a, b0 [L, C, p] the facing outer line of side b -> [K, L]: the
    Mahalanobis distance of the p boundary gradients b0 - a0 under the distribution (colour mean and
    covariance over the p positions) of side a's own gradients a0 - a1, summed over positions."""
    g = a0 - a1  # [K, C, p]
    mu = g.mean(dim=2)  # [K, C]
    centred = g - mu[:, :, None]
    cov = centred @ centred.transpose(1, 2) / max(g.shape[2] - 1, 1)
    prec = torch.linalg.inv(cov + MGC_RIDGE * torch.eye(g.shape[1], dtype=g.dtype))  # [K, C, C]
    d = b0[None] - a0[:, None] - mu[:, None, :, None]  # [K, L, C, p]
    return torch.einsum("klcp,kcd,kldp->kl", d, prec, d)


def edge_cost(cost: "bool | str", a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dissimilarity of facing strips: a [K, C, 2, p] and b [L, C, 2, p] (outermost line first,
    then the line inside) -> [K, L].

    ``cost`` (a bool picks ``l2`` / ``prediction``):

    - ``l2``: mean squared difference of the outer lines;
    - ``prediction``: each side's outer line plus its own gradient predicts the other side's outer
      line; the mean squared prediction error of both directions plus the ``l2`` term;
    - ``mgc``: Gallagher's Mahalanobis gradient compatibility, both directions (the boundary
      gradients judged by each side's own gradient statistics), plus the ``l2`` term relative to
      the strips' mean squared gradient;
    - ``lp``: the prediction errors under a robust (L_0.3)^(1/16) norm (Pomeranz et al. 2011's best
      dissimilarity), which counts how many pixels disagree rather than by how much.
    """
    name = _cost_name(cost)
    a0, a1 = a[:, :, 0].flatten(1), a[:, :, 1].flatten(1)
    b0, b1 = b[:, :, 0].flatten(1), b[:, :, 1].flatten(1)
    if name == "l2":
        return torch.cdist(a0, b0).pow(2) / a0.shape[1]
    if name == "mgc":
        A0, A1, B0, B1 = a[:, :, 0], a[:, :, 1], b[:, :, 0], b[:, :, 1]  # [K, C, p]
        mgc = _mahalanobis_gradient(A0, A1, B0) + _mahalanobis_gradient(B0, B1, A0).T
        return mgc / A0.shape[1] / A0.shape[2]
    if name == "lp":
        pb = (2 * a0 - a1)[:, None] - b0[None]  # [K, L, F]
        pa = a0[:, None] - (2 * b0 - b1)[None]
        return ((pb.abs().pow(0.3).sum(-1) + pa.abs().pow(0.3).sum(-1)) / a0.shape[1]).pow(1 / 16)
    pred_b = 2 * a0 - a1  # [K, F]
    pred_a = 2 * b0 - b1  # [L, F]
    d_ab = torch.cdist(pred_b, b0).pow(2)
    d_ba = torch.cdist(a0, pred_a).pow(2)
    d_00 = torch.cdist(a0, b0).pow(2)
    return (d_ab + d_ba + d_00) / a0.shape[1]


def _neighbours(pos: int, grid: tuple[int, int]):
    gh, gw = grid
    r, c = divmod(pos, gw)
    for dr, dc, mine, theirs in _DIRECTIONS:
        rr, cc = r + dr, c + dc
        if 0 <= rr < gh and 0 <= cc < gw:
            yield rr * gw + cc, mine, theirs


def _costs(patches: torch.Tensor, grid: tuple[int, int], free_idx: list[int], known: torch.Tensor,
           prediction: "bool | str", inpaint: float) -> tuple[np.ndarray, dict, list]:
    """(unary [candidate, slot] cost with known neighbours (+ the harmonic-fill term), pair costs by
    edge, free-free links)."""
    K = len(free_idx)
    slot = {pos: j for j, pos in enumerate(free_idx)}
    edges_c = _edges(patches.double(), 2)
    edges_k = _edges(known.double(), 2)
    sides = ("top", "bottom", "left", "right")
    # pair[m][t][a, b]: candidate a's edge m facing candidate b's edge t.
    pair = {m: {t: edge_cost(prediction, edges_c[m], edges_c[t]).numpy() for t in sides} for m in sides}
    unary = np.zeros((K, K))  # [candidate, slot]: boundaries with known neighbours (exact)
    links = []  # free-free boundaries (slot i, slot j, edge of i, edge of j), each once
    for j, pos in enumerate(free_idx):
        for nb, mine, theirs in _neighbours(pos, grid):
            if nb in slot:
                if nb > pos:
                    links.append((j, slot[nb], mine, theirs))
            else:
                unary[:, j] += edge_cost(prediction, edges_c[mine], edges_k[theirs][nb:nb + 1])[:, 0].numpy()
    if inpaint > 0:
        # Each candidate against the smooth fill of the holes from the known pixels: the whole patch
        # (its mean colour and slow variation) counts, not only its boundary lines.
        free = torch.zeros(grid[0] * grid[1], dtype=torch.bool)
        free[free_idx] = True
        fill = harmonic_fill(known, free, grid)[free_idx].double().flatten(1)  # [K slots, C p^2]
        unary += inpaint * (torch.cdist(patches.double().flatten(1), fill).pow(2) / fill.shape[1]).numpy()
    return unary, pair, links


def _full_cost(unary: np.ndarray, pair: dict, links: list, order: np.ndarray) -> float:
    c = unary[order, np.arange(len(order))].sum()
    return float(c + sum(pair[mi][mj][order[i], order[j]] for i, j, mi, mj in links))


def arrangement_cost(patches: torch.Tensor, grid: tuple[int, int], free: torch.Tensor, known: torch.Tensor,
                     order: np.ndarray, prediction: "bool | str | None" = None,
                     inpaint: Optional[float] = None) -> float:
    """Full cost :func:`solve_jigsaw` minimises of placing ``patches[order[j]]`` at the j-th free
    position (``prediction`` / ``inpaint`` None: the solver's defaults for this patch size)."""
    free_idx = [int(i) for i in torch.nonzero(free.reshape(-1)).flatten()]
    w = default_inpaint(patches.shape[-1]) if inpaint is None else float(inpaint)
    cost = default_cost(patches.shape[-1]) if prediction is None else prediction
    return _full_cost(*_costs(patches, grid, free_idx, known, cost, w), np.asarray(order))


def harmonic_fill(known: torch.Tensor, free: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """[N, C, p, p] patches with the free positions' pixels replaced by the harmonic interpolation of
    the known pixels: the discrete Laplace equation on the free pixels (4-neighbourhood, the known
    pixels as boundary values), one sparse solve (``scipy.sparse.linalg.spsolve``) for all channels.
    A tiny pull towards the known pixels' mean keeps a free component without a known border well
    posed."""
    from patchgrid import patchify, unpatchify

    img = unpatchify(known.double()[None], grid)[0].numpy()  # [C, H, W]
    C, H, W = img.shape
    p = known.shape[-1]
    mask = (unpatchify(free.reshape(-1).double()[None, :, None, None, None].expand(1, -1, 1, p, p), grid)[0, 0]
            > 0).numpy()
    n = int(mask.sum())
    if n == 0:
        return known.clone()
    index = np.full((H, W), -1, dtype=np.int64)
    index[mask] = np.arange(n)
    diag = np.full(n, 1e-9)
    rhs = np.tile(1e-9 * img[:, ~mask].mean(axis=1), (n, 1))  # [n, C]
    r, c = np.nonzero(mask)
    me = index[r, c]
    rows, cols = [], []
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        rr, cc = r + dr, c + dc
        inside = (rr >= 0) & (rr < H) & (cc >= 0) & (cc < W)
        i, rr, cc = me[inside], rr[inside], cc[inside]
        np.add.at(diag, i, 1.0)
        other = index[rr, cc]
        nb_free = other >= 0
        rows.append(i[nb_free])
        cols.append(other[nb_free])
        np.add.at(rhs, i[~nb_free], img[:, rr[~nb_free], cc[~nb_free]].T)
    off_r, off_c = np.concatenate(rows), np.concatenate(cols)
    L = coo_matrix((np.concatenate([-np.ones(len(off_r)), diag]),
                    (np.concatenate([off_r, np.arange(n)]), np.concatenate([off_c, np.arange(n)]))), shape=(n, n))
    sol = np.asarray(spsolve(L.tocsc(), rhs)).reshape(n, C)
    out = img.copy()
    out[:, mask] = sol.T
    return patchify(torch.from_numpy(out)[None], p)[0].to(known.dtype)


def slot_of(free_idx: list[int]) -> dict[int, int]:
    return {pos: j for j, pos in enumerate(free_idx)}


def known_count(free_idx: list[int], grid: tuple[int, int], slot: dict[int, int]) -> np.ndarray:
    """[K] number of known (not free) neighbours of each free slot."""
    return np.array([sum(nb not in slot for nb, _, _ in _neighbours(pos, grid)) for pos in free_idx])


def _greedy_placement(unary: np.ndarray, pair: dict, links: list, n_known: np.ndarray) -> np.ndarray:
    """Grow the solution from the known border: repeatedly fill the slot whose best candidate is the
    most distinct from its second best (cost ratio), pricing candidates against known and placed
    neighbours (mean over those neighbours)."""
    K = unary.shape[0]
    order = np.full(K, -1, dtype=np.int64)
    free_c = np.ones(K, dtype=bool)
    nbrs: list[list[tuple[int, str, str]]] = [[] for _ in range(K)]
    for i, j, mi, mj in links:
        nbrs[i].append((j, mi, mj))
        nbrs[j].append((i, mj, mi))
    for _ in range(K):
        best = None
        for j in np.nonzero(order < 0)[0]:
            placed = [(o, m, t) for o, m, t in nbrs[j] if order[o] >= 0]
            count = n_known[j] + len(placed)
            if count == 0:
                continue
            cost = unary[:, j].copy()
            for o, m, t in placed:
                cost += pair[m][t][:, order[o]]
            cost = np.where(free_c, cost / count, np.inf)
            srt = np.sort(cost)
            ratio = srt[0] / (srt[1] + 1e-12) if free_c.sum() > 1 else 0.0
            if best is None or (count, -ratio) > (best[0], -best[1]):
                best = (count, ratio, j, int(np.argmin(cost)))
        if best is None:  # a free component with no known border: take the cheapest slot
            j = int(np.nonzero(order < 0)[0][0])
            c = int(np.nonzero(free_c)[0][0])
        else:
            j, c = best[2], best[3]
        order[j] = c
        free_c[c] = False
    return order


def _incident(K: int, pair: dict, links: list) -> list[list[tuple[int, int, np.ndarray]]]:
    """Per slot, its free-free boundaries as (slot i, slot j, pair matrix of i's edge facing j's)."""
    inc: list[list[tuple[int, int, np.ndarray]]] = [[] for _ in range(K)]
    for i, j, mi, mj in links:
        inc[i].append((i, j, pair[mi][mj]))
        inc[j].append((i, j, pair[mi][mj]))
    return inc


def _local_search(order: np.ndarray, unary: np.ndarray, pair: dict, links: list,
                  swap_passes: int) -> tuple[np.ndarray, float, int, int]:
    """Improve ``order`` on the full cost: iterated re-assignment against the current neighbours,
    then greedy pair swaps, for up to ``swap_passes`` passes. Returns (order, cost, swaps, reassignments).

    A swap is priced by the terms it changes (the two slots' unary terms and their boundaries), not by
    the whole cost: K^2 / 2 swaps a pass at a few boundaries each."""
    K = len(order)
    inc = _incident(K, pair, links)

    def full_cost(o: np.ndarray) -> float:
        return _full_cost(unary, pair, links, o)

    def around(a: int, b: int) -> float:  # the terms that swapping slots a and b changes
        v = unary[order[a], a] + unary[order[b], b]
        for i, j, m in inc[a]:
            v += m[order[i], order[j]]
        for i, j, m in inc[b]:
            if i != a and j != a:  # the a-b boundary, if any, is counted once
                v += m[order[i], order[j]]
        return float(v)

    best = full_cost(order)
    swaps = reassignments = 0
    for _ in range(max(int(swap_passes), 0)):
        improved = False
        # Iterated assignment: price every candidate at every slot against the current neighbours
        # (each free-free boundary seen from both sides, so half weight), re-solve, keep if better.
        for _ in range(20):
            local = unary.copy()
            for i, j, mi, mj in links:
                local[:, i] += 0.5 * pair[mi][mj][:, order[j]]
                local[:, j] += 0.5 * pair[mj][mi][:, order[i]]
            r, c = linear_sum_assignment(local)
            trial = np.empty(K, dtype=np.int64)
            trial[c] = r
            cost = full_cost(trial)
            if cost < best - 1e-12 * max(abs(best), 1.0):
                order, best, improved = trial, cost, True
                reassignments += 1
            else:
                break
        for i in range(K):
            for j in range(i + 1, K):
                before = around(i, j)
                order[i], order[j] = order[j], order[i]
                if around(i, j) - before < -1e-12 * max(abs(best), 1.0):
                    improved = True
                    swaps += 1
                else:
                    order[i], order[j] = order[j], order[i]
        best = full_cost(order)  # the swaps' differences summed anew, without their rounding
        if not improved:
            break
    return order, best, swaps, reassignments


#: Perturbations of :func:`solve_jigsaw`'s iterated local search by default, and the random swaps of
#: each: enough kicks to cross the pair swaps' local optima at 224 px, where more buy little
#: (docs/results/attacks.md, "The jigsaw"); tests/test_jigsaw_oracle.py's kicks test runs them.
KICKS = 40
KICK_SWAPS = 3


def _kicked_search(order: np.ndarray, best: float, unary: np.ndarray, pair: dict, links: list,
                   swap_passes: int, kicks: int, seed: int = 0) -> tuple[np.ndarray, float, int]:
    """Iterated local search: ``kicks`` times, swap KICK_SWAPS random pairs of the best order so far,
    search locally from there, keep the result if it costs less. The local optima of the pair-swap
    neighbourhood are deep (a group of patches placed together at the wrong place costs two swaps per
    patch to move); a kick and a search cross them. Seeded: the same input gives the same answer.
    Returns (order, cost, kicks accepted)."""
    K = len(order)
    if K < 3 or kicks < 1:
        return order, best, 0
    rng = np.random.default_rng(seed)
    accepted = 0
    for _ in range(kicks):
        trial = order.copy()
        for _ in range(KICK_SWAPS):
            a, b = rng.choice(K, 2, replace=False)
            trial[a], trial[b] = trial[b], trial[a]
        trial, cost, _, _ = _local_search(trial, unary, pair, links, swap_passes)
        if cost < best - 1e-12 * max(abs(best), 1.0):
            order, best = trial, cost
            accepted += 1
    return order, best, accepted


def solve_jigsaw(patches: torch.Tensor, grid: tuple[int, int], free: torch.Tensor,
                 known: torch.Tensor, swap_passes: int = 3, prediction: "bool | str | None" = None,
                 inpaint: Optional[float] = None, kicks: int = KICKS) -> tuple[np.ndarray, dict]:
    """Assign candidate patches to free positions.

    Args:
        patches: [K, C, p, p] candidates (K = number of free positions), any order.
        grid: (gh, gw).
        free: [N] bool, True at the free positions (K of them).
        known: [N, C, p, p] patches at every position (values at free positions are ignored).
        swap_passes: greedy pair-swap passes on the full cost (0: assignment only).
        prediction: the boundary cost, a name of :data:`COSTS` (see :func:`edge_cost`); False / True
            are ``l2`` / ``prediction``; None: :func:`default_cost` of the patch size.
        inpaint: weight of a per-slot term: each candidate's mean squared distance to the harmonic
            fill of the free positions from the known pixels (:func:`harmonic_fill`); 0: off
            (boundaries only); None: :func:`default_inpaint`.
        kicks: perturbations of the iterated local search after the local search (0: none;
            :func:`_kicked_search`).
    Returns:
        (order, info): ``order[j]`` is the candidate placed at the j-th free position (row-major);
        info holds ``cost_assignment``, ``cost_final``, ``swaps``, ``reassignments``, ``kicks_accepted``
        and ``cost`` (the boundary cost's name).
    """
    if isinstance(kicks, bool) or not isinstance(kicks, (int, np.integer)) or not 0 <= kicks <= 100_000:
        raise ValueError(f"jigsaw kicks must be an integer from 0 to 100000, got {kicks!r}")
    free_idx = [int(i) for i in torch.nonzero(free.reshape(-1)).flatten()]
    K = len(free_idx)
    if patches.shape[0] != K:
        raise ValueError(f"{patches.shape[0]} candidate patches for {K} free positions")
    cost = default_cost(patches.shape[-1]) if prediction is None else prediction
    if K == 0:
        return np.zeros(0, dtype=np.int64), dict(cost_assignment=0.0, cost_final=0.0, swaps=0, reassignments=0,
                                                 kicks_accepted=0, cost=_cost_name(cost))
    w = default_inpaint(patches.shape[-1]) if inpaint is None else float(inpaint)
    unary, pair, links = _costs(patches, grid, free_idx, known, cost, w)
    # Linear surrogate for the assignment: a free-free boundary costs the candidate's mean distance
    # to its three most compatible partners (the partner is unknown at this stage).
    surrogate = unary.copy()
    for i, j, mi, mj in links:
        for slot_, m, t in ((i, mi, mj), (j, mj, mi)):
            c = pair[m][t] + np.diag(np.full(K, np.inf))
            surrogate[:, slot_] += np.sort(c, axis=1)[:, :min(3, max(K - 1, 1))].mean(axis=1)
    surrogate = np.where(np.isfinite(surrogate), surrogate, 1e30)
    rows, cols = linear_sum_assignment(surrogate)
    order = np.empty(K, dtype=np.int64)
    order[cols] = rows

    starts = [order, _greedy_placement(unary, pair, links, known_count(free_idx, grid, slot_of(free_idx)))]
    info = dict(cost_assignment=min(_full_cost(unary, pair, links, o) for o in starts), swaps=0, reassignments=0,
                cost=_cost_name(cost))
    # Local search from both starts, the better end kept: the two starts are near-ties often enough
    # (the assignment's surrogate has many) that searching from only the cheaper one made the answer
    # depend on rounding-level differences of the patches (another local optimum on another CPU).
    best_order, best = None, np.inf
    for start in starts:
        o, c, swaps, reassignments = _local_search(start.copy(), unary, pair, links, swap_passes)
        info["swaps"] += swaps
        info["reassignments"] += reassignments
        if best_order is None or c < best - 1e-12 * max(abs(best), 1.0):
            best_order, best = o, c
    order, best, info["kicks_accepted"] = _kicked_search(best_order, best, unary, pair, links, swap_passes, int(kicks))
    info["cost_final"] = best
    return order, info


def place(patches: torch.Tensor, order: np.ndarray, free: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """[N, C, p, p]: ``known`` with ``patches[order[j]]`` written at the j-th free position."""
    out = known.clone()
    idx = torch.nonzero(free.reshape(-1)).flatten()
    out[idx] = patches[torch.as_tensor(order, dtype=torch.long)].to(out)
    return out


def unshuffle_image(image: torch.Tensor, shuffled: torch.Tensor, patch_size: int, **options) -> tuple[torch.Tensor, dict]:
    """Solve the jigsaw of one image whose patches at ``shuffled`` are in unknown order.

    Args:
        image: [1, C, H, W] (pixels, e.g. an estimate of x~ with the shuffled patches at S in any order).
        shuffled: [N] bool, the free positions S (row-major on the patch grid).
        patch_size: p.
        options: :func:`solve_jigsaw`'s keyword options (``swap_passes``, ``prediction``, ``inpaint``).
    Returns:
        ([1, C, H, W] the image with the patches at S rearranged, the solver's info).
    """
    from patchgrid import patchify, unpatchify

    _, _, H, W = image.shape
    grid = (H // patch_size, W // patch_size)
    pix = patchify(image, patch_size)[0]  # [N, C, p, p]
    S = shuffled.reshape(-1).cpu()
    idx = torch.nonzero(S).flatten()
    order, info = solve_jigsaw(pix[idx], grid, S, pix, **options)
    return unpatchify(place(pix[idx], order, S, pix)[None], grid), info


def oracle_c(x: torch.Tensor, x_tilde: torch.Tensor, shuffled: torch.Tensor, patch_size: int,
             **options) -> tuple[float, torch.Tensor]:
    """The jigsaw solver's own bound on setting (c): the solver given the *true* x~ (every unshuffled
    patch exact, the shuffled set exact, in MJP's order), scored by PSNR against x. No attack that
    hands the same solver an estimate of x~ does better than this except by chance.

    Args:
        x: [1, C, H, W] the original image, pixels in [0, 1].
        x_tilde: [1, C, H, W] the client's shuffled image x~, pixels.
        shuffled: [N] bool, S.
        patch_size: p.
        options: :func:`solve_jigsaw`'s options.
    Returns:
        (PSNR in dB of the solver's unshuffled x~ against x, that image [1, C, H, W]).
    """
    est, _ = unshuffle_image(x_tilde, shuffled, patch_size, **options)
    mse = float((est.double() - x.double()).pow(2).mean())
    return (float("inf") if mse == 0 else -10 * float(np.log10(mse))), est

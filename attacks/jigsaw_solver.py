"""Jigsaw solver: put a set of recovered patches back at a set of free grid positions.

Given an image grid where some positions hold known patches and the positions ``S`` are free, and
``|S|`` candidate patches (in any order), find the assignment patch -> position that makes the image
most coherent. The cost of a placement is the dissimilarity of the boundary pixels it creates with
the known neighbours (linear in the assignment: solved exactly by
:func:`scipy.optimize.linear_sum_assignment`); the boundaries between two free positions depend on
two placements at once, so a greedy pair-swap pass refines the assignment on the full cost.

Patches are [C, p, p] tensors; positions are row-major indices on a (gh, gw) grid.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

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


def edge_cost(prediction: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dissimilarity of facing strips: a [K, C, 2, p] and b [L, C, 2, p] (outermost line first,
    then the line inside) -> [K, L]: mean squared difference of the outer lines, or with
    ``prediction``: (as in Gallagher's Mahalanobis gradient compatibility, simplified): each side's
    outer line plus its own gradient predicts the other side's outer line; the cost is the mean
    squared prediction error of both directions plus the plain squared difference of the outer lines.
    """
    a0, a1 = a[:, :, 0].flatten(1), a[:, :, 1].flatten(1)
    b0, b1 = b[:, :, 0].flatten(1), b[:, :, 1].flatten(1)
    if not prediction:
        return torch.cdist(a0, b0).pow(2) / a0.shape[1]
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
           prediction: bool) -> tuple[np.ndarray, dict, list]:
    """(unary [candidate, slot] cost with known neighbours, pair costs by edge, free-free links)."""
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
    return unary, pair, links


def _full_cost(unary: np.ndarray, pair: dict, links: list, order: np.ndarray) -> float:
    c = unary[order, np.arange(len(order))].sum()
    return float(c + sum(pair[mi][mj][order[i], order[j]] for i, j, mi, mj in links))


def arrangement_cost(patches: torch.Tensor, grid: tuple[int, int], free: torch.Tensor, known: torch.Tensor,
                     order: np.ndarray, prediction: bool = False) -> float:
    """Full boundary cost of placing ``patches[order[j]]`` at the j-th free position."""
    free_idx = [int(i) for i in torch.nonzero(free.reshape(-1)).flatten()]
    return _full_cost(*_costs(patches, grid, free_idx, known, prediction), np.asarray(order))


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


def _local_search(order: np.ndarray, unary: np.ndarray, pair: dict, links: list,
                  swap_passes: int) -> tuple[np.ndarray, float, int, int]:
    """Improve ``order`` on the full cost: iterated re-assignment against the current neighbours,
    then greedy pair swaps, for up to ``swap_passes`` passes. Returns (order, cost, swaps, reassignments)."""
    K = len(order)

    def full_cost(o: np.ndarray) -> float:
        return _full_cost(unary, pair, links, o)

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
                order[i], order[j] = order[j], order[i]
                c = full_cost(order)
                if c < best - 1e-12 * max(abs(best), 1.0):
                    best, improved = c, True
                    swaps += 1
                else:
                    order[i], order[j] = order[j], order[i]
        if not improved:
            break
    return order, best, swaps, reassignments


def solve_jigsaw(patches: torch.Tensor, grid: tuple[int, int], free: torch.Tensor,
                 known: torch.Tensor, swap_passes: int = 3, prediction: bool = False) -> tuple[np.ndarray, dict]:
    """Assign candidate patches to free positions.

    Args:
        patches: [K, C, p, p] candidates (K = number of free positions), any order.
        grid: (gh, gw).
        free: [N] bool, True at the free positions (K of them).
        known: [N, C, p, p] patches at every position (values at free positions are ignored).
        swap_passes: greedy pair-swap passes on the full cost (0: assignment only).
        prediction: add the gradient-prediction terms to the boundary cost (see :func:`edge_cost`).
    Returns:
        (order, info): ``order[j]`` is the candidate placed at the j-th free position (row-major);
        info holds ``cost_assignment``, ``cost_final`` and ``swaps``.
    """
    free_idx = [int(i) for i in torch.nonzero(free.reshape(-1)).flatten()]
    K = len(free_idx)
    if patches.shape[0] != K:
        raise ValueError(f"{patches.shape[0]} candidate patches for {K} free positions")
    if K == 0:
        return np.zeros(0, dtype=np.int64), dict(cost_assignment=0.0, cost_final=0.0, swaps=0)
    unary, pair, links = _costs(patches, grid, free_idx, known, prediction)
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
    info = dict(cost_assignment=min(_full_cost(unary, pair, links, o) for o in starts), swaps=0, reassignments=0)
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
    order = best_order
    info["cost_final"] = best
    return order, info


def place(patches: torch.Tensor, order: np.ndarray, free: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """[N, C, p, p]: ``known`` with ``patches[order[j]]`` written at the j-th free position."""
    out = known.clone()
    idx = torch.nonzero(free.reshape(-1)).flatten()
    out[idx] = patches[torch.as_tensor(order, dtype=torch.long)].to(out)
    return out

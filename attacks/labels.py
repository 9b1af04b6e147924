"""Label recovery from a batch update: which classes, and how many images of each.

For a linear head z_b = W h_b + c under the mean cross-entropy of n images,

    dL/dc = (1/n) sum_b (p_b - e_{y_b}),      dL/dW = (1/n) sum_b (p_b - e_{y_b}) h_b^T,

with p_b = softmax(z_b). The label counts are therefore k = sum_b p_b - n dL/dc: exact once the
batch's summed probabilities are known. The bias alone gives them only where the model is
uncertain (a class whose images are all predicted confidently has dL/dc_c ~ 0, and another image
predicted as that class can make it positive): the counts need sum_b p_b.

:func:`recover_label_counts` estimates it as iLRG does (Ma et al., ICCV 2023): the features h_b lie
in the row space of dL/dW (rank n for n <= C - 1 independent features), h_b = R a_b with R its
basis, and dL/dW R = (1/n) Delta A^T with Delta = P - Y. So for an invertible A the one-hot label
matrix is Y(A) = softmax(W R A + c) - n (dL/dW R) A^{-T}; A is fitted (L-BFGS, float64, a few
starts) until every column of Y(A) is one-hot (entries >= 0 summing to 1 with squared sum 1) and
Delta 1 = n dL/dc. The counts are then the rounded k above; where no fit is consistent, the bias's
negative entries decide (one image per class) and the result says so.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

_logger = logging.getLogger(__name__)


@dataclass
class LabelCounts:
    """Recovered labels of one update.

    ``labels``: [n] long, sorted (a batch's order is not in its summed update); ``counts``: [C]
    long, summing to n; ``method``: ``fit`` (iLRG-style, consistent), ``bias`` (the bias's
    negative entries, the fit failed), ``bias_only`` (no weight gradient); ``residual``: the fit's
    objective (0 at an exact fit); ``notes``: why a fallback was taken."""
    labels: torch.Tensor
    counts: torch.Tensor
    method: str
    residual: float = float("nan")
    notes: list[str] = field(default_factory=list)


def _counts_to_labels(counts: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(counts.numel()), counts.clamp_min(0))


def round_counts(real: torch.Tensor, n: int, floor: torch.Tensor | None = None) -> torch.Tensor:
    """Non-negative integers summing to n nearest to ``real`` [C] (largest remainder); classes in
    ``floor`` (bool [C]) get at least one image where n allows."""
    real = real.clamp_min(0).double()
    base = real.floor().long()
    if floor is not None:
        base = torch.maximum(base, floor.long())
    while int(base.sum()) > n:  # too many: take from the classes furthest above their estimate
        over = (base.double() - real).masked_fill(base == 0, -float("inf"))
        base[int(over.argmax())] -= 1
    while int(base.sum()) < n:  # too few: give to the largest remainders
        base[int((real - base.double()).argmax())] += 1
    return base


def _bias_fallback(bias_grad: torch.Tensor, n: int) -> torch.Tensor:
    """One image per class of the n most negative bias entries (the classic bias rule)."""
    counts = torch.zeros_like(bias_grad, dtype=torch.long)
    counts[bias_grad.argsort()[:n]] = 1
    return counts


def recover_label_counts(bias_grad: torch.Tensor, weight_grad: torch.Tensor | None, weight: torch.Tensor | None,
                         bias: torch.Tensor | None, n: int, starts: int = 32, iterations: int = 200,
                         tol: float = 1e-6, seed: int = 0) -> LabelCounts:
    """Label counts of a batch of ``n`` images from the head's update (see the module docstring).

    Args:
        bias_grad: [C] dL/dc of the mean loss; weight_grad: [C, D] dL/dW or None.
        weight, bias: the head's parameters [C, D], [C] (the server's model), or None.
        n: images in the batch (the server knows its clients' batch size).
        starts: random starts of the fit; iterations: L-BFGS steps per start.
        tol: the fit objective below which it is taken as consistent.
    Returns:
        :class:`LabelCounts`.
    """
    db = bias_grad.detach().double().cpu()
    C = db.numel()
    if weight_grad is None or weight is None or n >= C:
        why = ("no head weight gradient" if weight_grad is None or weight is None
               else f"{n} images >= {C} classes: the features' span is not identifiable")
        counts = _bias_fallback(db, n)
        return LabelCounts(_counts_to_labels(counts), counts, "bias_only", notes=[why])
    dW, W = weight_grad.detach().double().cpu(), weight.detach().double().cpu()
    c = torch.zeros(C, dtype=torch.float64) if bias is None else bias.detach().double().cpu()
    _, sv, Vh = torch.linalg.svd(dW, full_matrices=False)
    R = Vh[:n].T  # [D, n]: the span of the batch's features (rank n: independent features)
    K = dW @ R  # [C, n] = (1/n) Delta A^T
    WR = W @ R  # [C, n]
    gen = torch.Generator().manual_seed(seed)

    def objective(A: torch.Tensor) -> torch.Tensor:
        Ainv_T = torch.linalg.inv(A).T
        delta = n * (K @ Ainv_T)  # [C, n]
        P = torch.softmax(WR @ A + c[:, None], dim=0)
        Y = P - delta
        one_hot = (1 - Y.pow(2).sum(0)).pow(2).sum() + torch.relu(-Y).pow(2).sum()
        return one_hot + (delta.sum(1) / n - db).pow(2).sum() / db.pow(2).sum().clamp_min(1e-300)

    best, best_A = float("inf"), None
    # the features' coordinates in R: h_b = R a_b, and h_b ~ sqrt(D) in norm after a LayerNorm
    norm = float(W.shape[1]) ** 0.5
    for s in range(starts):
        A = (torch.randn(n, n, generator=gen, dtype=torch.float64) * norm / n ** 0.5).requires_grad_(True)
        opt = torch.optim.LBFGS([A], lr=1, max_iter=iterations, history_size=20, line_search_fn="strong_wolfe",
                                tolerance_grad=1e-14, tolerance_change=1e-16)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            val = objective(A)
            if torch.isfinite(val):
                val.backward()
            return val

        try:
            opt.step(closure)
            val = float(objective(A.detach()))
        except RuntimeError:  # a singular A along the way: this start is lost
            continue
        if val < best:
            best, best_A = val, A.detach().clone()
        if best < tol:
            break
    if best_A is None or not best < tol:
        counts = _bias_fallback(db, n)
        return LabelCounts(_counts_to_labels(counts), counts, "bias", best,
                           [f"no consistent fit of the head's update (objective {best:.2e} >= {tol:g}): "
                            "one image per most negative bias entry"])
    with torch.no_grad():
        P = torch.softmax(WR @ best_A + c[:, None], dim=0)
    real = P.sum(1) - n * db  # k = sum_b p_b - n dL/dc
    counts = round_counts(real, n, floor=db < 0)
    return LabelCounts(_counts_to_labels(counts), counts, "fit", best)

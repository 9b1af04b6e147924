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

Image by image (:func:`_per_image_solutions`, tried first): every delta_b lies in the n-dimensional
column space of K = dL/dW R, so for a guessed label y the n unknowns a_b must satisfy the C - 1 - n
equations Q^T (softmax(W R a + c) - e_y) = 0 (Q: the complement of [K, 1]); where the head's input
is a LayerNorm output h = gamma * hhat + beta (timm ViTs: ``norm`` / ``fc_norm``), sum(hhat) = 0 adds
one exact linear equation and ||hhat||^2 = D sigma^2 / (sigma^2 + eps) ~ D one that steers the
solver. For n <= C / 2 (n <= (C - 1) / 2 without the LayerNorm) that is at least as many equations
as unknowns. A weight gradient whose column space is that of the gradients g_b at the LayerNorm's
input (``norm_input_grad``: a token-pooled ViT's last ``mlp.fc2``) adds D - n equations per image
at any n < C: g_b is the LayerNorm backward of gamma * W^T delta_b at hhat_b, up to 1 / sigma_b.
A Levenberg-Marquardt solve per (label, start), batched, finds the batch's images one by one,
images that no start found come from deflation (the update less the found images), and the
assembled (A, labels) is accepted only where it reproduces the whole head update (n K = Delta A^T,
Delta 1 = n dL/dc) to the update's rounding. Otherwise, for larger n, each image has a family of
solutions and only the joint fit above is left; for n >= C the head's gradient has rank <= C - 1
< n, the features' span is not identifiable, and the bias rule is all there is.

:func:`recover_labels` is the one-pass rule the gradient-matching attacks use where labels are not
granted: the n most negative entries of the bias gradient (or of the weight gradient's row sums, iDLG).
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..api.base import AttackFailure
from ..solvers.lm import MARQUARDT, batched_lm

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
    """One image per class of the n most negative bias entries (the classic bias rule); for n > C
    classes, k = sum_b p_b - n dL/dc with sum_b p_b taken as n / C (uniform), rounded to n images."""
    C = bias_grad.numel()
    if n > C:
        return round_counts(n / C - n * bias_grad.double(), n, floor=bias_grad < 0)
    counts = torch.zeros_like(bias_grad, dtype=torch.long)
    counts[bias_grad.argsort()[:n]] = 1
    return counts


#: Levenberg-Marquardt steps of the per-image solve: with the LayerNorm norm equation, then without it.
_IMAGE_STEPS, _IMAGE_POLISH = 40, 10
#: A LayerNorm output has ||hhat||^2 / D = sigma^2 / (sigma^2 + eps): within this of 1 unless the
#: token's variance sigma^2 is below 1e3 eps (tests/test_labels.py's CIFAR updates run with it).
_LN_NORM_SLACK = 1e-3


def _batched_lm(f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, e: torch.Tensor,
                steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Levenberg-Marquardt on many small problems at once, f(x_i, e_i) -> residual: (x, squared residual).
    :func:`attacks.solvers.lm.batched_lm` with the MARQUARDT schedule; the Jacobians are
    torch.func's, batched by vmap (a non-finite entry counts as 0, a non-finite residual as inf)."""
    F, J = torch.vmap(f), torch.vmap(torch.func.jacfwd(f))

    def value_of(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return F(x, e).pow(2).sum(1).nan_to_num(float("inf"))

    def system(x: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r, Jx = F(x, e), J(x, e).nan_to_num()
        return r.pow(2).sum(1), Jx.transpose(1, 2) @ Jx, (Jx.transpose(1, 2) @ r.nan_to_num()[..., None])[..., 0]

    return batched_lm(system, value_of, x, steps, MARQUARDT, rows=(e,))


def _per_image_solutions(span: torch.Tensor, WR: torch.Tensor, c: torch.Tensor, R: torch.Tensor,
                         norm: Optional[tuple[torch.Tensor, torch.Tensor]], starts: int, gen: torch.Generator,
                         accept: float, pre: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The images' (a_b, y_b) found one by one (module docstring); ([m, n] coordinates, [m] labels),
    distinct, each solving its equations to ``accept`` (relative). ``span`` [C, k]: the images'
    deltas lie in its column space (K itself, or what the found images leave of it). ``pre``
    (needs ``norm``): gamma * W^T [D, C] and orthonormal columns [D, r] spanning the gradients at
    the LayerNorm's input (see :func:`recover_label_counts`)."""
    C, k = span.shape
    n = WR.shape[1]
    K = span
    Q = torch.linalg.svd(torch.cat([span, torch.ones(C, 1, dtype=K.dtype)], 1), full_matrices=True)[0][:, k + 1:]
    if norm is not None:
        u = 1 / norm[0]
        Ru, ub = R.T @ u / u.norm(), float(u @ norm[1]) / float(u.norm())
        RU, Ub, D = u[:, None] * R, u * norm[1], R.shape[0]

    def residual(w_norm: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def f(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
            parts = [Q.T @ (torch.softmax(WR @ a + c, 0) - e)]
            if norm is not None:
                parts += [(Ru @ a - ub)[None], w_norm * ((RU @ a - Ub).pow(2).sum() / D - 1)[None]]
            if pre is not None:  # LayerNorm backward of gamma * W^T delta at hhat, up to 1 / sigma
                hhat = RU @ a - Ub
                v = pre[0] @ (torch.softmax(WR @ a + c, 0) - e)
                g = v - v.mean() - hhat * (hhat @ v) / D
                g = g / g.norm().clamp_min(1e-300)
                parts.append(g - pre[1] @ (pre[1].T @ g))
            return torch.cat(parts)
        return f

    labels = torch.arange(C).repeat_interleave(starts)
    e = torch.nn.functional.one_hot(labels, C).to(K.dtype)
    x = torch.randn(C * starts, n, generator=gen, dtype=K.dtype) * (R.shape[0] / n) ** 0.5
    x, _ = _batched_lm(residual(1.0), x, e, _IMAGE_STEPS)
    x, cost = _batched_lm(residual(0.0), x, e, _IMAGE_POLISH)
    ok = cost.sqrt() < accept ** 0.5  # loose: a deflated span is only as exact as the images found; the
    # whole update decides (_assemble)
    # a saturated softmax (p = e_y) has delta = 0, which lies in every span: not an image of the
    # update (an image predicted that surely leaves no trace in it); the norm equation rules it out too
    ok &= (torch.softmax(x @ WR.T + c, 1) - e).norm(dim=1) > min(1e3 * accept, 1e-6)
    if norm is not None:
        ok &= ((RU @ x.T - Ub[:, None]).pow(2).sum(0) / D - 1).abs() < _LN_NORM_SLACK
    keep: list[int] = []
    for i in torch.nonzero(ok).flatten().tolist():  # distinct solutions: one per image
        if all(float((x[i] - x[j]).norm()) > 1e-3 * float(x[j].norm()) for j in keep):
            keep.append(i)
    return x[keep], labels[keep]


def _update_residual(A: torch.Tensor, labels: torch.Tensor, K: torch.Tensor, WR: torch.Tensor, c: torch.Tensor,
                     db: torch.Tensor) -> float:
    """||(n K - Delta A^T, n db - Delta 1)|| / ||n K||: 0 where (A, labels) explain the whole update."""
    n = A.shape[1]
    delta = torch.softmax(WR @ A + c[:, None], 0) - torch.nn.functional.one_hot(labels, K.shape[0]).to(K.dtype).T
    r = torch.cat([(n * K - delta @ A.T).flatten(), n * db - delta.sum(1)])
    return float(r.norm() / (n * K).norm().clamp_min(1e-300))


def _polish(A: torch.Tensor, labels: torch.Tensor, K: torch.Tensor, WR: torch.Tensor, c: torch.Tensor,
            db: torch.Tensor, steps: int = 8) -> torch.Tensor:
    """A few Levenberg-Marquardt steps on the whole update's residual (labels fixed) from ``A``: the
    deflated images are only as exact as the span they were solved in."""
    n, C = A.shape[1], K.shape[0]
    Y = torch.nn.functional.one_hot(labels, C).to(K.dtype).T

    def f(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        a = x.reshape(n, n)
        delta = torch.softmax(WR @ a + c[:, None], 0) - Y
        return torch.cat([(n * K - delta @ a.T).flatten(), n * db - delta.sum(1)])

    x, _ = _batched_lm(f, A.flatten()[None], Y[:1], steps)
    return x[0].reshape(n, n)


def _assemble(cand: torch.Tensor, labels: torch.Tensor, K: torch.Tensor, WR: torch.Tensor, c: torch.Tensor,
              db: torch.Tensor, solve: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], accept: float,
              max_sets: int = 64) -> tuple[Optional[torch.Tensor], float]:
    """n of the per-image solutions that explain the whole update; (labels or None, best residual).

    Where fewer than n are found (a second image of a class that every start of that class missed),
    the found ones are deflated until n are; where no set of n is consistent (a spurious solution in
    the set), up to two images of each of a few subsets are deflated: the residual
    n K - sum_{b in S} delta_b a_b^T of a subset S of n - k candidates has rank k, and the missing
    images solve the per-image equations in its column space (``solve``), far more overdetermined."""
    n = K.shape[1]
    best = float("inf")

    def _checked(A: torch.Tensor, y: torch.Tensor) -> float:
        res = _update_residual(A, y, K, WR, c, db)
        if accept <= res < 1e-2:  # close (a deflated image is only as exact as its span): polish, then judge
            res = _update_residual(_polish(A, y, K, WR, c, db), y, K, WR, c, db)
        return res

    # greedy first: deflate all found images while fewer than n are found (several repeats of a class)
    while 0 < cand.shape[0] < n:
        A, y = cand.T, labels
        delta = torch.softmax(WR @ A + c[:, None], 0) - torch.nn.functional.one_hot(y, K.shape[0]).to(K.dtype).T
        new, new_labels = solve(torch.linalg.svd(n * K - delta @ A.T, full_matrices=False)[0][:, :n - cand.shape[0]])
        fresh = [i for i in range(new.shape[0])
                 if all(float((new[i] - a).norm()) > 1e-3 * float(a.norm()) for a in cand)]
        if not fresh:
            break
        cand, labels = torch.cat([cand, new[fresh]]), torch.cat([labels, new_labels[fresh]])
    m = cand.shape[0]
    for k in range(0, 3):
        if m < n - k or n - k < 0:
            continue
        # each deflation is a per-image solve: few of them
        for subset in itertools.islice(itertools.combinations(range(m), n - k), max_sets if k == 0 else 8):
            idx = torch.tensor(subset, dtype=torch.long)
            A, y = cand[idx].T, labels[idx]
            if k > 0:
                delta = torch.softmax(WR @ A + c[:, None], 0) - torch.nn.functional.one_hot(y, K.shape[0]).to(K.dtype).T
                U = torch.linalg.svd(n * K - delta @ A.T, full_matrices=False)[0][:, :k]
                new, new_labels = solve(U)
                if new.shape[0] < k:
                    continue
                for extra in itertools.islice(itertools.combinations(range(new.shape[0]), k), max_sets):
                    e = torch.tensor(extra, dtype=torch.long)
                    A2, y2 = torch.cat([A, new[e].T], 1), torch.cat([y, new_labels[e]])
                    res = _checked(A2, y2)
                    best = min(best, res)
                    if res < accept:
                        return y2, res
                continue
            res = _checked(A, y)
            best = min(best, res)
            if res < accept:
                return y, res
    return None, best


def recover_label_counts(bias_grad: torch.Tensor, weight_grad: torch.Tensor | None, weight: torch.Tensor | None,
                         bias: torch.Tensor | None, n: int, starts: int = 32, iterations: int = 200,
                         tol: float = 1e-6, seed: int = 0, norm_weight: Optional[torch.Tensor] = None,
                         norm_bias: Optional[torch.Tensor] = None, image_starts: int = 8,
                         norm_input_grad: Optional[torch.Tensor] = None) -> LabelCounts:
    """Label counts of a batch of ``n`` images from the head's update (see the module docstring).

    Args:
        bias_grad: [C] dL/dc of the mean loss; weight_grad: [C, D] dL/dW or None.
        weight, bias: the head's parameters [C, D], [C] (the server's model), or None.
        n: images in the batch (the server knows its clients' batch size).
        starts: random starts of the fit; iterations: L-BFGS steps per start.
        tol: the joint fit's objective below which it is taken as consistent.
        norm_weight, norm_bias: [D] the affine LayerNorm whose output is the head's input (gamma,
            beta), or None: two more equations per image (module docstring).
        image_starts: starts per class of the per-image solve.
        norm_input_grad: [D, F] a weight gradient whose column space is that of the gradients at
            the LayerNorm's input, sum_b g_b m_b^T (a timm ViT's last ``blocks[-1].mlp.fc2.weight``:
            only the pooled token reaches the head, and that MLP acts token by token), or None.
            With ``norm_weight`` it gives D - n more equations per image, at any n < C.
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
    norm = None
    if norm_weight is not None and norm_bias is not None:
        norm = (norm_weight.detach().double().cpu(), norm_bias.detach().double().cpu())
    # the update's rounding: float32 updates reproduce to ~1e-6, float64 ones to ~1e-14
    accept = 1e4 * torch.finfo(weight_grad.dtype).eps
    notes: list[str] = []
    pre = None
    if norm is not None and norm_input_grad is not None:
        U, sv2, _ = torch.linalg.svd(norm_input_grad.detach().double().cpu(), full_matrices=False)
        rank = int((sv2 > accept * sv2[0]).sum())  # n where only the batch's pooled tokens reach it
        if rank < U.shape[0]:
            pre = (norm[0][:, None] * W.T, U[:, :rank])
    if C - 1 - n + (norm is not None) >= n or pre is not None:  # as many equations per image as unknowns
        def solve(span: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return _per_image_solutions(span, WR, c, R, norm, image_starts, gen, accept, pre)

        cand, labels = solve(K)
        got, res = _assemble(cand, labels, K, WR, c, db, solve, accept)
        if got is not None:
            counts = torch.bincount(got, minlength=C)
            return LabelCounts(_counts_to_labels(counts), counts, "fit", res)
        notes.append(f"per-image solve: {cand.shape[0]} images of {n} found, none of their sets explains the "
                     f"update (residual {res:.1e}); joint fit")

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
                           notes + [f"no consistent fit of the head's update (objective {best:.2e} >= {tol:g}): "
                            "one image per most negative bias entry"])
    with torch.no_grad():
        P = torch.softmax(WR @ best_A + c[:, None], dim=0)
    real = P.sum(1) - n * db  # k = sum_b p_b - n dL/dc
    counts = round_counts(real, n, floor=db < 0)
    return LabelCounts(_counts_to_labels(counts), counts, "fit", best, notes)


#: The rules of :func:`recover_labels` (``label_strategy`` of the gradient-matching attacks).
LABEL_STRATEGIES = ("bias", "idlg")


def recover_labels(grads: dict[str, torch.Tensor], head_names: Sequence[str], n: int, strategy: str) -> torch.Tensor:
    """Labels from the classifier's gradient (cross-entropy, mean over the batch).

    ``bias``: the bias gradient mean(softmax - onehot) is negative at the batch's labels: take the
    n most negative entries. ``idlg`` (Zhao et al.): the row sums of the weight gradient, n smallest.
    Returns [n] long (sorted).
    """
    weight = next((grads[h] for h in head_names if grads[h].dim() == 2), None)
    bias = next((grads[h] for h in head_names if grads[h].dim() == 1), None)
    if strategy == "bias" and bias is not None:
        score = bias
    elif strategy in ("idlg", "bias") and weight is not None:
        score = weight.sum(dim=-1)
    else:
        raise AttackFailure(f"label strategy {strategy!r} needs the classifier's gradient")
    return score.argsort()[:n].sort()[0].cpu()

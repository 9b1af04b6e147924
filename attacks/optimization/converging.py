"""One restart of gradient matching run to convergence, each update on its own
(:class:`ConvergingTrial`, the ``converge_window`` > 0 runs of :class:`attacks.optimization.matching.GradientMatching`).

Every update has its own candidate, Adam and step size, and stops on its own (the others go on; a
step evaluates the updates still running only), so an update's result does not depend on which
updates share the batched call. An update stops once its best objective improved by less than
``converge_tol`` (relative) over the last ``converge_window`` steps; its step size halves after
``converge_window // 2`` steps without improvement. ``incumbent`` [K], the data term of the best
earlier restart per update: this restart gives up on an update once its best data term, improving
for every remaining step at twice the rate of the last ``converge_window`` steps, would still not
get below it (it could not be chosen).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch
from tqdm.auto import tqdm

from ..api.progress import report
from .graph_step import GraphedStep

if TYPE_CHECKING:
    from .match_terms import MatchTerms


class ConvergingTrial:
    """The state of one converging restart over K updates; :meth:`run` returns (best candidate
    [K, n, C, H, W], objective trace [iterations, K] (NaN after a stop), failed [K], per update
    {start, iterations_run, converged, abandoned, objective_curve, solved[, steps_run_as]})."""

    def __init__(self, attack: Any, per_group, match: MatchTerms, y: torch.Tensor, shape: tuple, lo: torch.Tensor,
                 hi: torch.Tensor, trial: int, starts: Optional[list], solved: Optional[torch.Tensor] = None,
                 incumbent: Optional[torch.Tensor] = None) -> None:
        a = self.attack = attack
        self.per_group, self.match, self.y, self.lo, self.hi = per_group, match, y, lo, hi
        K = self.K = shape[0]
        self._start(shape, trial, starts)
        self.opts = [torch.optim.Adam([leaf], lr=a.lr) for leaf in self.leaves]
        self.stepper = GraphedStep(a, per_group, match, y) if a.cuda_graph else None
        self.its, self.window, self.patience = a.iterations, a.converge_window, max(1, a.converge_window // 2)
        its = self.its
        self.best = torch.stack([leaf.detach() for leaf in self.leaves]).clone()
        self.best_val = torch.full((K,), float("inf"), device=a.device)
        self.failed = torch.zeros(K, dtype=torch.bool, device=a.device)
        self.done = torch.zeros(K, dtype=torch.bool)
        self.converged, self.abandoned = [False] * K, [False] * K
        self.ran = [its] * K
        self.since = [0] * K  # steps since the best objective last improved
        self.history = torch.full((its + 1, K), float("inf"))  # running best objective after each step
        self.data_hist = torch.full((its + 1, K), float("inf"))  # running best data term after each step
        self.trace = torch.full((its, K), float("nan"))
        self.curves: list[list[list[float]]] = [[] for _ in range(K)]
        self.skip = torch.zeros(K, dtype=torch.bool) if solved is None else solved.clone()
        self._skip_matched_starts()
        self.bar = incumbent.detach().cpu() if incumbent is not None else torch.full((K,), float("inf"))

    def _start(self, shape: tuple, trial: int, starts: Optional[list]) -> None:
        """Each update's candidate leaf: its best-matching start (:meth:`GradientMatching._pick_starts`)
        or the trial's seeded draw, projected onto the box."""
        a, K, lo, hi = self.attack, self.K, self.lo, self.hi
        gen = torch.Generator(device="cpu")
        gen.manual_seed(a.seed + trial if a.seed is not None else torch.seed())
        draw = torch.randn(shape[1:], generator=gen)
        self.leaves, self.kinds = [], []
        self.chosen = a._pick_starts(self.per_group, self.match, self.y, draw, lo, hi, starts) if starts else [None] * K
        for k in range(K):
            start = self.chosen[k]
            self.kinds.append("random" if start is None else start[0])
            x0 = draw if start is None else start[1].to(draw.dtype)
            x0 = torch.max(torch.min(x0.to(a.device), hi), lo)
            self.leaves.append(x0.clone().requires_grad_(True))

    def _skip_matched_starts(self) -> None:
        """Updates that take no steps: those an earlier restart solved (``solved``) and those whose
        start's gradient already matches (1 - cos below the attack's ``exact_cos``: an exact closed
        form on a clean update has nothing left to gain, nor a random restart for it)."""
        a, K, chosen, kinds = self.attack, self.K, self.chosen, self.kinds
        if any(c is not None for c in chosen) and a.exact_cos > 0:
            with torch.no_grad():
                cos0 = a._objective(self.per_group, self.match, self.y, torch.stack(self.leaves).detach(), self.lo,
                                    with_prior=False, plain=True)[1]
            for k in range(K):
                if chosen[k] is not None and float(cos0[k]) < a.exact_cos:
                    self.skip[k] = True
                    kinds[k] += f" (1 - cos {float(cos0[k]):.1e} < {a.exact_cos:g}: no steps)"
        for k in range(K):
            if bool(self.skip[k]):
                self.done[k], self.ran[k], self.converged[k] = True, 0, True
                if chosen[k] is None:
                    kinds[k] += " (no steps: an earlier start matched the update)"

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[dict]]:
        a = self.attack
        for it in tqdm(range(self.its), disable=None if a.progress else True, desc=a.name, leave=False):
            active = [k for k in range(self.K) if not self.done[k]]
            if not active:
                break
            report(a.name, it, self.its, f"{len(active)} of {self.K} update(s) still converging")
            x, val, dval = self._evaluate(active)
            finite = torch.isfinite(val)
            self._record(it, active, x, val, dval, finite)
            for j, k in enumerate(active):
                self._advance(it, j, k, val, finite)
            if bool(self.done.all()):
                break
        self._keep_better_starts()
        return self.best, self.trace, self.failed, self._info()

    def _evaluate(self, active: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(candidates, objective, data term on the CPU) of the running updates, their gradients
        left in the leaves' ``.grad`` (a replayed CUDA graph's, or one eager backward)."""
        a, leaves = self.attack, self.leaves
        for k in active:
            self.opts[k].zero_grad(set_to_none=False)
        if self.stepper is not None:
            x = torch.stack([leaves[k].detach() for k in active])
            val, data, gx = self.stepper(active, x)
            for j, k in enumerate(active):
                if leaves[k].grad is None:
                    leaves[k].grad = gx[j].clone()
                else:
                    leaves[k].grad.copy_(gx[j])
        else:
            x = torch.stack([leaves[k] for k in active])
            obj, data = a._objective(self.per_group, self.match, self.y, x, self.lo, sel=active)
            val = obj.detach()
            torch.where(torch.isfinite(val), obj, torch.zeros_like(obj)).sum().backward(
                inputs=[leaves[k] for k in active])
        return x, val, data.detach().cpu()

    def _record(self, it: int, active: list[int], x: torch.Tensor, val: torch.Tensor, dval: torch.Tensor,
                finite: torch.Tensor) -> None:
        """Step ``it``'s running bests: objective, data term and candidate per running update."""
        history, data_hist = self.history, self.data_hist
        history[it + 1] = history[it]
        data_hist[it + 1] = data_hist[it]
        with torch.no_grad():
            for j, k in enumerate(active):
                if not bool(finite[j]):
                    self.failed[k] = True
                    continue
                data_hist[it + 1, k] = min(float(data_hist[it, k]), float(dval[j]))
                if bool(val[j] < self.best_val[k]):
                    self.best[k], self.best_val[k] = x[j].detach(), val[j]
                    self.since[k] = 0
                else:
                    self.since[k] += 1
                history[it + 1, k] = float(self.best_val[k])

    def _advance(self, it: int, j: int, k: int, val: torch.Tensor, finite: torch.Tensor) -> None:
        """Update k after step ``it``: stop it (non-finite, converged, or unable to reach the
        incumbent), else take its Adam step (halving the step size on a plateau) and project."""
        a, window = self.attack, self.window
        self.trace[it, k] = float(val[j])
        if not bool(finite[j]):
            self.done[k], self.ran[k] = True, it + 1
            return
        if it % a.curve_every == 0:
            self.curves[k].append([it, float(self.best_val[k])])
        old = float(self.history[it + 1 - window, k]) if it + 1 >= window else float("inf")
        now = float(self.best_val[k])
        if math.isfinite(old) and (old - now) <= a.converge_tol * max(abs(old), 1e-12):
            self.done[k], self.ran[k], self.converged[k] = True, it + 1, True
            return
        if it + 1 >= window and math.isfinite(float(self.bar[k])):
            d_old, d_now = float(self.data_hist[it + 1 - window, k]), float(self.data_hist[it + 1, k])
            reach = d_now - 2.0 * max(d_old - d_now, 0.0) / window * (self.its - it - 1)
            if math.isfinite(d_old) and reach > float(self.bar[k]):
                self.done[k], self.ran[k], self.abandoned[k] = True, it + 1, True
                return
        leaf = self.leaves[k]
        if leaf.grad is not None and a.signed == "hard":
            leaf.grad.sign_()
        self.opts[k].step()
        if self.since[k] >= self.patience:  # a plateau: halve the step size
            for group in self.opts[k].param_groups:
                group["lr"] = max(group["lr"] * 0.5, a.lr * 1e-3)
            self.since[k] = 0
        with torch.no_grad():
            leaf.data = torch.max(torch.min(leaf, self.hi), self.lo)

    def _keep_better_starts(self) -> None:
        """The start itself competes by the data term (restarts are scored by it too): the TV prior
        must not trade an exact closed-form start for a smoother, worse-matching image."""
        a, chosen, best = self.attack, self.chosen, self.best
        starts_used = [k for k in range(self.K) if chosen[k] is not None]
        if not starts_used:
            return
        x_start = torch.stack([leaf.detach() for leaf in self.leaves])
        for k in starts_used:
            x_start[k] = torch.max(torch.min(chosen[k][1].to(a.device, x_start.dtype), self.hi), self.lo)
        with torch.no_grad():
            cos_start = a._objective(self.per_group, self.match, self.y, x_start[starts_used], self.lo,
                                     with_prior=False, sel=starts_used)[1]
            cos_best = a._objective(self.per_group, self.match, self.y, best[starts_used], self.lo,
                                    with_prior=False, sel=starts_used)[1]
        for j, k in enumerate(starts_used):
            if bool(torch.isfinite(cos_start[j])) and not bool(cos_best[j] <= cos_start[j]):
                best[k] = x_start[k]
                self.kinds[k] += " (kept: no iterate matched better)"

    def _info(self) -> list[dict]:
        """Per update: how the restart started and ended, and its loss curve."""
        info, ran, kinds = [], self.ran, self.kinds
        for k in range(self.K):
            curve = self.curves[k]
            if not bool(self.skip[k]) and (not curve or curve[-1][0] != ran[k]):
                curve.append([ran[k], float(self.best_val[k])])
            if self.abandoned[k]:
                kinds[k] += f" (given up after {ran[k]} steps: it could not reach the best earlier restart)"
            info.append(dict(start=kinds[k], iterations_run=ran[k], converged=self.converged[k],
                             abandoned=self.abandoned[k], objective_curve=curve, solved=bool(self.skip[k])))
            if self.stepper is not None:
                info[-1]["steps_run_as"] = self.stepper.status()
        return info

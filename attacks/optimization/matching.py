"""Our own batched gradient-matching attacks: Inverting Gradients and APRIL's optimisation attack.

K independent updates (one per client, each of ``n`` images) are attacked together: the candidate
is [K * n, C, H, W], and each update's model gradient is computed for its own images with
``torch.func.vmap(grad(...))`` over the K groups, so one batched double backward yields every
candidate's gradient. The sum over k of independent objectives has d/dx_k = d objective_k / dx_k,
so the K reconstructions do not interact.

``invertinggradients_batched`` uses the objective and schedule of breaching's ``invertinggradients``
config: 1 - cosine similarity over the gradients of all parameters the plain forward pass uses (the
same parameter set as our breaching adapter), plus 0.2 x total variation (breaching's convolution
form: (|dx| + 1e-8) + (|dy| + 1e-8), mean), Adam lr 0.1 with hard-signed gradients, MultiStepLR at
iterations/2.667, /1.6, /1.142 (gamma 0.1), projection onto the [0, 1] box, randn init, and the best
iterate kept by objective (breaching's bookkeeping: the objective of the pre-step candidate decides
whether the post-step candidate is kept). Restarts are scored by the cosine term alone.

``april_optimization`` adds APRIL's position-embedding term: pe_weight x (1 - cos(dL/dP, target)).
It works for any ViT (pre-norm included) that has a ``pos_embed``.

The data terms (cosine, or the likelihood of a defence the attacker knows) and the TV prior live in
:mod:`attacks.optimization.match_terms`; label recovery from the head's gradient in :mod:`attacks.closed_form.labels`; the
converging runs' CUDA-graph step in :mod:`attacks.optimization.graph_step`; ``ig_closed_start`` (converging, from a
closed-form start) in :mod:`attacks.optimization.ig_closed_start`.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from tqdm.auto import tqdm

from fedmjp.config import Float, Int, option
from fedmjp.devices import resolve_device

from ..api.base import (Attack, AttackFailure, AttackOptions, AttackMetadata, AttackResult, Metadata, Update, check_finite,
                   expand_metadatas, update_to_gradients)
from ..api.progress import report
from ..api.registry import Threat, register_attack
from .breaching_adapter import attack_copy, matched_names
from ..closed_form.labels import LABEL_STRATEGIES, recover_labels
from .match_terms import MatchTerms, defence_match, total_variation, tv_kernel
from .converging import ConvergingTrial

_logger = logging.getLogger(__name__)


class GradientMatching(Attack):
    """Batched per-update gradient matching (see the module docstring).

    Args:
        iterations: Adam steps per restart.
        lr: Adam step size.
        tv: total-variation weight.
        signed: ``hard`` (sign of the gradient, breaching's IG) or None.
        scheduler: ``step-lr`` (breaching's IG) or None.
        restarts: independent trials; the best per update by the cosine score is returned.
        pe_weight: weight of the position-embedding gradient term (``april_optimization`` only).
        label_strategy: when labels are not granted: ``bias`` or ``idlg`` (:func:`recover_labels`).
        seed: seed of the candidate initialisation (a private generator).
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``; the benchmark passes the run's ``--device``.
        progress: show a tqdm bar over iterations.
        unk_mask: [N] bool positions that get E_unk in the attacker's forward (MJP models), shared
            by every attacked update; None: the plain forward.
        converge_window: 0: exactly ``iterations`` steps per restart (breaching's schedule). > 0:
            up to ``iterations`` steps, each update stopping once its best objective improved by
            less than ``converge_tol`` (relative) over the last ``converge_window`` steps; the step
            size halves after ``converge_window // 2`` steps without improvement; the stats keep
            the loss curve (``objective_curve``: [iteration, best objective] every ``curve_every``
            steps) and whether it converged. A later restart gives up on an update once it cannot
            get below the data term of the best earlier one (:meth:`_run_trial_converging`).
        defence_model: where ``AttackMetadata.defence`` names a defence the attacker can model
            (pruning, quantisation, local DP, DP-SGD), match through it (:func:`defence_match`:
            the kept entries, the quantiser's bins, the noise's likelihood); False: plain cosine.
        cuda_graph: converging runs on a CUDA device record each step's objective and gradient once
            as a CUDA graph and replay it (:class:`attacks.optimization.graph_step.GraphedStep`: one
            step is thousands of kernel launches, which the replay removes; the arithmetic stays).
            On by default; tests/test_cuda.py::test_ig_closed_start_cuda_graph_replays_the_eager_steps
            pins that a replay gives the eager steps' image. Ignored on the CPU; where recording fails
            the steps run eagerly and ``steps_run_as`` says why; False: eager steps always.
    """

    class Options(AttackOptions):
        """Inverting Gradients' options; ``pe_weight`` is :class:`AprilOptimization`'s alone."""

        iterations: Int = option(200, ge=1)
        lr: Float = 0.1
        tv: Float = 0.2
        signed: Optional[Literal["hard"]] = "hard"
        scheduler: Optional[Literal["step-lr"]] = "step-lr"
        restarts: Int = option(1, ge=1)
        label_strategy: Literal[LABEL_STRATEGIES] = "bias"
        seed: Optional[Int] = 0
        device: str = "cpu"
        progress: bool = False
        unk_mask: Any = None  # [N] bool tensor (or a list of bools), or None
        converge_window: Int = option(0, ge=0)
        converge_tol: Float = option(1e-4, ge=0.0)
        curve_every: Int = option(50, ge=1)
        defence_model: bool = False
        cuda_graph: bool = True

    def __init__(self, **options: Any) -> None:
        o = self._parse_options(options)
        # match through the clients' defence where the metadata names one (:func:`defence_match`)
        self.defence_model = o.defence_model
        # converge_window > 0: run up to ``iterations`` and stop each update once its best objective
        # improved by less than converge_tol (relative) over the last converge_window iterations
        self.converge_window, self.converge_tol, self.curve_every = o.converge_window, o.converge_tol, o.curve_every
        # converging runs: a start with 1 - cos below this takes no steps (0: always optimise)
        self.exact_cos = 0.0
        self.iterations, self.lr, self.tv, self.signed = o.iterations, o.lr, o.tv, o.signed
        self.scheduler, self.restarts = o.scheduler, o.restarts
        self.pe_weight = 0.0  # the position-embedding term: AprilOptimization's option
        self.label_strategy, self.seed, self.progress = o.label_strategy, o.seed, o.progress
        self.device = resolve_device(o.device)
        # converging runs on CUDA: each step's objective and gradient recorded once as a CUDA graph
        # and replayed (attacks.optimization.graph_step.GraphedStep); ignored on the CPU
        self.cuda_graph = o.cuda_graph and self.device.type == "cuda"
        # An MJP-aware attacker's forward: E_unk at these positions ([N] or [1, N] bool), as detected
        # from the update (attacks.optimization.mjp_adaptive); None for the plain forward.
        self.unk_mask = None if o.unk_mask is None else torch.as_tensor(o.unk_mask, dtype=torch.bool).reshape(1, -1)

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        return self._attack(model, [update], [meta])[0]

    def reconstruct_many(self, model: nn.Module, updates: Sequence[Update],
                         metadatas: Union[Metadata, Sequence[Metadata], None] = None) -> list[AttackResult]:
        """Attack K independent updates in one batched optimisation (updates of equal batch size;
        otherwise one batched run per batch size)."""
        mds = expand_metadatas(metadatas, len(updates))
        results: list[Optional[AttackResult]] = [None] * len(updates)
        groups: dict[int, list[tuple[int, AttackMetadata]]] = {}
        for i, md in enumerate(mds):
            meta, reason = self._run_guarded(lambda md=md: AttackMetadata.of(md, model))
            if reason is not None:
                results[i] = self._failed(model, md, reason)
            else:
                groups.setdefault(meta.num_images, []).append((i, meta))
        for members in groups.values():
            idx = [i for i, _ in members]
            t0 = time.perf_counter()
            solved, reason = self._run_guarded(
                lambda: self._attack(model, [updates[i] for i in idx], [m for _, m in members]))
            for j, i in enumerate(idx):
                results[i] = (self._failed(model, mds[i], reason) if reason is not None
                              else check_finite(solved[j], self.name, time.perf_counter() - t0))
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------------------- the attack
    def _attack(self, model: nn.Module, updates: Sequence[Update],
                metas: Sequence[AttackMetadata]) -> list[AttackResult]:
        t0 = time.perf_counter()
        K, n, size = len(updates), metas[0].num_images, metas[0].image_size
        work = attack_copy(model, torch.float32, self.device)
        converted = [update_to_gradients(u, m) for u, m in zip(updates, metas)]
        raw = [g for g, _ in converted]  # as sent (before _prepare_groups removes any known term)
        masks, starts, start_notes = self._prepare_groups(model, updates, metas, converted)
        names = self._matched(work, converted, size, masks)
        y, notes = self._labels(work, converted, metas, start_notes, n)
        targets = {nm: torch.stack([g[nm] for g, _ in converted]).to(self.device, torch.float32) for nm in names}
        if self.defence_model:
            match, more = defence_match(targets, raw, metas, names)
            for note in notes:
                note.extend(more)
        else:
            match = MatchTerms(targets)
        lo, hi = metas[0].box(torch.float32, self.device)
        per_group = self._per_group_gradients(work, names, masks)
        best = self._restarts(per_group, match, y, (K, n, *size), lo, hi, starts)
        return self._results(metas, best, y, len(names), notes, time.perf_counter() - t0)

    def _matched(self, work: nn.Module, converted: list, size: tuple, masks: Optional[torch.Tensor]) -> list[str]:
        """The parameters whose gradients are matched: those the forward uses, present in every update."""
        names = matched_names(work, converted[0][0], size)
        if (self.unk_mask is not None or masks is not None) and "unk_embed" not in names and all(
                "unk_embed" in g for g, _ in converted):
            names.insert(0, "unk_embed")  # used by the masked forward, not by the plain one
        names = [nm for nm in names if all(nm in g for g, _ in converted)]
        if self.pe_weight > 0 and "pos_embed" not in names:
            raise AttackFailure("the position-embedding term needs a model with pos_embed and its gradient")
        return names

    def _labels(self, work: nn.Module, converted: list, metas: Sequence[AttackMetadata], start_notes: list,
                n: int) -> tuple[torch.Tensor, list[list[str]]]:
        """(labels [K, n]: the granted ones, else recovered from the head's gradient, notes per update)."""
        head = getattr(work, "get_classifier", lambda: None)()
        head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
        head_names = [nm for nm, p in work.named_parameters() if id(p) in head_ids]
        labels, notes = [], []
        for (g, note), meta, more in zip(converted, metas, start_notes):
            notes.append(list(note) + list(more))
            if meta.labels is not None:
                labels.append(meta.labels)
            else:
                labels.append(recover_labels(g, head_names, n, self.label_strategy))
                notes[-1].append(f"labels recovered from the gradient ({self.label_strategy})")
        return torch.stack(labels).to(self.device), notes

    def _restarts(self, per_group, match: MatchTerms, y: torch.Tensor, shape: tuple, lo: torch.Tensor,
                  hi: torch.Tensor, starts: Optional[list]) -> dict:
        """Every restart; per update the best one by the data term: {x, score, trial, traces,
        trial_info (the converging restarts' per-update info, else empty)}."""
        K = shape[0]
        best_x, best_score, traces, trial_info = None, None, [], []
        for trial in range(self.restarts):
            if self.converge_window > 0:
                solved = (torch.tensor([bool(i["solved"]) for i in trial_info[0]]) if trial_info else None)
                x, trace, failed, info = self._run_trial_converging(per_group, match, y, shape, lo, hi, trial,
                                                                    starts if trial == 0 else None, solved,
                                                                    best_score)
                trial_info.append(info)
            else:
                x, trace, failed = self._run_trial(per_group, match, y, shape, lo, hi, trial)
            with torch.no_grad():
                score = self._objective(per_group, match, y, x, lo, with_prior=False)[0].detach()
            score = torch.where(torch.isfinite(score) & ~failed, score, torch.full_like(score, float("inf")))
            if best_x is None:
                best_x, best_score = x, score
                best_trial = torch.zeros(K, dtype=torch.long)
            else:
                better = score < best_score
                best_x = torch.where(better[:, None, None, None, None], x, best_x)
                best_score = torch.minimum(score, best_score)
                best_trial = torch.where(better.cpu(), torch.full_like(best_trial, trial), best_trial)
            traces.append(trace)
        return dict(x=best_x, score=best_score, trial=best_trial, traces=traces, trial_info=trial_info)

    def _results(self, metas: Sequence[AttackMetadata], best: dict, y: torch.Tensor, matched: int,
                 notes: list[list[str]], elapsed: float) -> list[AttackResult]:
        """One result per update from the restarts' best (:meth:`_restarts`)."""
        K, n, size = len(metas), metas[0].num_images, metas[0].image_size
        best_score, traces, trial_info = best["score"], best["traces"], best["trial_info"]
        images = metas[0].denormalize(best["x"].reshape(K * n, *size).double()).reshape(K, n, *size)
        results = []
        for k, meta in enumerate(metas):
            tr = torch.stack([t[:, k] for t in traces]).cpu()  # [restarts, iterations]
            ok = bool(torch.isfinite(best_score[k]))
            fin = tr[torch.isfinite(tr)]
            stats = dict(objective=float(best_score[k]), objective_first=float(tr[0, 0]),
                         objective_min=float(fin.min()) if fin.numel() else float("nan"),
                         iterations=self.iterations * self.restarts, time_s=elapsed / (K * n),
                         attack=self.name, matched_parameters=matched, failed=not ok,
                         notes=notes[k])
            if trial_info:  # converging trials: how each ended and the chosen one's loss curve
                chosen = int(best["trial"][k])
                stats.update(trial_info[chosen][k], chosen_trial=chosen,
                             iterations=sum(int(t[k]["iterations_run"]) for t in trial_info),
                             trials=[{key: t[k][key] for key in ("start", "iterations_run", "converged", "abandoned")}
                                     for t in trial_info])
            if not ok:
                stats["reason"] = "non-finite objective"
            results.append(AttackResult(images[k], [dict(stats) for _ in range(n)], failed=not ok,
                                        reason=None if ok else "non-finite objective", labels=y[k].cpu()))
        return results

    def _prepare_groups(self, model: nn.Module, updates: Sequence[Update], metas: Sequence[AttackMetadata],
                        converted: list) -> tuple[Optional[torch.Tensor], Optional[list], list[list[str]]]:
        """Per update, before matching: (E_unk masks [K, N] bool or None, starts (a list of
        (name, [n, C, H, W] normalised candidate) or None per update) or None, notes per update).
        May replace ``converted[k]``'s gradients (e.g. with a known extra loss term removed)."""
        return None, None, [[] for _ in updates]

    def _run_trial_converging(self, per_group, match: MatchTerms, y: torch.Tensor, shape: tuple, lo: torch.Tensor,
                              hi: torch.Tensor, trial: int, starts: Optional[list],
                              solved: Optional[torch.Tensor] = None, incumbent: Optional[torch.Tensor] = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[dict]]:
        """One restart run to convergence (``converge_window`` > 0), each update on its own
        (:class:`attacks.optimization.converging.ConvergingTrial`; ``incumbent`` [K]: the data term
        of the best earlier restart per update, ``solved`` [K]: updates that take no steps).
        Returns (best candidate, objective trace [iterations, K] (NaN after a stop), failed [K],
        per update {start, iterations_run, converged, abandoned, objective_curve})."""
        return ConvergingTrial(self, per_group, match, y, shape, lo, hi, trial, starts, solved, incumbent).run()

    def _pick_starts(self, per_group, match: MatchTerms, y: torch.Tensor, draw: torch.Tensor, lo: torch.Tensor,
                     hi: torch.Tensor, starts: list) -> list:
        """Per update, the candidate start (name, x) whose gradient matches the update best (the
        cosine term, what the attacker can evaluate), or None where it has none. ``starts[k]``: a
        list of candidates (possibly empty)."""
        K, most = len(starts), max((len(c) for c in starts), default=0)
        best: list = [None] * K
        best_cos = [float("inf")] * K
        for c in range(most):
            x = torch.stack([starts[k][c][1].to(draw.dtype) if c < len(starts[k]) else draw for k in range(K)])
            x = torch.max(torch.min(x.to(self.device), hi.unsqueeze(0)), lo.unsqueeze(0))
            with torch.no_grad():
                cos = self._objective(per_group, match, y, x, lo, with_prior=False)[1].detach().cpu()
            for k in range(K):
                if c < len(starts[k]) and math.isfinite(float(cos[k])) and float(cos[k]) < best_cos[k]:
                    best[k], best_cos[k] = starts[k][c], float(cos[k])
        return best

    def _per_group_gradients(self, work: nn.Module, names: list[str], masks: Optional[torch.Tensor] = None):
        """f(x [k, n, C, H, W], y [k, n], sel=None) -> {name: [k, ...]}: each group's own model
        gradient; ``sel``: the indices of the k groups among the K (all K when None).

        ``masks`` [K, N] bool: each group's own E_unk positions (an MJP-aware forward per update);
        None: the shared ``unk_mask`` (or the plain forward)."""
        params = {nm: p.detach() for nm, p in work.named_parameters() if nm in names}
        frozen = {nm: p.detach() for nm, p in work.named_parameters() if nm not in params}
        buffers = dict(work.named_buffers())
        if masks is not None:
            group_masks = masks.to(self.device)

            def masked_loss(p: dict, xg: torch.Tensor, yg: torch.Tensor, mg: torch.Tensor) -> torch.Tensor:
                kwargs = {"unk_mask": mg.reshape(1, -1).expand(xg.shape[0], -1)}
                return F.cross_entropy(functional_call(work, ({**p, **frozen}, buffers), (xg,), kwargs), yg)

            masked_fn = vmap(grad(masked_loss), in_dims=(None, 0, 0, 0))

            # the running groups' masks, picked once per set and kept (a few K x N bools): a CUDA graph
            # recorded on one set reads its masks at their address (attacks.optimization.graph_step)
            picked: dict[tuple, torch.Tensor] = {}

            def masked(x: torch.Tensor, y: torch.Tensor, sel: Optional[Sequence[int]] = None) -> dict:
                if sel is None:
                    return masked_fn(params, x, y, group_masks)
                key = tuple(int(i) for i in sel)
                if key not in picked:
                    picked[key] = group_masks[list(key)]
                return masked_fn(params, x, y, picked[key])

            return masked
        mask = None if self.unk_mask is None else self.unk_mask.to(self.device)

        def loss(p: dict, xg: torch.Tensor, yg: torch.Tensor) -> torch.Tensor:
            kwargs = {} if mask is None else {"unk_mask": mask.expand(xg.shape[0], -1)}
            return F.cross_entropy(functional_call(work, ({**p, **frozen}, buffers), (xg,), kwargs), yg)

        grad_fn = vmap(grad(loss), in_dims=(None, 0, 0))
        return lambda x, y, sel=None: grad_fn(params, x, y)

    def _objective(self, per_group, match: MatchTerms, y: torch.Tensor, x: torch.Tensor, lo: torch.Tensor,
                   with_prior: bool = True, sel: Optional[Sequence[int]] = None,
                   plain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(objective [k], data term [k]) for candidates x [k, n, C, H, W] of the groups ``sel``
        (all when None); ``plain``: the data term is the plain cosine term (:meth:`MatchTerms.cosine`)."""
        match = match.select(sel)
        return self._terms(lambda xs, ys: per_group(xs, ys, sel), match, y if sel is None else y[list(sel)], x,
                           with_prior, plain)

    def _terms(self, grads_of: Callable[[torch.Tensor, torch.Tensor], dict], match: MatchTerms, y: torch.Tensor,
               x: torch.Tensor, with_prior: bool = True, plain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_objective` on groups already selected: ``grads_of(x, y)`` their model gradients,
        ``match`` and ``y`` theirs (no indexing here, so a CUDA graph can record it)."""
        g = grads_of(x, y)
        data = match.cosine(g) if plain else match.data(g)
        obj = data
        if with_prior and self.pe_weight > 0:
            gp, tp = g["pos_embed"].flatten(1), match.targets["pos_embed"].flatten(1)
            obj = obj + self.pe_weight * (1 - F.cosine_similarity(gp, tp, dim=1, eps=1e-30))
        if with_prior and self.tv > 0:
            obj = obj + self.tv * total_variation(x, tv_kernel(x.shape[2], x.dtype, x.device))
        return obj, data

    def _run_trial(self, per_group, match: MatchTerms, y: torch.Tensor, shape: tuple, lo: torch.Tensor,
                   hi: torch.Tensor, trial: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One restart: (best candidate [K, n, C, H, W], objective trace [iterations, K], failed [K])."""
        K = shape[0]
        gen = torch.Generator(device="cpu")
        gen.manual_seed(self.seed + trial if self.seed is not None else torch.seed())
        # Every update starts from the same seeded draw, so an update's reconstruction does not
        # depend on which other updates share the batched call (one-at-a-time gives the same).
        x = torch.randn(shape[1:], generator=gen).expand(shape).contiguous().to(self.device).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=self.lr)
        its = self.iterations
        milestones = [its // 2.667, its // 1.6, its // 1.142] if self.scheduler == "step-lr" else []
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.1)
        best = x.detach().clone()
        best_val = torch.full((K,), float("inf"), device=self.device)
        failed = torch.zeros(K, dtype=torch.bool, device=self.device)
        trace = torch.full((its, K), float("nan"))
        lo5, hi5 = lo.unsqueeze(0), hi.unsqueeze(0)
        for it in tqdm(range(its), disable=None if self.progress else True, desc=self.name, leave=False):
            report(self.name, it, its, f"restart {trial + 1} of {self.restarts}")
            opt.zero_grad(set_to_none=False)
            obj, _ = self._objective(per_group, match, y, x, lo)
            finite = torch.isfinite(obj.detach())
            failed |= ~finite
            # Failed groups are frozen: their (non-finite) graph stays inside their own slice.
            torch.where(finite, obj, torch.zeros_like(obj)).sum().backward(inputs=[x])
            with torch.no_grad():
                x.grad[failed] = 0
                if self.signed == "hard":
                    x.grad.sign_()
            opt.step()
            sched.step()
            with torch.no_grad():
                x.data = torch.max(torch.min(x, hi5), lo5)
                val = obj.detach()
                improved = finite & (val < best_val)
                best = torch.where(improved[:, None, None, None, None], x.detach(), best)
                best_val = torch.where(improved, val, best_val)
                trace[it] = val.cpu()
            if bool(failed.all()):
                _logger.warning("%s: every objective is non-finite at iteration %d; stopping", self.name, it)
                break
        return best, trace, failed


@register_attack("invertinggradients_batched")
class InvertingGradientsBatched(GradientMatching):
    """Inverting Gradients (Geiping et al.) with breaching's settings, batched over updates."""

    threat = Threat(batch="any", labels="given, or recovered", architecture="any", precision="any (never exact: local optimisation)")

    name = "invertinggradients_batched"


@register_attack("april_optimization")
class AprilOptimization(GradientMatching):
    """APRIL's optimisation attack: gradient matching (cosine) plus the PE-gradient cosine term.

    Defaults: pe_weight 1.0, Adam lr 0.1 (not signed), no schedule, TV 0.2, 200 iterations.
    """

    threat = Threat(batch="any", labels="given, or recovered", architecture="any ViT with a learned position embedding", precision="any (never exact: local optimisation)")

    name = "april_optimization"

    class Options(GradientMatching.Options):
        pe_weight: Float = option(1.0, gt=0.0)  # weight of the position-embedding gradient term
        signed: Optional[Literal["hard"]] = None
        scheduler: Optional[Literal["step-lr"]] = None

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.pe_weight = self.options.pe_weight

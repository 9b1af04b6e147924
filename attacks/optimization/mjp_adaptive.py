"""An attacker who knows MJP (Kerckhoffs): model, E_unk and the algorithm, not the mask or permutation.

docs/design.md, "Attacking MJP with knowledge of MJP". For one batch-1 update of an MJP model fed x~
(E_unk at the shuffled positions S):

1. Detection: the rows of dL/dP at S are exactly zero (their gradient went to dL/dE_unk), so S leaks.
   A DAL term (``lambda * dL_dal/dP``, data-independent given the head and S) is zero at S as well for
   the ``ln``/``nln`` heads; its weight is read off the DAL head's own gradient and the term is
   subtracted before the rows are used.
2. Reduction (design-A block 0, Z [T, D] feeds qkv directly): M = W_qkv^T G_W = sum_t g_t z_t^T with
   the rows g_t of dL/dZ known for the prefix and unshuffled tokens (G_U). With Q a basis of the
   orthogonal complement of span(G_U), rowspace(Q^T M) = span{z_s : s in S} (rank |S|); with Pi its
   projector, Z_U (I - Pi) = (G_U^T)^+ M (I - Pi). Each unshuffled patch is then known up to the null
   space of (I - Pi) W_e, which is the span of differences of the shuffled patches (|S| - 1 dims), and
   the shuffled patches lie on their affine hull x_bar + span(N). Parameters: b_u (unshuffled) and
   a_s (shuffled), each in R^k, k = dim N.
   Every first-layer observable is invariant under Z -> (I + C) Z with C nonzero only in the
   columns of S and zero row sums over S: (b, a) is exactly that orbit, N(|S| - 1) directions.
3. Refinement (``refine``): a quadratic smoothness prior over the unshuffled image solved in closed
   form, refined under a total-variation prior (``prior``); then (``span``, the default) the deeper
   layers fix (b, a): the weight gradient of every linear layer (block 0's proj, fc1, fc2, every
   later block's qkv, proj, fc1, fc2, the head) spans that layer's inputs (dL/dW = sum_t g_t a_t^T),
   so the candidate's inputs must lie in those spans, a residual that is zero at the client's
   input and needs neither the label nor the loss (:func:`input_spans`, :class:`SpanResidual`);
   L-BFGS in float64 from several starts of the shuffled patches, then (``lm_jacobians``)
   Levenberg-Marquardt on the residual's vector form with its exact Jacobian (:mod:`attacks.solvers.lm`:
   the Jacobian has full column rank at the client's input on trained models but is ill-conditioned,
   where L-BFGS stalls and Gauss-Newton converges quadratically from close by). ``match`` instead matches the
   whole gradient over (b, a) with the attacker's forward using ``unk_mask = S`` (L-BFGS,
   alternating blocks: shuffled with unshuffled fixed, then both). How far the spans resolve the
   orbit depends on how sharp attention is: on fresh weights the tokens after block 0 barely
   differ and little is gained
   (tests/test_mjp_adaptive.py::test_span_refinement_improves_the_unshuffled_region_with_sharp_attention).
4. ``unshuffle=True``: solve the jigsaw (:mod:`attacks.solvers.jigsaw`) and return ``result.unshuffled``.

The permutation of the shuffled patches among S is invisible in every gradient (all of S carries the
same E_unk and the ViT is permutation-equivariant over tokens with equal embeddings), so
``result.images`` places the shuffled patches at S in the attack's own order; score them as a set.
Models that are not design A get MJP-aware Inverting Gradients (``april_optimization`` with the
detected ``unk_mask``) from the same detection.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Literal, Optional

import torch
import torch.nn as nn

from fedmjp.config import Float, Int, option
from fedmjp.devices import resolve_device

from ..closed_form.first_layer import check_conditions
from ..closed_form.first_layer import gradient_of_Z, is_design_a, unwrap_vit
from ..api.base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, Update, update_to_gradients
from ..api.progress import report
from ..api.registry import Threat, register_attack
from ..solvers.jigsaw import unshuffle_image
from ..closed_form.labels import recover_labels
from ..closed_form.mjp_maths import (Reduction, assemble, draw_shuffled, lbfgs, mjp_reduction, smoothness_prior_solve,
                                     tv_prior_refine)
from ..closed_form.mjp_update import read_mjp_update
from .mjp_match import match_reduced, matching_objective
from ..solvers.spans import InputSpan, SpanResidual, forward_cost, input_spans

_logger = logging.getLogger(__name__)

REFINE_MODES = ("none", "prior", "span", "match")
#: L-BFGS iterations of ``refine="span"`` by default on the 32 px depth-4 CIFAR model (SPAN_BUDGET scales it).
SPAN_ITERATIONS = 1500
#: Forward multiply-adds times iterations the default spends: SPAN_ITERATIONS on the 32 px depth-4
#: CIFAR model (~1.2e8 multiply-adds per forward); a larger model gets proportionally fewer.
SPAN_BUDGET = 1.9e11
#: Below this many affordable iterations the default skips the span fit (with a note) instead of
#: running one too short to help (DeiT-S at 224 px: ~40).
SPAN_MIN_ITERATIONS = 100
#: Levenberg-Marquardt Jacobians of the span fit's final stage by default (:mod:`attacks.solvers.lm`):
#: off. LM converges from close to x~, but the attack's own starts are farther away, where it gains
#: little for its CPU time (docs/results/attacks.md). ``lm_jacobians: 4`` runs it.
#: tests/test_span_fit.py pins the default's use.
LM_JACOBIANS = 0
#: Forward multiply-adds one default Jacobian may spend (unknowns x forward cost): the 32 px depth-4
#: model's 1,024 unknowns x ~1.2e8 with room; DeiT-S at 224 px is ~1e5 times over it.
LM_BUDGET = 5e11
#: Bytes of the dense float64 Jacobian the default allows (~1.5 GB at 32 px, depth 4, |S| = 17);
#: above it ``lm_solver: auto`` runs the matrix-free solver.
LM_MEMORY = 3e9
#: ``lm_solver`` values: ``dense`` (exact Jacobian, Cholesky), ``matrix_free`` (sketch-preconditioned
#: CG on Jacobian products, :func:`attacks.solvers.lm.matrix_free_lm`), ``auto`` (dense where it fits
#: :data:`LM_MEMORY`).
LM_SOLVERS = ("auto", "dense", "matrix_free")


# ------------------------------------------------------------------------------------ attack
@register_attack("mjp_adaptive")
class MJPAdaptive(Attack):
    """MJP-aware attack (module docstring).

    Args:
        refine: ``none`` (minimum norm), ``prior`` (smoothness prior, closed form), ``span`` (prior,
            then L-BFGS on the deeper layers' input spans, :class:`SpanResidual`; the default) or
            ``match`` (prior, then L-BFGS gradient matching over the reduced parameters).
        iterations: L-BFGS iterations per matching round (``match``).
        span_iterations: L-BFGS iterations on the span residual from the best start (``span``);
            None: :data:`SPAN_ITERATIONS` on the 32 px CIFAR model, proportionally fewer on larger
            models (:data:`SPAN_BUDGET`), none where fewer than :data:`SPAN_MIN_ITERATIONS` fit.
        starts: starting points of the shuffled patches tried (``span``): the prior's draw and
            ``starts - 1`` more, each run ``probe_iterations`` (batched), the lowest residual kept.
        probe_iterations: L-BFGS iterations of every start before one is kept.
        tv_prior: refine the quadratic prior's unshuffled coefficients under a total-variation prior.
        lm_jacobians: the final stage of ``span``: Levenberg-Marquardt on the span residual's vector
            form (:mod:`attacks.solvers.lm`), at most this many Gauss-Newton iterations (0: off). None:
            with the default span fit (``span_iterations`` None), up to :data:`LM_JACOBIANS` where the
            dense Jacobian fits :data:`LM_BUDGET` and :data:`LM_MEMORY` (the 32 px models: ~50 CPU-s
            per Jacobian at depth 4), else off with a note.
        lm_solver: how each of those iterations solves for its step: ``dense`` (the exact Jacobian,
            Cholesky), ``matrix_free`` (conjugate gradients on Jacobian-vector products,
            preconditioned by a row sketch: :func:`attacks.solvers.lm.matrix_free_lm`; the route at
            224 px, where the dense Jacobian would take terabytes) or ``auto`` (dense where it fits
            :data:`LM_MEMORY`, else matrix-free).
        joint_prior: the prior also inpaints the shuffled patches inside their affine hull (else
            they start as random points of the hull).
        rounds: alternating rounds (shuffled block, then all parameters) of ``match``.
        prior_weight: weight of the smoothness prior inside gradient matching (relative units).
        unshuffle: solve the jigsaw and return ``result.unshuffled``.
        rcond: None: the reduction's null space has the dimension the theory gives; a float: a
            relative singular-value cut-off instead (see :func:`mjp_reduction`).
        dal_weight: the client's DAL weight if known; None estimates it from the DAL head's gradient.
        fallback_iterations: iterations of the MJP-aware ``april_optimization`` on non-design-A models.
        seed: seed of the shuffled patches' initialisation.
        reuse: take the x~ estimate from the update's estimate store (``meta.estimates``, an
            :class:`attacks.api.estimates.EstimateStore` the caller passes with one update) where an
            earlier call with the same options put it, and put it there otherwise (e.g.
            ``ig_closed_start`` starts from the estimate this attack made for the same update in a
            benchmark round); False, or no store: always compute it.
        device: where the priors, the span fit, its Levenberg-Marquardt stage and ``match`` run
            (float64): ``cpu``, ``cuda``, ``cuda:N`` or ``auto``; the benchmark passes the run's
            ``--device``. The reduction (a few SVDs of the first layer's gradients) and the jigsaw
            stay on the CPU. Not part of the estimate's key: the devices compute the same estimate
            up to float64 rounding.
        min_device_cost: below this many multiply-adds per forward (:func:`attacks.solvers.spans.forward_cost`)
            the solves stay on the CPU, with a note: a small model's many small solves are slower
            on a GPU than on the CPU (docs/results/attacks.md); pinned by
            tests/test_cuda.py::test_mjp_adaptive_keeps_small_models_on_the_cpu_with_a_note.
            0: always on ``device``.
    """

    threat = Threat(batch="1 per update", labels="not needed (the optimisation fallback: given or recovered)", architecture="design-A block 0 for the MJP reduction, else optimisation", precision="float64 clients for the reduction")

    name = "mjp_adaptive"

    class Options(AttackOptions):
        refine: Literal[REFINE_MODES] = "span"
        iterations: Int = option(30, ge=0)
        rounds: Int = option(1, ge=0)
        prior_weight: Float = 1e-3
        span_iterations: Optional[Int] = option(None, ge=0)
        starts: Int = option(4, ge=1)
        probe_iterations: Int = option(40, ge=0)
        unshuffle: bool = True
        rcond: Optional[Float] = None
        dal_weight: Optional[Float] = None
        joint_prior: bool = False
        tv_prior: bool = True
        lm_jacobians: Optional[Int] = option(None, ge=0)
        lm_solver: Literal[LM_SOLVERS] = "auto"
        fallback_iterations: Int = 200
        seed: Int = 0
        reuse: bool = True
        device: str = "cpu"
        min_device_cost: Float = option(1e9, ge=0.0)

    def __init__(self, **options: Any) -> None:
        o = self._parse_options(options)
        self.reuse, self.span_iterations = o.reuse, o.span_iterations
        self.starts, self.probe_iterations = o.starts, o.probe_iterations
        self.refine, self.iterations, self.rounds = o.refine, o.iterations, o.rounds
        self.prior_weight, self.unshuffle, self.rcond = o.prior_weight, o.unshuffle, o.rcond
        self.dal_weight, self.fallback_iterations, self.seed = o.dal_weight, o.fallback_iterations, o.seed
        self.joint_prior, self.tv_prior = o.joint_prior, o.tv_prior
        self.lm_jacobians, self.lm_solver = o.lm_jacobians, o.lm_solver
        self.device, self.min_device_cost = resolve_device(o.device), o.min_device_cost
        self.shares_estimates = self.reuse  # puts its x~ in the update's store (ig_closed_start reads it)

    # ------------------------------------------------------------------------------- pieces
    def read_update(self, vit: nn.Module, grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict, dict]:
        """(S [N] bool, gradients with the DAL term removed, stats) from one update's gradients
        (:func:`attacks.closed_form.mjp_update.read_mjp_update` with this attack's ``dal_weight``)."""
        return read_mjp_update(vit, grads, self.dal_weight)

    # ------------------------------------------------------------------------------- attack
    def _estimate_options(self) -> dict:
        """The options the x~ estimate depends on, its key in the update's estimate store (not
        ``unshuffle``, which acts after it, nor ``device``: the devices compute the same estimate up
        to float64 rounding)."""
        return dict(refine=self.refine, iterations=self.iterations, rounds=self.rounds,
                    prior_weight=self.prior_weight, span_iterations=self.span_iterations, starts=self.starts,
                    probe_iterations=self.probe_iterations, rcond=self.rcond, dal_weight=self.dal_weight,
                    joint_prior=self.joint_prior, tv_prior=self.tv_prior, lm_jacobians=self.lm_jacobians,
                    lm_solver=self.lm_solver,
                    fallback_iterations=self.fallback_iterations, seed=self.seed,
                    budget=(SPAN_ITERATIONS, SPAN_BUDGET, SPAN_MIN_ITERATIONS, LM_JACOBIANS, LM_BUDGET, LM_MEMORY))  # the default's iterations

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        t0, c0 = time.perf_counter(), time.process_time()
        if meta.num_images != 1:
            raise AttackFailure(f"mjp_adaptive needs batch size 1 per update, got num_images={meta.num_images}")
        vit = unwrap_vit(model)
        if getattr(vit, "unk_embed", None) is None and hasattr(vit, "pos_embed"):
            return self._not_mjp(model, update, meta)
        store = meta.estimates if self.reuse else None
        key = self._estimate_options()
        cached = store.get(self.name, key) if store is not None else None  # a copy
        labels: Optional[torch.Tensor] = None  # the labels matched against (refine="match" on design A)
        if cached is not None:
            x_tilde, S, stats, notes, labels = cached
            notes.append("x~ estimate reused: computed before for the same model, update and options")
        else:
            grads, notes = update_to_gradients(update, meta)
            S, grads, stats = self.read_update(vit, grads)
            if not bool(S.any()):
                notes.append("no shuffled position detected: plain closed form / matching")
            if is_design_a(vit.blocks[0]):
                x_tilde, more, labels = self._design_a(vit, grads, S, meta)
            else:
                x_tilde, more = self._fallback(model, grads, S, meta)
                notes.append("block 0 is not design A: MJP-aware april_optimization with the detected mask")
            stats.update(more)
            if "device_note" in stats:
                notes.append(stats["device_note"])
            stats["estimate_cpu_s"] = time.process_time() - c0
            if store is not None:
                store.put(self.name, key, (x_tilde, S, stats, notes, labels))  # kept as a copy
        design_a = is_design_a(vit.blocks[0])
        p = int(vit.patch_embed.patch_size[0])
        images = meta.denormalize(x_tilde)
        unshuffled = None
        if self.unshuffle:
            unshuffled, jinfo = unshuffle_image(images, S, p)  # the attack reconstructs one image
            stats.update(jigsaw_cost=jinfo["cost_final"], jigsaw_swaps=jinfo["swaps"])
        stats.update(time_s=time.perf_counter() - t0, failed=False, notes=notes, attack=self.name,
                     design_a=design_a)
        stats.setdefault("objective", float("nan"))
        stats.setdefault("iterations", 0)
        return AttackResult(images, [stats], labels=labels, unshuffled=unshuffled)

    def _labels(self, vit: nn.Module, grads: dict, meta: AttackMetadata) -> torch.Tensor:
        if meta.labels is not None:
            return meta.labels
        head = vit.get_classifier()
        ids = {id(q) for q in head.parameters()}
        names = [n for n, q in vit.named_parameters() if id(q) in ids and n in grads]
        return recover_labels(grads, names, 1, "bias")

    def _design_a(self, vit: nn.Module, grads: dict, S: torch.Tensor, meta: AttackMetadata
                  ) -> tuple[torch.Tensor, dict, Optional[torch.Tensor]]:
        """(x~ [1, C, H, W] model input, stats, labels): the labels matched against (granted or
        recovered from the head's gradient) where ``refine="match"`` ran, else None."""
        info = check_conditions(vit)
        if "blocks.0.attn.qkv.weight" not in grads:
            raise AttackFailure("update lacks 'blocks.0.attn.qkv.weight'")
        G_Z = gradient_of_Z(vit, grads, info)
        labels: Optional[torch.Tensor] = None
        dev, device_note = self.device_for(vit, S)
        red = mjp_reduction(vit, G_Z, grads["blocks.0.attn.qkv.weight"], S, self.rcond).to(dev)
        stats = dict(red.stats)
        if device_note:
            stats["device_note"] = device_note
        C, p = info["channels"], info["patch_size"]
        grid = tuple(int(g) for g in vit.patch_embed.grid_size)
        nU, k = red.x_unshuffled.shape[0], red.null_basis.shape[1]
        nS = int(S.sum())
        std = meta.std.to(torch.float64)
        b = torch.zeros(nU, k, dtype=torch.float64, device=dev)
        gen = torch.Generator().manual_seed(self.seed)  # draws on the CPU: the same on every device
        # Break the permutation symmetry: distinct random points of the affine hull. Every draw is
        # made in pixel space or over the unshuffled patches and mapped into the null space, never
        # per coordinate of null_basis: inside the null space the singular values are rounding
        # noise, so the SVD's basis there is arbitrary (it rotates between CPUs and thread counts),
        # and a per-coordinate draw would give another image for the same seed and update.
        a = 0.1 * torch.randn(nS, red.null_basis.shape[0], generator=gen, dtype=torch.float64).to(dev) @ red.null_basis
        if k == 0:
            stats.setdefault("note", "no null directions: the reduction leaves nothing to refine")
        elif self.refine in ("prior", "span", "match"):
            b, a = smoothness_prior_solve(red, grid, C, p, std, joint=self.joint_prior)
            if self.tv_prior:
                b = tv_prior_refine(red, b, grid, C, p, std)
            if not self.joint_prior:
                a = draw_shuffled(red, b, nS, gen)
        if self.refine == "span" and nS > 0 and k > 0:
            b, a, sstats = self._span(vit, grads, red, b, a, grid, C, p, gen)
            stats.update(sstats)
        if self.refine == "match" and self.iterations > 0 and nS > 0 and k > 0:
            labels = self._labels(vit, grads, meta)
            b, a, mstats = self._match(vit, grads, red, b, a, labels, grid, C, p, std)
            stats.update(mstats)
        return assemble(red, b, a, grid, C, p).cpu(), stats, labels

    def device_for(self, vit: nn.Module, S: torch.Tensor) -> tuple[torch.device, Optional[str]]:
        """Where this update's solves run: ``device``, except on models whose forward costs less
        than ``min_device_cost`` multiply-adds, whose many small solves are faster on the CPU."""
        if self.device.type == "cpu":
            return self.device, None
        T = S.numel() + int(getattr(vit, "num_prefix_tokens", 1))
        cost = forward_cost(vit, T)
        if cost < self.min_device_cost:
            return torch.device("cpu"), (f"solved on the CPU, not {self.device}: a forward of this model costs "
                                         f"{cost:.2g} multiply-adds < min_device_cost {self.min_device_cost:.2g}")
        return self.device, None

    def _span(self, vit: nn.Module, grads: dict, red: Reduction, b0: torch.Tensor, a0: torch.Tensor, grid,
              C: int, p: int, gen: torch.Generator):
        """Fit the reduced parameters (b, a) to the deeper layers' input spans (:class:`SpanResidual`):
        ``starts`` starting points of the shuffled patches (the given one and fresh draws of the same
        law) run ``probe_iterations`` of L-BFGS side by side, the one with the lowest residual runs
        ``span_iterations`` more. No label and no loss: the spans hold for any loss."""
        T = red.shuffled.numel() + int(getattr(vit, "num_prefix_tokens", 1))
        iterations = self.span_iterations
        if iterations is None:
            iterations = min(SPAN_ITERATIONS, int(SPAN_BUDGET / forward_cost(vit, T)))
            if iterations < SPAN_MIN_ITERATIONS:
                return b0, a0, dict(span_note=f"span fit skipped: only {iterations} iterations fit the default "
                                              "budget for this model; set span_iterations to run it")
        spans = input_spans(vit, grads, T)
        if not spans:
            return b0, a0, dict(span_note="no layer gives a usable input span")
        residual = SpanResidual(vit, spans, red.shuffled, red.device)
        nS = a0.shape[0]
        starts = [a0] + [draw_shuffled(red, b0, nS, gen) for _ in range(self.starts - 1)]
        b = b0.expand(len(starts), -1, -1).clone()
        a = torch.stack(starts)

        evaluations = itertools.count(1)  # the progress reports' count of residual evaluations

        def objective(vb: torch.Tensor, va: torch.Tensor) -> torch.Tensor:
            report(self.name, next(evaluations), None, "span fit: L-BFGS evaluations")
            return residual.value(assemble(red, vb, va, grid, C, p))

        with torch.no_grad():
            first = objective(b, a)
        iters = 0
        if self.probe_iterations and len(starts) > 1:
            b, a, n = lbfgs(lambda vb, va: objective(vb, va).sum(), b, a, self.probe_iterations)
            iters += n
        with torch.no_grad():
            probe = objective(b, a)
        best = int(torch.argmin(probe))
        b, a = b[best:best + 1], a[best:best + 1]
        if iterations:
            b, a, n = lbfgs(lambda vb, va: objective(vb, va).sum(), b, a, iterations)
            iters += n
        out: dict[str, Any] = {}
        b, a = b[0], a[0]
        lm = self.planned_lm_jacobians(vit, T, red, residual.spans)
        if isinstance(lm, str):
            out["lm_note"] = lm
        elif lm > 0:
            from .span_fit import span_lm

            with torch.no_grad():
                before = float(objective(b[None], a[None])[0])
            solver = self.planned_lm_solver(T, red, residual.spans)
            report(self.name, 0, lm, f"span fit: Levenberg-Marquardt ({solver}), Jacobians")
            b, a, lm_out = span_lm(residual, red, b, a, grid, C, p, max_jacobians=lm, solver=solver)
            out.update(lm_objective_first=before, lm_jacobians=lm_out.jacobians, lm_evaluations=lm_out.evaluations,
                       lm_solver=solver)
            if solver == "matrix_free":
                out.update(lm_cg_iterations=sum(lm_out.cg_iterations), lm_sketch_rows=lm_out.sketch_rows)
        with torch.no_grad():
            per_layer = residual.per_layer(assemble(red, b, a, grid, C, p))[0]
        last = float(per_layer.mean())
        _logger.debug("mjp_adaptive span residual: %.3e -> %.3e in %d iterations", float(first.min()), last, iters)
        out.update(objective=last, objective_first=float(first[0]), iterations=iters,
                   span_layers=[sp.name for sp in spans], span_start=best,
                   span_start_objectives=[float(v) for v in probe],
                   span_worst_layer=spans[int(torch.argmax(per_layer))].name)
        return b, a, out

    @staticmethod
    def _lm_size(T: int, red: Reduction, spans: list[InputSpan]) -> tuple[int, int]:
        """(rows, unknowns) of the span residual's Jacobian."""
        k = red.null_basis.shape[1]
        unknowns = red.x_unshuffled.shape[0] * k + int(red.shuffled.sum()) * k
        rows = sum((T if sp.rows is None else sp.rows) * (sp.basis.shape[0] - sp.basis.shape[1]) for sp in spans)
        return rows, unknowns

    def planned_lm_solver(self, T: int, red: Reduction, spans: list[InputSpan]) -> str:
        """``dense`` or ``matrix_free``: the option, or under ``auto`` dense where its Jacobian fits :data:`LM_MEMORY`."""
        if self.lm_solver != "auto":
            return self.lm_solver
        rows, unknowns = self._lm_size(T, red, spans)
        return "dense" if 8.0 * rows * unknowns <= LM_MEMORY else "matrix_free"

    def planned_lm_jacobians(self, vit: nn.Module, T: int, red: Reduction, spans: list[InputSpan]) -> int | str:
        """Jacobians the final Levenberg-Marquardt stage gets, or a note saying why it is skipped."""
        if self.lm_jacobians is not None:
            return self.lm_jacobians
        if self.span_iterations is not None:  # a shortened (or lengthened) fit asked for by name
            return "Levenberg-Marquardt stage off: span_iterations is set; set lm_jacobians to run it"
        rows, unknowns = self._lm_size(T, red, spans)
        if unknowns * forward_cost(vit, T) > LM_BUDGET or 8.0 * rows * unknowns > LM_MEMORY:
            return (f"Levenberg-Marquardt stage skipped: a {rows} x {unknowns} Jacobian exceeds the default "
                    "budget; set lm_jacobians to run it")
        return LM_JACOBIANS

    def _match(self, vit: nn.Module, grads: dict, red: Reduction, b0: torch.Tensor, a0: torch.Tensor,
               labels: torch.Tensor, grid, C: int, p: int, std: torch.Tensor):
        """Gradient matching over (b, a) with the attacker's forward at unk_mask = S (float64,
        :mod:`attacks.optimization.mjp_match`)."""
        objective, matched = matching_objective(vit, grads, red, labels, grid, C, p, std, self.prior_weight)
        evaluations = itertools.count(1)  # the progress reports' count of objective evaluations

        def reported(vb: torch.Tensor, va: torch.Tensor) -> torch.Tensor:
            report(self.name, next(evaluations), None, "gradient matching: L-BFGS evaluations")
            return objective(vb, va)

        b, a, out = match_reduced(reported, b0, a0, self.rounds, self.iterations)
        return b, a, dict(out, matched_parameters=matched)

    def _not_mjp(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        """A model without E_unk: knowing MJP adds nothing, so the strongest attacker that knows the
        model is the plain one (APRIL's closed form on design A, else april_optimization). Keeps
        plain rows of a table comparable instead of failing them."""
        from ..closed_form.april import AprilAnalytic
        from .matching import AprilOptimization
        from ..closed_form.pe_closed_form import PEClosedForm

        vit = unwrap_vit(model)
        attack: Attack
        if is_design_a(vit.blocks[0]):
            attack = AprilAnalytic()
        else:
            # Any block 0: the patch-embedding closed form is exact where it applies (learned PE, batch
            # 1); the optimisation only where it refuses.
            attack = PEClosedForm()
            result = attack.reconstruct(model, update, meta)
            if not result.failed:
                for st in result.stats:
                    st.setdefault("notes", []).append(f"no E_unk in this model: plain {attack.name}")
                return result
            attack = AprilOptimization(iterations=self.fallback_iterations, seed=self.seed)
        result = attack.reconstruct(model, update, meta)
        for st in result.stats:
            st.setdefault("notes", []).append(f"no E_unk in this model: plain {attack.name}")
        return result

    def _fallback(self, model: nn.Module, grads: dict, S: torch.Tensor, meta: AttackMetadata):
        """Non-design-A models: MJP-aware APRIL optimisation with the detected mask (gradients with
        the DAL term removed, in the model's dtype)."""
        from .matching import AprilOptimization

        attack = AprilOptimization(iterations=self.fallback_iterations, seed=self.seed, unk_mask=S,
                                   device=str(self.device))
        # The gradients are already in gradient units with the DAL term removed: a plain FedSGD
        # update of one image, whatever the client sent (so no update type, learning rate or defence).
        plain = AttackMetadata(1, meta.image_size, meta.mean.double(), meta.std.double(), meta.labels)
        res = attack.reconstruct(model, grads, plain)
        if res.failed:
            raise AttackFailure(f"MJP-aware april_optimization failed: {res.reason}")
        x = meta.normalize(res.images.double())
        return x, dict(objective=res.stats[0].get("objective", float("nan")),
                             iterations=res.stats[0].get("iterations", 0))

"""The first layer's closed-form equations solved jointly as a regularised least squares.

The exact closed forms (attacks/closed_form/pe_closed_form.py, attacks/closed_form/april.py) each invert one linear system
and break under any perturbation of the update (APRIL's qkv system is badly conditioned).
This attack writes every first-layer equation of a batch-1 update as one noisy observation model,

    dL/dP (patch rows)  = G                                 (observed, noise s_P)
    dL/dW_e             = G^T X                             (noise s_We)
    dL/db_e             = G^T 1   (dL/dE_unk = G_S^T 1)     (noise s_be)
    W_qkv^T dL/dW_qkv   = G_Z^T Z(X),  Z = [prefix; X W_e^T + b_e] + P   (design A only; rows d of
                                                            noise s_qkv^2 ||W_qkv[:, d]||^2)

with X [N, C p^2] the patches (normalised input) and G [N, D] the patch rows of dL/dz, both
unknown, and finds the maximum a posteriori (X, G) under a Gaussian smoothness prior on the image
(squared horizontal and vertical pixel differences, weight lambda; ``prior="tv"``: a Laplace prior on
them, total variation, by reweighting the same squares) by alternating two linear least
squares: X given G (preconditioned conjugate gradients over the image) and G given X (one N x N
system per embedding dimension). Entries that are exactly zero are treated as missing (pruning;
MJP's zero rows at E_unk positions), so G is estimated where it was pruned from the other
equations. See docs/design.md ("The patch-embedding closed form").

Noise levels (Kerckhoffs: the server may know the defence's parameters): ``sigma`` and ``clip`` of
local DP give the noise std sigma * clip of every entry, ``quant_bits`` gives each tensor's
uniform rounding error max|t| / ((2^bits - 1) sqrt 3). Without them the common noise std is read
off the update's own redundancy, the bias residual dL/db_e - G^T 1 (zero on a clean update). The
prior's weight is chosen from the estimate itself (empirical Bayes: lambda = count / ||L X||^2,
times ``prior_scale``), so on a clean update the data dominate and the solution is exact.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.nn as nn
from pydantic import model_validator

from fedmjp.config import Float, Int, option
from fedmjp.devices import resolve_device

from .first_layer import check_conditions, gradient_of_Z, is_design_a, unwrap_vit
from ..api.base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, Update, update_to_gradients
from ..api.registry import Threat, register_attack
from .pe_closed_form import patches_to_images, pe_closed_form_system, pe_conditions
from .priors import load_patch_prior
from .robust_steps import (BiasEq, Equations, NoiseStd, PriorState, QkvEquation, Weights, cell_targets, chi2_per_entry,
                           g_step, mean_patch_start, mean_squares, redundancy_std, x_step)
from .robust_terms import _DT, NoiseModel, PatchPriorTerm, defence_noise, noise_floor, smooth_energy

_logger = logging.getLogger(__name__)
#: Weight of the Gaussian patch prior's Mahalanobis sum (times ``prior_scale``). Fixed, not chosen
#: from the estimate as the smoothness prior's is: the joint MAP over (X, G) needs a far stronger prior
#: than the learned covariance itself says. Pinned by
#: tests/test_april_robust.py::test_gaussian_prior_improves_on_smooth_after_8bit_quantisation.
_GAUSSIAN_WEIGHT = 10.0
#: Factor on the data terms' weights once they are dead-zone ones (quantisation cells): outside its
#: cell an entry's residual counts as with std step / sqrt(120) instead of the rounding error's
#: step / sqrt(12), steep walls. The same test runs with them (8-bit nearest rounding).
_CELL_WALL = 10


@register_attack("april_robust")
class AprilRobust(Attack):
    """Joint regularised least squares of the first layer's equations (see the module docstring).

    Args:
        sigma, clip: local DP's noise multiplier and clip, if the server knows them (noise std
            sigma * clip); ``clip`` alone is not used (clipping scales every equation alike).
        quant_bits: the quantisation's bits, if known.
        prune_keep: the kept share of a top-k pruning, if known: zeros are then missing entries even
            with ``prune_missing=False`` (recorded in the stats).
        known_defence: read the defence's parameters from ``metadata["defence"]`` (the clients'
            defence spec, Kerckhoffs) where the options above set none; False: the estimating attacker.
            Options set explicitly win over the metadata.
        prune_missing: treat exactly-zero entries as missing (True) or as observed zeros.
        prior: ``smooth`` (Gaussian on pixel differences), ``tv`` (Laplace on them, total variation,
            by iteratively reweighted least squares), ``gaussian`` (a Gaussian over every p x p patch
            learned from training images, ``prior_path``; refused when its patch size is not the
            model's) or ``auto`` (``gaussian`` where the patch size fits, else ``smooth``, noted).
        prior_path: the patch prior's .npz (None: the shipped CIFAR-10 one, p = 4, attacks/closed_form/priors).
        prior_scale: multiplier of the automatically chosen prior weight.
        prior_weight: a fixed prior weight lambda instead of the automatic choice.
        iterations: alternations of the X and G solves (stops early when X stops changing).
        use_qkv: ``auto`` (design-A block 0 and a qkv gradient without missing entries), ``never``.
        errors: ``joint`` (G is estimated with X: errors in variables) or ``weighted`` (observed
            entries of G kept, their noise carried into the weights of dL/dW_e = G^T X).
        reestimate_noise: without known defence parameters, re-estimate each equation group's
            noise std from its residual after every alternation (variance components).
        cg_tol, cg_maxiter: the conjugate gradients' relative tolerance and iteration cap.
        device: where the solves run (float64 throughout): ``cpu``, ``cuda``, ``cuda:N`` or ``auto``
            (CUDA when available); the benchmark passes the run's ``--device``.
    """

    threat = Threat(batch="1 per update", labels="not needed", architecture="any ViT with a learned position embedding (design A adds the qkv equations)", precision="any; the defence's parameters from the metadata or options")

    name = "april_robust"

    class Options(AttackOptions):
        sigma: Optional[Float] = option(None, ge=0.0)
        clip: Optional[Float] = option(None, gt=0.0)
        quant_bits: Optional[Int] = option(None, ge=1, le=32)
        prune_keep: Optional[Float] = option(None, gt=0.0, le=1.0)
        known_defence: bool = True
        prune_missing: bool = True
        prior_scale: Float = option(1.0, gt=0.0)
        prior_weight: Optional[Float] = option(None, ge=0.0)
        iterations: Int = option(10, ge=1)
        use_qkv: Literal["auto", "never"] = "auto"
        errors: Literal["joint", "weighted"] = "joint"
        prior: Literal["smooth", "tv", "gaussian", "auto"] = "smooth"
        prior_path: Optional[str] = None
        reestimate_noise: bool = True
        cg_tol: Float = 1e-12
        cg_maxiter: Int = 300
        device: str = "cpu"

        @model_validator(mode="after")
        def _sigma_has_clip(self) -> "AprilRobust.Options":
            if self.sigma and self.clip is None:
                raise ValueError("sigma needs the clip it multiplies (noise std = sigma * clip); set clip too")
            return self

    def __init__(self, **options: Any) -> None:
        o = self._parse_options(options)
        self.sigma, self.clip, self.quant_bits = o.sigma, o.clip, o.quant_bits
        self.prune_keep, self.known_defence = o.prune_keep, o.known_defence
        self.prune_missing, self.prior_scale, self.prior_weight = o.prune_missing, o.prior_scale, o.prior_weight
        self.iterations, self.use_qkv, self.errors = o.iterations, o.use_qkv, o.errors
        self.reestimate_noise, self.prior = o.reestimate_noise, o.prior
        # read now: a missing or malformed file is a ValueError (PriorError) naming it, before any solve
        self.patch_prior = load_patch_prior(o.prior_path) if o.prior in ("gaussian", "auto") else None
        self.cg_tol, self.cg_maxiter = o.cg_tol, o.cg_maxiter
        self.device = resolve_device(o.device)
        self.quant_cells = True

    # --------------------------------------------------------------------------------- noise model
    def _noise_model(self, meta: AttackMetadata) -> NoiseModel:
        """The noise model: the options where they set one, else the metadata's defence spec
        (``known_defence``), else unknown (estimated from the update)."""
        if self.sigma is not None or self.quant_bits is not None or self.prune_keep is not None:
            std = (self.sigma * self.clip if self.sigma else 0.0) * abs(meta.gradient_scale)
            parts = ([f"Gaussian std {std:.3g} per entry (sigma {self.sigma} x clip {self.clip})"] if self.sigma else []) \
                + ([f"quantize {self.quant_bits} bit, rounding error of the step"] if self.quant_bits else []) \
                + ([f"prune keep {self.prune_keep}: zeros are missing entries"] if self.prune_keep else [])
            noise = NoiseModel("options", "; ".join(parts) or "sigma = 0: no additive noise", std=std,
                               quant=None if self.quant_bits is None else (self.quant_bits, False),
                               prune_keep=self.prune_keep)
            if self.known_defence and meta.defence is not None:
                noise.notes.append(f"options set the noise model; metadata defence {meta.defence.label} not used")
            return noise
        if not self.known_defence:
            return NoiseModel(notes=["known_defence=False: the defence's parameters are not used"]
                              if meta.defence is not None else [])
        if meta.defence_error is not None:
            return NoiseModel(notes=[f"defence spec in metadata not understood ({meta.defence_error}): treated as "
                                     "unknown, noise estimated"])
        if meta.defence is None:
            return NoiseModel()
        return defence_noise(meta.defence, meta)

    def _prior_term(self, meta: AttackMetadata, info, notes: list[str]) -> Optional[PatchPriorTerm]:
        """The Gaussian patch prior's term for this model, None for the smoothness priors; a patch
        size the prior file was not made for is refused (``gaussian``) or falls back (``auto``)."""
        pp = self.patch_prior
        if pp is None:
            return None
        if pp.patch != info.patch_size or pp.channels != info.channels:
            msg = (f"the patch prior {pp.path} is for {pp.patch} x {pp.patch} x {pp.channels} patches, the model's are "
                   f"{info.patch_size} x {info.patch_size} x {info.channels}")
            if self.prior == "gaussian":
                raise AttackFailure(f"prior='gaussian': {msg}; build a prior for them with `python -m attacks.closed_form.priors "
                                    f"--data-path <train images> --patch {info.patch_size} --out <file.npz>` and "
                                    "pass prior_path, or use prior='smooth'")
            notes.append(f"prior='auto': {msg}; the smoothness prior is used instead")
            return None
        if meta.image_size[1] != pp.image_size:
            notes.append(f"the patch prior was learned on {pp.image_size} px images, these are {meta.image_size[1]} px")
        notes.append(f"prior: Gaussian over every {pp.patch} x {pp.patch} patch, {Path(pp.path).name} ({pp.source})")
        return PatchPriorTerm(pp, meta, info, self.device)

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        t0 = time.perf_counter()
        if meta.num_images != 1:
            raise AttackFailure(f"the closed forms need batch size 1 per update, got num_images={meta.num_images}: "
                                "the update sums the images' first-layer systems")
        vit = unwrap_vit(model)
        info = pe_conditions(model, meta.image_size)
        grads, notes = update_to_gradients(update, meta)
        noise = self._noise_model(meta)
        notes.extend(noise.notes)
        notes.append(f"noise model ({noise.source}): {noise.description}")
        prior_term = self._prior_term(meta, info, notes)
        prior_name = "gaussian" if prior_term is not None else ("smooth" if self.prior == "auto" else self.prior)
        eqs = self._equations(model, vit, grads, info, noise, notes)
        std, est = self._noise_std(eqs, grads, noise)
        common = dict(prior=prior_name, noise_model=noise.as_dict(), noise_std_from_redundancy=est, notes=notes)
        G0 = torch.where(eqs.mG, eqs.G_obs, torch.zeros_like(eqs.G_obs))
        early = self._without_alternation(eqs, noise, est, G0, common, t0)
        if early is not None:
            img, stats = early
            return AttackResult(meta.denormalize(img), [stats], labels=meta.labels)
        cells = self._quant_cells(eqs, grads, noise, prior_term, notes)
        w = Weights.of(std, eqs)
        if cells is not None:
            w = w.scaled(_CELL_WALL)  # steep walls outside the cells
        run = self._alternate(eqs, _Alternation(G=G0, lam=self.prior_weight, std=std, w=w), noise, cells,
                              prior_term, prior_name)
        img, stats = self._solution(eqs, run, prior_term, common, t0)
        return AttackResult(meta.denormalize(img), [stats], labels=meta.labels)

    # --------------------------------------------------------------------------------- stages
    def _equations(self, model: nn.Module, vit, grads, info, noise: NoiseModel, notes: list[str]) -> Equations:
        """The update's first-layer equations on ``device`` (zeros missing where pruning made them)."""
        sysm = pe_closed_form_system(model, grads, _DT, info)
        dev = self.device
        sysm = dataclasses.replace(sysm, **{k: None if t is None else t.to(dev) for k, t in (
            ("G", sysm.G), ("dW_e", sysm.dW_e), ("db_e", sysm.db_e), ("g_unk", sysm.g_unk),
            ("zero_rows", sysm.zero_rows))})
        N, D, J = info.N, info.D, info.patch_dim
        zeros_missing = self.prune_missing or noise.prune_keep is not None
        miss = (lambda t: t != 0) if zeros_missing else (lambda t: torch.ones_like(t, dtype=torch.bool))
        G_obs, dW = sysm.G, sysm.dW_e
        mG, mW = miss(G_obs), miss(dW)
        if info.has_unk:
            mG = mG & ~sysm.zero_rows[:, None]
        proj = vit.patch_embed.proj
        W_e = proj.weight.detach().to(self.device, _DT).reshape(D, J)
        b_e = proj.bias.detach().to(self.device, _DT) if proj.bias is not None else W_e.new_zeros(D)
        # bias equations: a^T G = target (a: [N] indicator), observed entries of target
        bias = []
        if sysm.db_e is not None:
            bias.append(BiasEq("b_e", torch.ones(N, dtype=_DT, device=dev), sysm.db_e, miss(sysm.db_e)))
        if sysm.g_unk is not None and bool(sysm.zero_rows.any()):
            bias.append(BiasEq("E_unk", sysm.zero_rows.to(_DT), sysm.g_unk, miss(sysm.g_unk)))
        # design A: W^T dL/dW_qkv = G_Z^T Z(X)
        qkv = None
        design_a = len(getattr(vit, "blocks", [])) > 0 and is_design_a(vit.blocks[0])
        if self.use_qkv == "auto" and design_a:
            qkv = self._qkv_system(vit, grads, info.num_prefix, info, sysm, notes)
        elif self.use_qkv == "auto":
            notes.append("block 0 is not design A: the qkv equation does not hold and is not used")
        return Equations(info, G_obs, mG, dW, mW, W_e, b_e, tuple(bias), qkv)

    def _noise_std(self, eqs: Equations, grads, noise: NoiseModel) -> tuple[NoiseStd, float]:
        """(each group's noise std, the common std read off the bias redundancy): the noise model's
        where it knows one, else the redundancy's, never below the float64 rounding floor."""
        # (quantisation levels are per received tensor: P's are set by the whole pos_embed, cls row included)
        std_known = {"P": noise.tensor_std(grads[eqs.info.prefix + "pos_embed"].to(self.device, _DT)),
                     "We": noise.tensor_std(eqs.dW)}
        est = redundancy_std(eqs)

        def std(key: str, t: torch.Tensor) -> float:
            s = std_known[key] if key in std_known else noise.tensor_std(t)
            s = est if s is None else s
            return max(s, noise_floor(t))
        s_P, s_We = std("P", eqs.G_obs), std("We", eqs.dW)
        s_b = tuple(std(e.name, e.target) for e in eqs.bias)
        s_q = None
        if eqs.qkv is not None:
            s_q = noise.tensor_std(eqs.qkv.G_W)
            s_q = max(est if s_q is None else s_q, noise_floor(eqs.qkv.G_W))
        return NoiseStd(s_P, s_We, s_b, s_q), est

    def _without_alternation(self, eqs: Equations, noise: NoiseModel, est: float, G: torch.Tensor, common: dict,
                             t0: float) -> Optional[tuple[torch.Tensor, dict]]:
        """(image, stats) where no alternation is needed (a consistent update) or none can help (most
        of dL/dP missing); None otherwise."""
        info, mG, mW, dW = eqs.info, eqs.mG, eqs.mW, eqs.dW
        fracG = float(mG.double().mean())
        # A consistent update (no defence known, every entry present, the bias redundancy zero to
        # float64 rounding): every equation holds at the truth, so the joint least squares solution
        # is the closed form's; solved directly (the normal equations square the condition number,
        # large for a design-A model, and would lose the exactness).
        consistent = (not noise.known and bool(mG.all()) and bool(mW.all())
                      and est <= 1e-9 * float(eqs.G_obs.pow(2).mean().sqrt()))
        if consistent:
            # gelsd (rank-revealing, SVD) exists on the CPU only; one D x N problem, solved there
            X = torch.linalg.lstsq(G.T.cpu(), dW.cpu(), driver="gelsd").solution.to(self.device)
            common["notes"].append(f"consistent update (bias redundancy residual {est:.1e}): exact closed form, no prior")
            img = patches_to_images(X[None], info)
            res = float((G.T @ X - dW).norm() / dW.norm().clamp_min(1e-300))
            stats = dict(objective=res, iterations=0, cg_iterations=0, time_s=time.perf_counter() - t0,
                         prior_weight=0.0, prior=common["prior"], noise_model=common["noise_model"],
                         noise_std_from_redundancy=est, residual=res, used_qkv=False,
                         observed_fraction=dict(P=1.0, We=1.0), failed=False, notes=common["notes"])
            return img, stats
        if fracG < 0.5:
            # With most of G gone, dL/dW_e = G^T X is a bilinear system with no identifiable solution
            # (any G' = A G, X' = A^-T X fits), so alternating cannot recover the image. What the
            # first layer still says: the G-weighted mean patch.
            X = mean_patch_start(eqs)
            common["notes"].append(f"dL/dP {100 * (1 - fracG):.0f}% missing: the first-layer signal is gone; "
                                   "returned the mean patch read off dL/dW_e ~ dL/db_e x^T, tiled")
            stats = dict(objective=float("nan"), iterations=0, cg_iterations=0, time_s=time.perf_counter() - t0,
                         prior_weight=0.0, prior=common["prior"], noise_model=common["noise_model"],
                         noise_std_from_redundancy=est, used_qkv=False,
                         observed_fraction=dict(P=fracG, We=float(mW.double().mean())), failed=False,
                         notes=common["notes"])
            return patches_to_images(X[None], info), stats
        return None

    def _quant_cells(self, eqs: Equations, grads, noise: NoiseModel, prior_term: Optional[PatchPriorTerm],
                     notes: list[str]) -> Optional[dict]:
        """Half the quantisation step of each received tensor (the cells' half widths), or None where
        the data terms stay Gaussian.

        Nearest-level quantisation: the true entry lies in its level's cell [q - h, q + h], h half
        the tensor's step; the Gaussian data terms become dead-zone ones (zero inside the cell),
        minimised by majorisation: each solve fits the current prediction projected onto the cells.
        Used with the Gaussian patch prior only (with the smoothness prior's self-chosen weight they
        do not help); test_gaussian_prior_improves_on_smooth_after_8bit_quantisation runs them."""
        if not (noise.quant is not None and noise.quant[0] > 1 and not noise.quant[1] and self.quant_cells
                and prior_term is not None):
            return None
        levels = 2 ** noise.quant[0] - 1
        half = {k: float(t.abs().max()) / levels for k, t in
                (("P", grads[eqs.info.prefix + "pos_embed"]), ("We", eqs.dW))}
        cells = dict(P=half["P"], We=half["We"], bias=[float(e.target.abs().max()) / levels for e in eqs.bias])
        notes.append("quantisation cells: dead-zone data terms (entries anywhere in their level's cell fit)")
        return cells

    def _alternate(self, eqs: Equations, run: "_Alternation", noise: NoiseModel, cells: Optional[dict],
                   prior_term: Optional[PatchPriorTerm], prior_name: str) -> "_Alternation":
        """Alternate the X and G solves from ``run`` (G the observed entries, X none yet) until X
        stops changing or ``iterations`` are done."""
        J, dev = eqs.info.patch_dim, self.device
        for it in range(1, self.iterations + 1):
            run.it = it
            X, G, std, w = run.X, run.G, run.std, run.w
            run.lam, run.edge = self._prior_weight(eqs, X, run.lam, run.edge, prior_term, prior_name)
            wWj = torch.full((J,), w.We, dtype=_DT, device=dev)
            if self.errors == "weighted" and X is not None:  # G's noise carried into dL/dW_e = G^T X
                wWj = 1.0 / (std.We ** 2 + std.P ** 2 * X.pow(2).sum(0))
            tgt = cell_targets(eqs, X, G, cells) if cells is not None and X is not None else eqs.observed()
            X_new, n_cg = x_step(eqs, G, tgt.dW, wWj, w.omega, PriorState(run.lam, run.edge, prior_term), X,
                                 (self.cg_tol, self.cg_maxiter))
            run.cg_its += n_cg
            change = float((X_new - X).norm() / X_new.norm().clamp_min(1e-300)) if X is not None else float("inf")
            run.X = X = X_new
            if cells is not None:
                tgt = cell_targets(eqs, X, G, cells)
            G = g_step(eqs, X, tgt, w)
            if self.errors == "weighted":
                G = torch.where(eqs.mG, eqs.G_obs, G)  # only the missing entries are estimated
            run.G = G
            run.history.append(change)
            if not noise.known and self.reestimate_noise:
                run.std = self._reestimate(eqs, X, G, std)
                run.w = Weights.of(run.std, eqs)
            if change < 1e-10:
                break
        return run

    def _prior_weight(self, eqs: Equations, X: Optional[torch.Tensor], lam: Optional[float], edge,
                      prior_term: Optional[PatchPriorTerm], prior_name: str) -> tuple[float, Any]:
        """(lam, edge) for the next X solve: chosen from the estimate X (empirical Bayes) unless
        ``prior_weight`` fixes lam; ``tv`` reweights the differences (edge)."""
        if X is not None and self.prior_weight is None:
            img = patches_to_images(X[None], eqs.info)
            if prior_term is not None:
                lam = self.prior_scale * _GAUSSIAN_WEIGHT
            else:
                energy, count = smooth_energy(img)
                # clamped to pixel-difference std between 1e-3 and 10 (normalised input)
                lam = self.prior_scale * min(max(count / max(energy, 1e-300), 1e-2), 1e6)
            if prior_name == "tv":
                # Laplace prior sum |d| / b, b = mean |d|, by iteratively reweighted least squares:
                # weight 1 / (b max(|d|, b / 10)) per difference, relative to lam's mean
                dx, dy = img[..., :, 1:] - img[..., :, :-1], img[..., 1:, :] - img[..., :-1, :]
                b = float(torch.cat([dx.abs().flatten(), dy.abs().flatten()]).mean())
                b = max(b, 1e-6)
                wx, wy = (1.0 / (b * d.abs().clamp_min(b / 10)) for d in (dx, dy))
                lam = self.prior_scale * float(torch.cat([wx.flatten(), wy.flatten()]).mean())
                edge = (wx * self.prior_scale / lam, wy * self.prior_scale / lam)
        elif lam is None:
            # first solve: unit-variance differences (normalised input), or the learned prior's weight
            lam = self.prior_scale * (_GAUSSIAN_WEIGHT if prior_term is not None else 1.0)
        return lam, edge

    def _reestimate(self, eqs: Equations, X: torch.Tensor, G: torch.Tensor, std: NoiseStd) -> NoiseStd:
        """Variance components: each group's noise std from its own residual at the estimate."""
        ms = mean_squares(eqs, X, G)
        s_P = max(math.sqrt(ms["P"]), noise_floor(eqs.G_obs)) if self.errors == "joint" else std.P
        s_We = max(math.sqrt(ms["We"]), noise_floor(eqs.dW))
        s_b = tuple(max(math.sqrt(ms[e.name]), noise_floor(e.target)) for e in eqs.bias)
        s_q = max(math.sqrt(ms["qkv"]), noise_floor(eqs.qkv.G_W)) if eqs.qkv is not None else std.qkv
        return NoiseStd(s_P, s_We, s_b, s_q)

    def _solution(self, eqs: Equations, run: "_Alternation", prior_term: Optional[PatchPriorTerm], common: dict,
                  t0: float) -> tuple[torch.Tensor, dict]:
        """(image, stats) of the alternation's end: residuals (chi^2 per observed entry) of every
        equation group and the noise stds it ended with."""
        chi = chi2_per_entry(eqs, run.w, run.X, run.G)
        img = patches_to_images(run.X[None], eqs.info)
        notes = common["notes"]
        if prior_term is not None:  # squared Mahalanobis distance per patch value (1: a typical training patch)
            energy, count = prior_term.energy(img)
            notes.append(f"patch prior: squared Mahalanobis distance {energy / count:.3g} per patch value")
        stats = dict(objective=sum(chi.values()), iterations=run.it, cg_iterations=run.cg_its,
                     time_s=time.perf_counter() - t0, prior_weight=float(run.lam), prior=common["prior"],
                     noise_model=common["noise_model"], noise_std=run.std.as_dict(eqs),
                     noise_std_from_redundancy=common["noise_std_from_redundancy"], chi2_per_entry=chi,
                     used_qkv=eqs.qkv is not None,
                     observed_fraction=dict(P=float(eqs.mG.double().mean()), We=float(eqs.mW.double().mean())),
                     change_history=run.history, failed=False, notes=notes)
        return img, stats

    def _qkv_system(self, vit, grads, pre, info, sysm, notes) -> Optional[QkvEquation]:
        """The design-A equation's data, or None (noted) where it cannot be used."""
        name = info.prefix + "blocks.0.attn.qkv.weight"
        if name not in grads:
            notes.append("update lacks blocks.0.attn.qkv.weight: the qkv equation is not used")
            return None
        a_info = check_conditions(vit)
        G_W = grads[name].to(self.device, _DT)
        if self.prune_missing and float((G_W == 0).double().mean()) > 1e-3:
            notes.append("the qkv gradient has missing (zero) entries: W^T dL/dW_qkv cannot be formed, "
                         "the qkv equation is not used")
            return None
        W = vit.blocks[0].attn.qkv.weight.detach().to(self.device, _DT)
        G_Z = gradient_of_Z(vit, {k.removeprefix(info.prefix): grads[k] for k in
                                   (info.prefix + "pos_embed", info.prefix + "cls_token", info.prefix + "reg_token")
                                   if k in grads}, a_info).to(self.device, _DT)
        D = info.D
        P = vit.pos_embed.detach().to(self.device, _DT).reshape(-1, D)
        if not a_info["pos_embed_covers_prefix"]:
            P = torch.cat([P.new_zeros(pre, D), P])
        if getattr(vit, "index_embed", None) is not None:
            P = P + vit.index_embed.detach().to(self.device, _DT).reshape(-1, D)
        toks = [t.detach().to(self.device, _DT).reshape(-1, D) for t in (getattr(vit, "cls_token", None),
                                                                    getattr(vit, "reg_token", None)) if t is not None]
        Z_pre = (torch.cat(toks) if toks else P.new_zeros(0, D)) + P[:pre]
        offset = P[pre:].clone()
        if info.has_unk and bool(sysm.zero_rows.any()):
            offset[sysm.zero_rows] = vit.unk_embed.detach().to(self.device, _DT).reshape(D)
        return QkvEquation(G_W=G_W, W=W, R=W.T @ G_W, G_pre=G_Z[:pre], Z_pre=Z_pre, offset=offset)


@dataclasses.dataclass
class _Alternation:
    """The alternation's running state: the estimates, the prior's weight and reweighting, the noise
    stds and weights, the relative change of X per alternation, the alternations and CG iterations run."""

    G: torch.Tensor
    lam: Optional[float]
    std: NoiseStd
    w: Weights
    X: Optional[torch.Tensor] = None
    edge: Any = None
    history: list = dataclasses.field(default_factory=list)
    it: int = 0
    cg_its: int = 0

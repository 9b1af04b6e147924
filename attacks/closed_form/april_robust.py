"""The first layer's closed-form equations solved jointly as a regularised least squares.

The exact closed forms (attacks/closed_form/pe_closed_form.py, attacks/closed_form/april.py) each invert one linear system
and break under any perturbation of the update (APRIL's qkv system has condition numbers of ~1e7).
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

from ..solvers.linalg import conjugate_gradient
from .first_layer import check_conditions, gradient_of_Z, is_design_a, unwrap_vit
from ..api.base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, Update, update_to_gradients
from ..api.registry import register_attack
from .pe_closed_form import images_to_patches, patches_to_images, pe_closed_form_system, pe_conditions
from .priors import load_patch_prior
from .robust_terms import NoiseModel, PatchPriorTerm, defence_noise, noise_floor, smooth_energy, smooth_normal

_logger = logging.getLogger(__name__)
_DT = torch.float64
#: Weight of the Gaussian patch prior's Mahalanobis sum (times ``prior_scale``). Not chosen from the
#: estimate as the smoothness prior's is: the joint MAP over (X, G) needs a far stronger prior than the
#: learned covariance itself says (the weight that fits the true 32 px images is 0.02-0.03; chosen from
#: the estimates it ended near 0.3, 13.8 dB after 8-bit quantisation where a fixed 10 gave 18). 10 was
#: the best of 3, 10, 30 (8-bit quantisation) and of 1, 10 (local DP 1e-6, 1e-4) on ImageNet-sample
#: images 5, 118, 231, 344 at 32 px, disjoint from bench/closed_forms.py's images 41, 138, 235, 332.
_GAUSSIAN_WEIGHT = 10.0




@register_attack("april_robust")
class AprilRobust(Attack):
    """Joint regularised least squares of the first layer's equations (see the module docstring).

    Args:
        sigma, clip: local DP's noise multiplier and clip, if the server knows them (noise std
            sigma * clip); ``clip`` alone is not used (clipping scales every equation alike).
        quant_bits: the quantisation's bits, if known.
        prune_keep: the kept share of a top-k pruning, if known: zeros are then missing entries even
            with ``prune_missing=False`` (recorded; bounding them by the smallest kept magnitude did not help).
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
        sysm = pe_closed_form_system(model, grads, _DT, info)
        dev = self.device
        sysm = dataclasses.replace(sysm, **{k: None if t is None else t.to(dev) for k, t in (
            ("G", sysm.G), ("dW_e", sysm.dW_e), ("db_e", sysm.db_e), ("g_unk", sysm.g_unk),
            ("zero_rows", sysm.zero_rows))})
        N, D, J = info.N, info.D, info.patch_dim
        pre = info.num_prefix
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
        bias_eqs = []
        if sysm.db_e is not None:
            bias_eqs.append(("b_e", torch.ones(N, dtype=_DT, device=dev), sysm.db_e, miss(sysm.db_e)))
        if sysm.g_unk is not None and bool(sysm.zero_rows.any()):
            bias_eqs.append(("E_unk", sysm.zero_rows.to(_DT), sysm.g_unk, miss(sysm.g_unk)))

        # design A: W^T dL/dW_qkv = G_Z^T Z(X)
        qkv = None
        design_a = len(getattr(vit, "blocks", [])) > 0 and is_design_a(vit.blocks[0])
        if self.use_qkv == "auto" and design_a:
            qkv = self._qkv_system(vit, grads, pre, info, sysm, notes)
            if qkv is not None:
                qkv.update(W_e=W_e, b_e=b_e)
        elif self.use_qkv == "auto":
            notes.append("block 0 is not design A: the qkv equation does not hold and is not used")

        # noise std of each equation group
        # (quantisation levels are per received tensor: P's are set by the whole pos_embed, cls row included)
        std_known = {"P": noise.tensor_std(grads[info.prefix + "pos_embed"].to(self.device, _DT)),
                     "We": noise.tensor_std(dW)}
        est = self._redundancy_std(G_obs, mG, bias_eqs, N)

        def std(key: str, t: torch.Tensor) -> float:
            s = std_known[key] if key in std_known else noise.tensor_std(t)
            s = est if s is None else s
            return max(s, noise_floor(t))
        s_P, s_We = std("P", G_obs), std("We", dW)
        s_b = [std(name, tgt) for name, _, tgt, _ in bias_eqs]
        wP, wW, wb = 1 / s_P ** 2, 1 / s_We ** 2, [1 / s ** 2 for s in s_b]
        if qkv is not None:
            s_q = noise.tensor_std(qkv["G_W"])
            s_q = max(est if s_q is None else s_q, noise_floor(qkv["G_W"]))
            qkv["omega"] = 1.0 / (s_q ** 2 * qkv["W"].pow(2).sum(0) + noise_floor(qkv["R"]) ** 2)
            qkv["s"] = s_q
        fracG = float(mG.double().mean())
        noise_stats = noise.as_dict()

        # A consistent update (no defence known, every entry present, the bias redundancy zero to
        # float64 rounding): every equation holds at the truth, so the joint least squares solution
        # is the closed form's; solved directly (the normal equations above square the condition
        # number, ~1e7 for a design-A model, and would lose the exactness).
        G = torch.where(mG, G_obs, torch.zeros_like(G_obs))
        consistent = (not noise.known and bool(mG.all()) and bool(mW.all())
                      and est <= 1e-9 * float(G_obs.pow(2).mean().sqrt()))
        if consistent:
            # gelsd (rank-revealing, SVD) exists on the CPU only; one D x N problem, solved there
            X = torch.linalg.lstsq(G.T.cpu(), dW.cpu(), driver="gelsd").solution.to(dev)
            notes.append(f"consistent update (bias redundancy residual {est:.1e}): exact closed form, no prior")
            img = patches_to_images(X[None], info)
            res = float((G.T @ X - dW).norm() / dW.norm().clamp_min(1e-300))
            stats = dict(objective=res, iterations=0, cg_iterations=0, time_s=time.perf_counter() - t0,
                         prior_weight=0.0, prior=prior_name, noise_model=noise_stats, noise_std_from_redundancy=est,
                         residual=res, used_qkv=False, observed_fraction=dict(P=1.0, We=1.0), failed=False, notes=notes)
            return AttackResult(meta.denormalize(img), [stats], labels=meta.labels)
        if fracG < 0.5:
            # With most of G gone, dL/dW_e = G^T X is a bilinear system with no identifiable solution
            # (any G' = A G, X' = A^-T X fits; alternating from here, with or without the bound of the
            # missing entries that a known pruning gives, drifted far below the mean image in every
            # case tried). What the first layer still says: the G-weighted mean patch.
            X = self._mean_patch_start(dW, mW, bias_eqs, N, J)
            notes.append(f"dL/dP {100 * (1 - fracG):.0f}% missing: the first-layer signal is gone; returned the "
                         "mean patch read off dL/dW_e ~ dL/db_e x^T, tiled")
            stats = dict(objective=float("nan"), iterations=0, cg_iterations=0, time_s=time.perf_counter() - t0,
                         prior_weight=0.0, prior=prior_name, noise_model=noise_stats,
                         noise_std_from_redundancy=est, used_qkv=False,
                         observed_fraction=dict(P=fracG, We=float(mW.double().mean())), failed=False, notes=notes)
            return AttackResult(meta.denormalize(patches_to_images(X[None], info)), [stats], labels=meta.labels)
        X = None
        lam, edge = self.prior_weight, None
        history, it, cg_its = [], 0, 0
        cells = None
        if (noise.quant is not None and noise.quant[0] > 1 and not noise.quant[1] and self.quant_cells
                and prior_term is not None):
            # nearest-level quantisation: the true entry lies in its level's cell [q - h, q + h], h half
            # the tensor's step; the Gaussian data terms become dead-zone ones (zero inside the cell),
            # minimised by majorisation: each solve fits the current prediction projected onto the cells.
            # With the Gaussian patch prior only: with the smoothness prior's self-chosen weight they
            # lost 0.3-1.3 dB (bench/closed_forms.py and validation images), with the patch prior they gain 0.6.
            half = {k: float(t.abs().max()) / (2 ** noise.quant[0] - 1) for k, t in
                    (("P", grads[info.prefix + "pos_embed"]), ("We", dW))}
            cells = dict(P=half["P"], We=half["We"], bias=[float(t.abs().max()) / (2 ** noise.quant[0] - 1)
                                                           for _, _, t, _ in bias_eqs])
            notes.append("quantisation cells: dead-zone data terms (entries anywhere in their level's cell fit)")
            # outside its cell an entry's residual is penalised as with std step / sqrt(120), not the
            # rounding error's step / sqrt(12): steep walls (calibrated on validation images, docs/attacks.md)
            wP, wW, wb = wP * 10, wW * 10, [w * 10 for w in wb]
        for it in range(1, self.iterations + 1):
            if X is not None and self.prior_weight is None:
                img = patches_to_images(X[None], info)
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
            wWj = torch.full((J,), wW, dtype=_DT, device=dev)
            if self.errors == "weighted" and X is not None:  # G's noise carried into dL/dW_e = G^T X
                wWj = 1.0 / (s_We ** 2 + s_P ** 2 * X.pow(2).sum(0))
            tG, tW, tb = G_obs, dW, bias_eqs
            if cells is not None and X is not None:
                tG, tW, tb = self._cell_targets(X, G, G_obs, dW, bias_eqs, cells)
            X_new, n_cg = self._x_step(G, tW, mW, wWj, qkv, lam, info, X, edge, prior_term)
            cg_its += n_cg
            change = float((X_new - X).norm() / X_new.norm().clamp_min(1e-300)) if X is not None else float("inf")
            X = X_new
            if cells is not None:
                tG, tW, tb = self._cell_targets(X, G, G_obs, dW, bias_eqs, cells)
            G = self._g_step(X, tG, mG, wP, tW, mW, wW, tb, wb, qkv, W_e, b_e, info)
            if self.errors == "weighted":
                G = torch.where(mG, G_obs, G)  # only the missing entries are estimated
            history.append(change)
            if not noise.known and self.reestimate_noise:
                # variance components: each group's noise std from its own residual at the estimate
                ms = self._mean_squares(X, G, G_obs, mG, dW, mW, bias_eqs, qkv, W_e, b_e)
                s_P = max(math.sqrt(ms["P"]), noise_floor(G_obs)) if self.errors == "joint" else s_P
                s_We = max(math.sqrt(ms["We"]), noise_floor(dW))
                s_b = [max(math.sqrt(ms[n]), noise_floor(t)) for n, _, t, _ in bias_eqs]
                wP, wW, wb = 1 / s_P ** 2, 1 / s_We ** 2, [1 / v ** 2 for v in s_b]
                if qkv is not None:
                    qkv["s"] = max(math.sqrt(ms["qkv"]), noise_floor(qkv["G_W"]))
                    qkv["omega"] = 1.0 / (qkv["s"] ** 2 * qkv["W"].pow(2).sum(0) + noise_floor(qkv["R"]) ** 2)
            if change < 1e-10:
                break

        # residuals (chi^2 per observed entry) of every equation group at the solution
        chi = {"P": float(((G - G_obs)[mG]).pow(2).sum() * wP / max(int(mG.sum()), 1)),
               "We": float(((G.T @ X - dW)[mW]).pow(2).sum() * wW / max(int(mW.sum()), 1))}
        for (name, a, tgt, m), w in zip(bias_eqs, wb):
            chi[name] = float(((a @ G - tgt)[m]).pow(2).sum() * w / max(int(m.sum()), 1))
        if qkv is not None:
            Zp = X @ W_e.T + b_e + qkv["offset"]
            r = qkv["R"] - qkv["G_pre"].T @ qkv["Z_pre"] - G.T @ Zp
            chi["qkv"] = float((r.pow(2).sum(1) * qkv["omega"]).sum() / r.numel())
        img = patches_to_images(X[None], info)
        if prior_term is not None:  # squared Mahalanobis distance per patch value (1: a typical training patch)
            energy, count = prior_term.energy(img)
            notes.append(f"patch prior: squared Mahalanobis distance {energy / count:.3g} per patch value")
        stats = dict(objective=sum(chi.values()), iterations=it, cg_iterations=cg_its, time_s=time.perf_counter() - t0,
                     prior_weight=float(lam), prior=prior_name, noise_model=noise_stats,
                     noise_std=dict(P=s_P, We=s_We, **{n: s for (n, *_), s in zip(bias_eqs, s_b)},
                                    **({"qkv": qkv["s"]} if qkv is not None else {})),
                     noise_std_from_redundancy=est, chi2_per_entry=chi, used_qkv=qkv is not None,
                     observed_fraction=dict(P=fracG, We=float(mW.double().mean())), change_history=history,
                     failed=False, notes=notes)
        return AttackResult(meta.denormalize(img), [stats], labels=meta.labels)

    # --------------------------------------------------------------------------------- pieces
    def _qkv_system(self, vit, grads, pre, info, sysm, notes) -> Optional[dict]:
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
        return dict(G_W=G_W, W=W, R=W.T @ G_W, G_pre=G_Z[:pre], Z_pre=Z_pre, offset=offset)

    @staticmethod
    def _cell_targets(X, G, G_obs, dW, beqs, cells):
        """The current predictions of G, dL/dW_e and the bias targets projected onto the quantisation
        cells of the received values (exact zeros, the missing entries, are left as they are)."""
        def proj(pred, obs, h):
            return torch.where(obs != 0, torch.minimum(torch.maximum(pred, obs - h), obs + h), obs)
        tG = proj(G, G_obs, cells["P"])
        tW = proj(G.T @ X, dW, cells["We"])
        tb = [(n, a, proj(a @ G, t, h), m) for (n, a, t, m), h in zip(beqs, cells["bias"])]
        return tG, tW, tb

    @staticmethod
    def _mean_squares(X, G, G_obs, mG, dW, mW, bias_eqs, qkv, W_e, b_e) -> dict[str, float]:
        """Mean squared residual of each equation group (the qkv one per unit ||W_qkv[:, d]||^2)."""
        out = {"P": float(((G - G_obs)[mG]).pow(2).mean()) if bool(mG.any()) else 0.0,
               "We": float(((G.T @ X - dW)[mW]).pow(2).mean()) if bool(mW.any()) else 0.0}
        for name, a, tgt, m in bias_eqs:
            out[name] = float(((a @ G - tgt)[m]).pow(2).mean()) if bool(m.any()) else 0.0
        if qkv is not None:
            r = qkv["R"] - qkv["G_pre"].T @ qkv["Z_pre"] - G.T @ (X @ W_e.T + b_e + qkv["offset"])
            out["qkv"] = float((r.pow(2).mean(1) / qkv["W"].pow(2).sum(0).clamp_min(1e-300)).mean())
        return out

    @staticmethod
    def _redundancy_std(G_obs, mG, bias_eqs, N) -> float:
        """Common noise std from the bias residual over fully observed columns (0 if none)."""
        if not bias_eqs:
            return 0.0
        _, a, tgt, m = bias_eqs[0]
        cols = mG.all(dim=0) & m
        if len(bias_eqs) > 1 or not bool(cols.any()):
            return 0.0
        r = (a @ G_obs - tgt)[cols]
        return float(r.pow(2).mean().sqrt()) / math.sqrt(N + 1)

    @staticmethod
    def _mean_patch_start(dW, mW, bias_eqs, N, J) -> torch.Tensor:
        """X with every patch equal to argmin_x sum_d (dW[d] - db[d] x)^2 (observed entries):
        dL/dW_e = db_e x^T exactly when all patches equal x."""
        if not bias_eqs:
            return dW.new_zeros(N, J)
        _, _, db, mb = bias_eqs[0]
        m = mW & mb[:, None]
        num = (m * dW * db[:, None]).sum(0)
        den = (m * db[:, None] ** 2).sum(0).clamp_min(1e-300)
        return (num / den).expand(N, J).clone()

    def _x_step(self, G, dW, mW, wW, qkv, lam, info, X0, edge=None, prior_term=None) -> tuple[torch.Tensor, int]:
        """argmin_X sum_j wW_j |mW (G^T X - dW)_j|^2 + sum_d omega_d |(G^T X W_e^T - R1)_d|^2 + lam |L X|^2 + eps |X|^2
        (``mW``: per-entry weights; ``prior_term``: the Gaussian patch prior's Mahalanobis sum instead of |L X|^2)."""
        N, J = info.N, info.patch_dim
        eps = 1e-6 * lam
        full = bool((mW == 1).all())
        GGt = G @ G.T
        if full:
            A1 = wW[:, None, None] * GGt
        else:
            A1 = torch.einsum("nd,dj,md->jnm", G, mW.to(_DT) * wW, G)
        rhs = G @ (mW * dW * wW)
        if qkv is not None:
            W_e, b_e = qkv["W_e"], qkv["b_e"]
            om = qkv["omega"][:, None]
            R1 = qkv["R"] - qkv["G_pre"].T @ qkv["Z_pre"] - G.T @ (b_e + qkv["offset"])
            GoG = G @ (om * G.T)
            cj = (W_e * W_e).sum(0)  # diag of W_e^T W_e, [J]
            A1 = A1 + cj[:, None, None] * GoG
            rhs = rhs + G @ (om * R1) @ W_e
        jitter = 1e-12 * A1.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-300)  # rounding of near-singular G G^T
        if prior_term is not None:  # the prior's exact diagonal, per patch entry
            dg = lam * images_to_patches(prior_term.diag_img, info)[0]  # [N, J]
            prec = A1 + torch.diag_embed(dg.T + (eps + jitter)[:, None])
            rhs = rhs + lam * images_to_patches(prior_term.rhs_img, info)[0]
        else:
            prec = A1 + ((4 * lam + eps) + jitter)[:, None, None] * torch.eye(N, dtype=_DT, device=G.device)
        L = torch.linalg.cholesky(prec)  # [J, N, N]

        def op(x: torch.Tensor) -> torch.Tensor:
            X = x.reshape(N, J)
            out = G @ (wW * mW * (G.T @ X))
            if qkv is not None:
                out = out + G @ (om * (G.T @ X @ qkv["W_e"].T)) @ qkv["W_e"]
            img = patches_to_images(X[None], info)
            reg = smooth_normal(img, edge) if prior_term is None else prior_term.apply(img)
            return out + lam * images_to_patches(reg, info)[0] + eps * X

        def pre(x: torch.Tensor) -> torch.Tensor:
            Xc = x.reshape(N, J).T[:, :, None]  # [J, N, 1]
            return torch.cholesky_solve(Xc, L)[:, :, 0].T

        b = rhs.reshape(-1)
        start = pre(b).reshape(-1) if X0 is None else X0.reshape(-1)
        sol, its, _ = conjugate_gradient(lambda v: op(v).reshape(-1), b, x0=start,
                                         precond=lambda v: pre(v).reshape(-1), rtol=self.cg_tol, maxiter=self.cg_maxiter)
        return sol.reshape(N, J), its

    def _g_step(self, X, G_obs, mG, wP, dW, mW, wW, bias_eqs, wb, qkv, W_e, b_e, info) -> torch.Tensor:
        """argmin_G of the same objective with X fixed: one N x N system per embedding dimension."""
        N, D = info.N, info.D
        mGd = mG.to(_DT)
        H = torch.diag_embed(wP * mGd.T)  # [D, N, N]
        if bool((mW == 1).all()):
            H = H + wW * (X @ X.T)
        else:
            H = H + wW * torch.einsum("nj,dj,mj->dnm", X, mW.to(_DT), X)
        rhs = wP * (mGd * G_obs).T + wW * ((mW * dW) @ X.T)  # [D, N]
        for (_, a, tgt, m), w in zip(bias_eqs, wb):
            md = m.to(_DT)
            H = H + (w * md)[:, None, None] * torch.outer(a, a)
            rhs = rhs + (w * md * tgt)[:, None] * a[None]
        if qkv is not None:
            Zp = X @ W_e.T + b_e + qkv["offset"]  # [N, D]
            om = qkv["omega"]
            H = H + om[:, None, None] * (Zp @ Zp.T)
            target = qkv["R"] - qkv["G_pre"].T @ qkv["Z_pre"]  # [D, D], row d = sum_t G[t, d] Zp[t]
            rhs = rhs + om[:, None] * (target @ Zp.T)
        scale = H.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-300)
        H = H + (1e-12 * scale)[:, None, None] * torch.eye(N, dtype=_DT, device=X.device)
        return torch.linalg.solve(H, rhs[:, :, None])[:, :, 0].T


"""``likelihood_match``: a second-order fit of one image to the whole defended update, under the
defence's own observation model.

A closed form reads the first layer's equations; under a defence they hold only to the defence's
error, and ``april_robust`` solves them in least squares with that error model. Every other entry
of the update (qkv, the MLPs, the head: about 570k on the CIFAR DeiT against 3,072 unknowns) is
also an observation of the same image under the same error model. This attack starts from
another attacker's read (by default the better, by this fit's residual, of ``block0_roots``' and
``april_robust``'s) and fits the image to all of them at once:

    min_x  sum_entries r(x)^2,   r = the residual of :meth:`MatchTerms.residual
                                 <attacks.optimization.match_terms.MatchTerms.residual>`

with the clients' defence from the metadata (:func:`~attacks.optimization.match_terms.defence_match`):

- ``quantize``: the rounding error per entry, (dL/dtheta(x) - q) / (step / sqrt 12) per tensor
  (``rounding: gaussian``, the rounding error's Gaussian likelihood), or the distance outside each
  entry's quantisation cell over the same scale (``rounding: cells``, the uniform likelihood's
  support; its residual is exactly zero at the client's image);
- ``prune``: the kept entries, where the pruned update equals the gradient;
- ``local_dp`` / ``dp_sgd``: (u - clip_C(dL/dtheta(x))) / s, the noise's own likelihood;
- no defence or one it cannot model: the plain match, each tensor over its own RMS.

The solver is Levenberg-Marquardt without forming the Jacobian
(:func:`attacks.solvers.lm.matrix_free_lm`, plain conjugate gradients): each CG step is one
Jacobian-vector and one vector-Jacobian product of the model's double backward, in float64. Batch
1 per update (its starts are batch-1 reads), labels given or read off the head's bias
gradient. An MJP client's update (a nonzero E_unk gradient) is fitted with its own forward: the shuffled
positions are dL/dP's rows at the defence's noise level (exactly zero without noise), E_unk takes
their place, the client's DAL term is removed from the target, and the image fitted is x~ (its
shuffled patches' order, setting (c), is the jigsaw solver's).
docs/results/attacks.md, "Second-order likelihood match after 8-bit", has its measurements
(bench/likelihood_match.py); tests/test_likelihood_match.py pins that it beats its start on a
real 8-bit update.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field
from torch.func import functional_call, grad

from fedmjp.config import Float, Int, option
from fedmjp.devices import resolve_device

from ..api.base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, Update, update_to_gradients
from ..api.registry import Threat, register_attack
from ..closed_form.first_layer import unwrap_vit
from ..closed_form.labels import recover_labels
from ..closed_form.mjp_update import read_defended_mjp_update
from ..solvers.jigsaw import unshuffle_image
from ..solvers.lm import matrix_free_lm
from .batch_match import forward_kwargs
from .breaching_adapter import attack_copy, matched_names
from .match_terms import MatchTerms, defence_match

_DT = torch.float64
#: the reads ``start: auto`` compares, by the fit's own data residual: block 0's read, the strongest where it
#: succeeds (an MJP client's x~ under a defence, where april_robust's first-layer read misses it:
#: docs/results/structure.md, "The read as likelihood_match's start"), and the closed form's, which
#: succeeds on every batch-1 update
AUTO_STARTS = ("block0_roots", "april_robust")


def update_residual(work: nn.Module, names: Sequence[str], terms: MatchTerms, labels: torch.Tensor,
                    shape: tuple[int, ...], rounding: str = "gaussian", unk_mask: Optional[torch.Tensor] = None
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """theta (a flat normalised image, [C H W]) -> [entries]: ``terms.residual`` of the gradients of
    ``names`` that image sends with ``labels`` (mean cross-entropy), differentiable by torch.func
    in theta (forward and reverse mode). ``work``'s other parameters stay fixed. ``unk_mask`` ([N]
    bool): an MJP client's shuffled positions, which take E_unk in the forward (theta is then x~)."""
    kwargs = forward_kwargs(unk_mask, shape[0])
    chosen = {nm: p.detach() for nm, p in work.named_parameters() if nm in set(names)}
    fixed = {nm: p.detach() for nm, p in work.named_parameters() if nm not in chosen}
    fixed.update(dict(work.named_buffers()))

    def loss(p: dict, theta: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(work, {**fixed, **p}, (theta.view(shape),), kwargs), labels)

    gradient = grad(loss)

    def fun(theta: torch.Tensor) -> torch.Tensor:
        g = gradient(chosen, theta)
        return terms.residual({nm: g[nm][None] for nm in names}, rounding)[0]

    return fun


def patch_prior_residual(prior, mean: torch.Tensor, std: torch.Tensor, shape: tuple[int, ...], weight: float
                         ) -> Callable[[torch.Tensor], torch.Tensor]:
    """theta (a flat normalised image) -> the Gaussian patch prior as least-squares rows:
    sqrt(weight) L^T (u_p - mu) for every p x p patch u_p of the image in [0, 1] at every offset,
    L L^T the prior's precision, so that the rows' sum of squares is ``weight`` times the prior's
    energy (:class:`attacks.closed_form.robust_terms.PatchPriorTerm`, the same quadratic)."""
    p = prior.patch
    chol = torch.linalg.cholesky(torch.from_numpy(prior.precision).to(std.device, _DT))
    mu = torch.from_numpy(prior.mean).to(std.device, _DT)[:, None]
    m = mean.to(std.device, _DT).view(1, -1, 1, 1)
    s = std.to(std.device, _DT).view(1, -1, 1, 1)
    root = math.sqrt(weight)

    def fun(theta: torch.Tensor) -> torch.Tensor:
        u = theta.view(shape) * s + m
        return (root * (chol.T @ (F.unfold(u, p)[0] - mu))).reshape(-1)

    return fun


def defence_residual(work: nn.Module, grads, meta: AttackMetadata, labels: torch.Tensor, rounding: str = "gaussian",
                     unk_mask: Optional[torch.Tensor] = None, raw=None
                     ) -> tuple[Callable[[torch.Tensor], torch.Tensor], MatchTerms, list[str]]:
    """(theta -> residual, its terms, notes): :func:`update_residual` of every parameter the forward
    uses that ``grads`` carries, under the defence ``meta`` names (:func:`defence_match`), in
    ``work``'s dtype and on its device. An MJP client's update (``unk_mask``, its shuffled positions):
    ``grads`` with the DAL term removed, ``raw`` as sent (the quantiser's bins and the pruned support
    are the sent update's); the DAL head, which the image does not reach, is left out."""
    p = next(work.parameters())
    names = [nm for nm in matched_names(work, grads, meta.image_size)
             if unk_mask is None or not nm.startswith("dal_head.")]
    targets = {nm: grads[nm].detach().to(p.device, p.dtype)[None] for nm in names}
    terms, notes = defence_match(targets, [grads if raw is None else raw], [meta], names)
    return (update_residual(work, names, terms, labels, (1, *meta.image_size), rounding, unk_mask), terms,
            notes)


@register_attack("likelihood_match")
class LikelihoodMatch(Attack):
    """Levenberg-Marquardt on the whole update's defence likelihood from another attacker's read
    (see the module docstring).

    Args:
        iterations: Gauss-Newton iterations at most (each one pullback and up to a few CG solves).
        cg_iterations, cg_tol: conjugate-gradient iterations per trial step and their relative tolerance.
        sketch_rows: 0: plain CG; m > 0: CG preconditioned by a low-rank model of J^T J read off m
            vector-Jacobian products per iteration (:class:`attacks.solvers.linalg.SketchPreconditioner`,
            :func:`attacks.solvers.lm.matrix_free_lm`), at most 4 x the image's entries.
        rounding: the quantiser's observation model: ``gaussian`` (rounding error as noise of std
            step / sqrt 12) or ``cells`` (the distance outside each entry's cell).
        start: the attacker whose read is the start, with the same metadata: ``auto`` (the default:
            each of :data:`AUTO_STARTS` with its default options, the read with the smallest data
            residual; ``block0_roots`` reads an MJP client's x~ where ``april_robust`` misses it),
            ``april_robust``'s closed form, ``block0_roots``'s read (the noise-aware read under a
            defence), or ``invertinggradients_batched``, first-order matching through the defence,
            for updates where the closed form's first-layer signal is gone, as after pruning; the
            mean image where every start fails, noted; or ``mean`` (the normalisation mean colour).
            A start's read is kept in the update's estimate store for the other rows of the update.
        start_options: options of the start's attacker (checked when this attack is built; one
            named start only).
        prior: ``none`` (the likelihood alone: its maximum) or ``gaussian``: the learned Gaussian
            patch prior (``prior_path``, default the shipped CIFAR-10 4 x 4 one) added as
            least-squares rows (:func:`patch_prior_residual`): a MAP fit, where the data stop
            telling images apart (a residual at the noise level) the prior decides.
        prior_weight: the prior's weight; default 1 / p^2 (every pixel lies in p^2 patches at
            stride 1: the prior counts each pixel once).
        prior_path: a prior file (``python -m attacks.closed_form.priors``).
        label_strategy: when labels are not granted: ``bias`` or ``idlg`` (:func:`recover_labels`).
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``; the benchmark passes the run's ``--device``.
    """

    threat = Threat(batch="1 per update", labels="given, or read off the head's bias gradient",
                    architecture="any ViT (MJP: x~, the shuffled positions read off dL/dP)",
                    precision="any; the defence's observation model from the metadata")

    name = "likelihood_match"

    class Options(AttackOptions):
        iterations: Int = option(12, ge=1)
        cg_iterations: Int = option(60, ge=1)
        cg_tol: Float = option(1e-6, gt=0.0, lt=1.0)
        sketch_rows: Int = option(0, ge=0, le=1 << 16)
        rounding: Literal["gaussian", "cells"] = "gaussian"
        start: Literal["auto", "april_robust", "block0_roots", "invertinggradients_batched", "mean"] = "auto"
        start_options: dict[str, Any] = Field(default_factory=dict)
        prior: Literal["none", "gaussian"] = "none"
        prior_weight: Optional[Float] = option(None, gt=0.0)
        prior_path: Optional[str] = None
        label_strategy: Literal["bias", "idlg"] = "bias"
        device: str = "cpu"

    def __init__(self, **options: Any) -> None:
        from ..api.registry import attack_options

        o = self._parse_options(options)
        self.iterations, self.cg_iterations, self.cg_tol = o.iterations, o.cg_iterations, o.cg_tol
        self.sketch_rows = o.sketch_rows
        self.rounding, self.start, self.label_strategy = o.rounding, o.start, o.label_strategy
        self.device = resolve_device(o.device)
        self.patch_prior, self.prior_weight = None, o.prior_weight
        if o.prior == "gaussian":
            from ..closed_form.priors import load_patch_prior

            self.patch_prior = load_patch_prior(o.prior_path)  # PriorError (a ValueError) names a bad file
        elif o.prior_weight is not None or o.prior_path is not None:
            raise ValueError("likelihood_match: prior_weight / prior_path are given but prior is 'none'")
        if o.start in ("mean", "auto") and o.start_options:
            raise ValueError(f"likelihood_match: start_options are given but start is '{o.start}' (they go to one "
                             "named start attacker; name it, e.g. start: april_robust)")
        try:
            self.start_options = dict(attack_options(o.start, dict(o.start_options))) if o.start not in (
                "mean", "auto") else {}
        except ValueError as err:
            raise ValueError(f"likelihood_match: start_options ({o.start}'s): {err}") from None
        # the start's read goes into (and comes from) the update's estimate store
        self.shares_estimates = o.start != "mean"

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        t0 = time.perf_counter()
        if meta.num_images != 1:
            raise AttackFailure(f"likelihood_match fits one image per update (its starts are batch-1 "
                                f"reads), got num_images={meta.num_images}; batch_match fits a batch")
        grads, notes = update_to_gradients(update, meta)
        work = attack_copy(model, _DT, self.device)
        size = meta.image_size
        raw, mask, read = grads, None, self._shuffled(model, grads, meta, notes)
        if read is not None:  # an MJP client: its shuffled positions, its gradients less the DAL term
            mask, grads = read[0].to(self.device), read[1]
        y = self._labels(work, grads, meta, notes)
        fun, terms, more = defence_residual(work, grads, meta, y, self.rounding, mask, raw)
        notes.extend(more)
        if terms.kind == "bins":
            notes.append(f"rounding model: {self.rounding}")
        theta0, start_time = self._start(model, update, meta, notes, fun)
        data_fun, weight = fun, 0.0
        if self.patch_prior is not None:
            pp = self.patch_prior
            if pp.channels != size[0]:
                raise AttackFailure(f"the patch prior {pp.path} is for {pp.channels}-channel images, these have {size[0]}")
            weight = self.prior_weight if self.prior_weight is not None else 1.0 / pp.patch ** 2
            prior_fun = patch_prior_residual(pp, meta.mean, meta.std.to(self.device), (1, *size), weight)
            notes.append(f"prior: Gaussian over every {pp.patch} x {pp.patch} patch ({pp.source}), weight {weight:.4g}")
            if size[1] != pp.image_size:
                notes.append(f"the patch prior was learned on {pp.image_size} px images, these are {size[1]} px")

            def fun(theta: torch.Tensor) -> torch.Tensor:
                return torch.cat([data_fun(theta), prior_fun(theta)])
        with torch.no_grad():
            r0 = float(data_fun(theta0).pow(2).sum())
        if self.sketch_rows > 4 * theta0.numel():
            raise AttackFailure(f"likelihood_match: sketch_rows {self.sketch_rows} exceeds 4 x the image's "
                                f"{theta0.numel()} entries")
        res = matrix_free_lm(fun, theta0, max_iterations=self.iterations, sketch_rows=self.sketch_rows,
                             cg_iterations=self.cg_iterations, cg_tol=self.cg_tol)
        lo, hi = meta.box(_DT, self.device)
        x = torch.max(torch.min(res.theta.view(1, *size), hi), lo)
        with torch.no_grad():
            r1 = float(fun(x.reshape(-1)).pow(2).sum())
            data1 = float(data_fun(x.reshape(-1)).pow(2).sum())
        stats = dict(objective=r1, iterations=int(res.jacobians), residual_start=r0, residual_end=data1,
                     cg_steps=int(sum(res.cg_iterations)),
                     prior_weight=weight,
                     entries=int(sum(t.shape[1] for t in terms.flat)), start=self.start,
                     start_time_s=start_time, time_s=time.perf_counter() - t0, notes=notes)
        images = meta.denormalize(x)
        unshuffled = None
        if mask is not None and bool(mask.any()):  # x~'s shuffled patches in place; their order a jigsaw (setting c)
            stats["shuffled_positions"] = int(mask.sum())
            unshuffled = unshuffle_image(images, mask.cpu(), int(unwrap_vit(model).patch_embed.patch_size[0]))[0]
        return AttackResult(images, [stats], labels=y.cpu(), unshuffled=unshuffled)

    def _shuffled(self, model: nn.Module, grads, meta: AttackMetadata, notes: list[str]):
        """None for a plain update; for an MJP client's (a nonzero E_unk gradient): (its shuffled
        positions [N] bool, the gradients with its DAL term removed), read off dL/dP's rows at the
        defence's noise level (:func:`attacks.closed_form.mjp_update.read_defended_mjp_update`)."""
        unk = [nm for nm in grads if nm.split(".")[-1] == "unk_embed"]
        if not unk or not float(grads[unk[0]].abs().max()) > 0:
            return None
        S, clean, st, level = read_defended_mjp_update(unwrap_vit(model), dict(grads), meta)
        notes.append(f"MJP client: {int(S.sum())} shuffled positions read off dL/dP's rows at the {level} level, "
                     "E_unk there in the forward; the image fitted is x~"
                     + (f"; DAL term of weight {st['dal_weight']:.3g} removed" if "dal_weight" in st else ""))
        return S, clean

    def _labels(self, work: nn.Module, grads, meta: AttackMetadata, notes: list[str]) -> torch.Tensor:
        """[1]: the granted label, else the one read off the head's gradient (noted)."""
        if meta.labels is not None:
            return meta.labels.to(self.device)
        head = getattr(work, "get_classifier", lambda: None)()
        head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
        head_names = [nm for nm, p in work.named_parameters() if id(p) in head_ids]
        notes.append(f"labels recovered from the gradient ({self.label_strategy})")
        return recover_labels(grads, head_names, 1, self.label_strategy).to(self.device)

    def _start(self, model: nn.Module, update: Update, meta: AttackMetadata, notes: list[str],
               residual: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, float]:
        """(flat normalised start [C H W] in float64 on the device, the start's seconds): the read of
        the start attacker (``auto``: of each of :data:`AUTO_STARTS`, the one whose ``residual``, the
        data term, is smallest), the mean image where none succeeds."""
        t0 = time.perf_counter()
        names = AUTO_STARTS if self.start == "auto" else () if self.start == "mean" else (self.start,)
        reads: list[tuple[float, str, torch.Tensor]] = []
        for name in names:
            images, reason = self._read(name, model, update, meta)
            if images is None:
                notes.append(f"start: {name} failed ({reason})")
                continue
            theta = meta.normalize(images.to(self.device, _DT)).reshape(-1)
            with torch.no_grad():
                reads.append((float(residual(theta).pow(2).sum()), name, theta))
        if reads:
            value, name, theta = min(reads, key=lambda r: r[0])
            others = "; ".join(f"{n}'s {v:.4g}" for v, n, _ in reads if n != name)
            notes.append(f"start: {name}" + (f" (residual {value:.4g}; {others})" if others else ""))
            return theta, time.perf_counter() - t0
        notes.append("start: the mean image" + (" (every start failed)" if names else ""))
        # the normalisation mean colour is zero in model-input units
        return torch.zeros(math.prod(meta.image_size), dtype=_DT, device=self.device), time.perf_counter() - t0

    def _read(self, name: str, model: nn.Module, update: Update, meta: AttackMetadata
              ) -> tuple[Optional[torch.Tensor], str]:
        """(the start attacker ``name``'s images, "") or (None, its failure), computed once per update
        and options (the update's estimate store)."""
        from ..api.registry import attack_class, create_attack, option_schema

        options = self.start_options if name == self.start else {}
        if "device" in option_schema(attack_class(name)).model_fields:  # the start runs where the fit does
            options = {"device": str(self.device), **options}
        store, key = meta.estimates, dict(options, read="start")
        got = store.get(name, key) if store is not None else None
        if got is None:
            result = create_attack(name, **options).reconstruct(model, update, meta)
            failed = result.failed or any(result.failed_images)
            got = (None, str(result.reason)) if failed else (result.images.detach().cpu(), "")
            if store is not None:
                store.put(name, key, got)
        return got

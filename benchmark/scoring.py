"""The scorer side of the benchmark: metrics of a reconstruction against the setting's reference,
and the model's top-1 on the setting's input (the Acc. column). Reads the ground truth that the
attacker never sees (:class:`clients.partition.PrivateBatch`).

:func:`round_top1` and :func:`score_round` are the pipeline's work on one round, as plain functions
of tensors (no threads, no Flower, no Ray): the top-1 columns of the round's updates, and the
:class:`~benchmark.rows.ResultRow` of every image one attacker reconstructed, under one setting."""
from __future__ import annotations

import logging
import time
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import metrics

from .errors import ConfigError
from .rows import ResultRow, RowContext, RowKey

_logger = logging.getLogger(__name__)

#: Per-image metrics stored in results.jsonl: the paper's five, the Hermitian FFT variant and
#: breaching's registered PSNR (computed where ``metrics.rpsnr`` is on; NaN columns otherwise).
ROW_METRICS = tuple(metrics.PAPER_METRICS) + ("fft2d_hermitian", "psnr_registered")
#: Image identifiability precision per image, by distance (``metrics.iip``; :meth:`Scorer.score`).
IIP_COLUMNS = ("iip_pixel", "iip_lpips")
#: Row metrics a run computes only when its config asks (``metrics.<key>``): their cost.
OPTIONAL_METRICS = {"psnr_registered": "rpsnr"}
#: The column of every scored row that holds :func:`flat_psnr` of its image.
FLAT_COLUMN = "flat_psnr"


def flat_psnr(reference: torch.Tensor, colour: Sequence[float]) -> torch.Tensor:
    """[B] PSNR (dB) of a flat image of ``colour`` against each reference image [B, C, H, W] in [0, 1].

    With ``colour`` the model's normalisation mean (the zero of its input) this is what a
    reconstruction scores without reading the update at all: the floor each row's PSNR is read
    against (an attack at or below it recovered nothing measurable). Scored by the same PSNR as the
    rows (:func:`metrics.score_all`), in float64.

    Raises:
        ValueError: ``colour`` does not have one value in [0, 1] per channel of ``reference``.
    """
    ref = reference.detach().to("cpu", torch.float64)
    values = torch.as_tensor(tuple(colour), dtype=torch.float64)
    if values.shape != (ref.shape[1],) or not bool(((values >= 0) & (values <= 1)).all()):
        raise ValueError(f"flat colour {tuple(colour)}: need {ref.shape[1]} values in [0, 1], one per channel")
    flat = values.view(1, -1, 1, 1).expand_as(ref).contiguous()
    return metrics.score_all(flat, ref, ["psnr"])["psnr"]


class Scorer:
    """Builds LPIPS once and scores batches.

    LPIPS weights come from ``metrics.lpips_backbone`` when the config names a file, else from the
    metrics package's route (``$FEDMJP_LPIPS_BACKBONE``, ``$FEDMJP_DATA/lpips``, torchvision's
    cache or download); the features of images scored before are reused (:class:`metrics.LpipsFeatureCache`,
    ``$FEDMJP_LPIPS_CACHE_MB``). Where none can be had, the run goes on without LPIPS: one warning, the rows
    carry ``lpips`` NaN and ``lpips_note`` with the reason, and the table says why the column is empty.

    Args:
        device: where LPIPS runs.
        options: the config's ``metrics`` section (``lpips``, ``lpips_backbone``).
    Raises:
        ConfigError: the config names an LPIPS weights file that cannot be used, or
            ``FEDMJP_LPIPS_CACHE_MB`` is not a whole number >= 0.
    """

    def __init__(self, device: torch.device, options: Mapping[str, Any]) -> None:
        try:
            cache_mb = metrics.cache_budget_mb()
        except ValueError as err:
            raise ConfigError(str(err)) from err
        self.names = [m for m in ROW_METRICS if (m != "lpips" or options.get("lpips", True))
                      and (m not in OPTIONAL_METRICS or options.get(OPTIONAL_METRICS[m], False))]
        self.lpips_model = None
        self.lpips_cache: metrics.LpipsFeatureCache | None = None
        self.lpips_source: str | None = None
        self.lpips_note: str | None = None
        self.iip: list[str] = list(options.get("iip", ()))
        self.pool: tuple[torch.Tensor, torch.Tensor] | None = None
        if "lpips" in self.names:
            backbone = options.get("lpips_backbone")
            try:
                self.lpips_model = metrics.get_lpips_model(device, backbone)
                self.lpips_source = metrics.lpips_source(self.lpips_model)
                self.lpips_cache = metrics.LpipsFeatureCache(self.lpips_model, cache_mb)
            except metrics.LpipsUnavailable as err:
                if backbone:  # the user named a file: theirs to fix, not a missing download
                    raise ConfigError(f"LPIPS: {err} (metrics.lpips_backbone={backbone!r}; or --set "
                                      "metrics.lpips=false to leave the column out)") from err
                self.names.remove("lpips")
                self.lpips_note = f"LPIPS not computed: {' '.join(str(err).split())}"
                _logger.warning("%s; the run goes on without the LPIPS column", self.lpips_note)

    def set_pool(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """The candidates of the identifiability columns: the run's whole image set (every client's
        private images, attacked or not) with its labels."""
        self.pool = (images.detach().float().cpu(), labels.detach().cpu())

    def score(self, setting: str, reconstruction: torch.Tensor, x: torch.Tensor,
              x_tilde: torch.Tensor | None, labels: torch.Tensor | None = None) -> list[dict[str, Any]]:
        """One dict per image: every metric (NaN where failed), ``failed`` and ``failure``, and
        where a pool is set (:meth:`set_pool`) and ``labels`` given, in settings (a) and (c), the
        identifiability columns: ``iip_<distance>`` 1.0 where the reconstruction's nearest image of its
        label in the pool is its own (:func:`metrics.identifiability.identified`), and
        ``iip_candidates``, how many competed (the chance level is one over it).

        Args:
            reconstruction, x, x_tilde: [B, 3, H, W] in [0, 1]; x_tilde None for setting (a).
            labels: [B] the images' labels.
        """
        rows = metrics.score(setting, reconstruction.float().cpu(), x.float().cpu(),
                             None if x_tilde is None else x_tilde.float().cpu(),
                             metrics=self.names, lpips_model=self.lpips_model, lpips_cache=self.lpips_cache)
        keep = set(self.names) | {"failed", "failure", "clamped"}
        out = [{k: v for k, v in r.items() if k in keep} for r in rows]
        if self.lpips_note is not None:
            for r in out:
                r["lpips"], r["lpips_note"] = float("nan"), self.lpips_note
        if self.pool is not None and labels is not None and self.iip and setting != "b":
            self._identify(out, reconstruction, x, labels)
        return out

    def _identify(self, out: list[dict[str, Any]], reconstruction: torch.Tensor, x: torch.Tensor,
                  labels: torch.Tensor) -> None:
        """The identifiability columns of :meth:`score` (x is the truth: the pool holds x, not x~)."""
        from metrics.identifiability import identified

        assert self.pool is not None
        ok = [i for i, r in enumerate(out) if not r["failed"]]
        for r in out:
            r.update({f"iip_{d}": float("nan") for d in self.iip})
        if not ok:
            return
        idx = torch.tensor(ok)
        rec = torch.nan_to_num(reconstruction.detach().float().cpu()[idx]).clamp(0.0, 1.0)
        for d in self.iip:
            if d == "lpips" and self.lpips_model is None:
                continue  # no LPIPS weights: the column stays NaN, as the LPIPS column does
            hit, counts = identified(rec, x.float().cpu()[idx], self.pool[0], labels=labels.cpu()[idx],
                                     pool_labels=self.pool[1], distance=d, lpips_model=self.lpips_model,
                                     lpips_cache=self.lpips_cache)
            for j, i in enumerate(ok):
                out[i][f"iip_{d}"], out[i]["iip_candidates"] = float(hit[j]), int(counts[j])


def pair_reconstructions(reconstruction: torch.Tensor, reference: torch.Tensor,
                         failed: list[bool] | None = None) -> list[int]:
    """Which reconstruction belongs to which true image of a batch.

    An attack need not return its batch in the client's order (breaching's adapter sorts by label,
    optimisation attacks have no order at all). As breaching's ``order_batch`` does, solve a minimum
    total pixel-MSE assignment (``scipy.optimize.linear_sum_assignment``) between reconstructions and
    references; non-finite and failed reconstructions cost the most, so they take the references
    that no usable reconstruction is paired with.

    Args:
        reconstruction, reference: [B, 3, H, W].
        failed: per-reconstruction failure flags (the attack's), or None.
    Returns:
        ``order`` of length B: reconstruction ``order[b]`` is scored against reference ``b``.
    """
    from scipy.optimize import linear_sum_assignment

    rec = torch.nan_to_num(reconstruction.detach().double().cpu().flatten(1), nan=1e3, posinf=1e3, neginf=-1e3)
    ref = reference.detach().double().cpu().flatten(1)
    if rec.shape != ref.shape:
        raise ValueError(f"{rec.shape[0]} reconstructions of {rec.shape[1]} values for {ref.shape[0]} references "
                         f"of {ref.shape[1]}: an attack must return one image per image of the batch")
    cost = torch.cdist(ref, rec).pow(2) / ref.shape[1]  # cost[b, j]: reference b vs reconstruction j
    if failed is not None:
        # a flat cost above any pixel MSE of images in [0, 1]: failed ones get the leftovers
        cost[:, torch.tensor([bool(f) for f in failed], dtype=torch.bool)] = 1e6
    rows, cols = linear_sum_assignment(cost.numpy())
    return [int(c) for c in cols[rows.argsort()]]


def label_accuracy(true: torch.Tensor, used: torch.Tensor | None) -> float:
    """Fraction of a batch's labels [n] that the attack's label multiset [n] holds (order-free: a
    summed update has no order); NaN where the attack reports no labels."""
    if used is None or used.numel() != true.numel():
        return float("nan")
    t = torch.bincount(true.long().cpu(), minlength=1)
    u = torch.bincount(used.long().cpu(), minlength=1)
    k = max(t.numel(), u.numel())
    t, u = _pad_counts(t, k), _pad_counts(u, k)
    return float(torch.minimum(t, u).sum()) / max(true.numel(), 1)


def _pad_counts(counts: torch.Tensor, k: int) -> torch.Tensor:
    return torch.cat([counts, counts.new_zeros(k - counts.numel())])


def batch_columns(ctx: RowContext, batch: Any, result: Any) -> dict[str, Any]:
    """The batch columns of a row: the federation's ``batch_size``, ``local_steps`` and ``labels``
    (threat model), how reconstructions were paired with images (``assignment``:
    ``linear_sum_assignment`` on per-pair pixel MSE for a batch, ``single`` at batch 1) and the
    ``label_accuracy`` of the labels the attack used (1 where they were given)."""
    n = len(batch.image_ids)
    out = dict(ctx.federation)
    out["assignment"] = "linear_sum_assignment" if n > 1 else "single"
    out["label_accuracy"] = label_accuracy(batch.labels, getattr(result, "labels", None))
    return out


@torch.no_grad()
def top1(model: nn.Module, batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 correctness of ``model`` on the batch's model input (x, or x~ with E_unk at the
    shuffled positions): ([B] float 0/1, [B] predicted class)."""
    from fedmjp.factory import model_input

    x = model_input(model, batch.model_input.to(device))
    mask = batch.unk_mask
    logits = model(x) if mask is None else model(x, unk_mask=mask.to(device))
    pred = logits.argmax(dim=-1).cpu()
    return (pred == batch.labels.cpu()).float(), pred


#: Top-two margin (in probability) below which :func:`prediction_from_gradient` declines: the
#: read-out p_y = g_y + 1 is exact to half an ulp of 1 in float32 (6e-8), other entries exactly;
#: float32 softmax ties (logits within ~1e-7) show up as a zero margin.
GRADIENT_MARGIN = 1e-6


def classifier_bias_name(model: nn.Module) -> str | None:
    """Parameter name of the classifier's bias (``head.bias`` for timm ViTs), or None if it has none."""
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear) or head.bias is None:
        return None
    return next((f"{name}.bias" for name, module in model.named_modules() if module is head), None)


def prediction_from_gradient(bias_grad: torch.Tensor, label: int) -> int | None:
    """The class a model predicted for one image, read off its cross-entropy gradient.

    For one image, dL/db of the classifier bias is softmax(logits) - onehot(label), so p = g + e_y
    is the model's output distribution and argmax p its prediction, with no forward pass (iDLG
    reads the label off the same vector). Here the server knows the label and the gradient is the
    client's own, so this is the client model's prediction on exactly the input it saw.

    Args:
        bias_grad: [K] gradient of the classifier bias for a single image.
        label: the image's true class.
    Returns:
        The predicted class, or None where the read-out is not safe: p is not a distribution
        (not a plain single-image cross-entropy gradient: a defence, another loss) or its top two
        are within :data:`GRADIENT_MARGIN` (rounding could swap them). Callers fall back to a forward.
    """
    p = bias_grad.detach().to("cpu", torch.float64).flatten().clone()
    if not 0 <= label < p.numel():
        return None
    p[label] += 1.0
    if not bool(torch.isfinite(p).all()) or float(p.min()) < -GRADIENT_MARGIN or abs(float(p.sum()) - 1.0) > 1e-4:
        return None
    top = p.topk(min(2, p.numel())).values
    if top.numel() > 1 and float(top[0] - top[1]) <= GRADIENT_MARGIN:
        return None
    return int(p.argmax())


@torch.no_grad()
def top1_many(model: nn.Module, batches: list, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`top1` of several batches in one forward pass (one per batch costs more on a CPU):
    per batch, ([B] float 0/1, [B] predicted class). The batches' masks are all None or all [B, N]."""
    from types import SimpleNamespace

    masks = [b.unk_mask for b in batches]
    joined = SimpleNamespace(model_input=torch.cat([b.model_input for b in batches]),
                             unk_mask=None if masks[0] is None else torch.cat(masks),
                             labels=torch.cat([b.labels for b in batches]))
    correct, pred = top1(model, joined, device)
    sizes = [len(b.labels) for b in batches]
    return list(correct.split(sizes)), list(pred.split(sizes))


# ------------------------------------------------------------------------------------ one round
@dataclass
class RoundTop1:
    """The top-1 columns of a round's updates, one [B] tensor per update: ``correct`` and ``pred``
    of the model as trained (the Acc. column), ``correct_attacked`` of the model the attacks saw."""

    correct: list[torch.Tensor]
    pred: list[torch.Tensor]
    correct_attacked: list[torch.Tensor]

    def take(self, positions: Sequence[int]) -> RoundTop1:
        """The columns of the updates at ``positions``."""
        return RoundTop1([self.correct[i] for i in positions], [self.pred[i] for i in positions],
                         [self.correct_attacked[i] for i in positions])


def round_top1(model: nn.Module, acc_model: nn.Module | None, updates: Sequence[Any], batches: Sequence[Any],
               device: torch.device, readout: str | None = None) -> tuple[RoundTop1, int]:
    """Top-1 of the attacked model (its weights of the round loaded) on each update's input, and of
    the model as trained (``acc_model``, when the attacked one is a modified copy; else the same).

    A plain FedSGD gradient of one image already holds the prediction the client's model made
    (:func:`prediction_from_gradient`): with ``readout`` (the classifier bias's parameter name,
    given only for plain FedSGD updates without a defence) it is read there, and a forward runs
    only for the updates where that is not exact (batches of several images, FedAvg deltas, near ties).

    Args:
        updates: the round's tapped updates (``kind`` and ``arrays`` are read).
        batches: each update's private batch.
    Returns:
        The columns and how many updates needed a forward of the attacked model.
    """
    preds: list[torch.Tensor | None] = [None] * len(updates)
    if readout is not None:
        for i, (u, batch) in enumerate(zip(updates, batches)):
            grad = u.arrays.get(readout)
            if u.kind == "gradients" and len(batch.labels) == 1 and grad is not None:
                got = prediction_from_gradient(grad, int(batch.labels[0]))
                preds[i] = None if got is None else torch.tensor([got])
    todo = [i for i, p in enumerate(preds) if p is None]
    if todo:
        _, forward = top1_many(model, [batches[i] for i in todo], device)
        for i, p in zip(todo, forward):
            preds[i] = p
    pred_attacked = [p for p in preds if p is not None]
    correct_attacked = [(p == b.labels.cpu()).float() for p, b in zip(pred_attacked, batches)]
    if acc_model is None:
        correct, pred = correct_attacked, pred_attacked
    else:
        correct, pred = top1_many(acc_model, list(batches), device)
    return RoundTop1(correct, pred, correct_attacked), len(todo)


@dataclass(frozen=True)
class ScoredImage:
    """A scored row and the reconstruction it was scored on ([3, H, W], paired with the row's image:
    what the grids show)."""

    row: ResultRow
    reconstruction: torch.Tensor


def score_round(ctx: RowContext, attacker: tuple[str, str], setting: str, updates: Sequence[Any],
                batches: Sequence[Any], results: Sequence[Any], top1: RoundTop1, scorer: Scorer, patch: int,
                t_attack: float, skip: Container[RowKey] = (), grid_ids: Container[str] = ()) -> list[ScoredImage]:
    """The rows of one attacker's results on a round's updates under setting ``setting``.

    Each update's reconstructions are paired with its true images (:func:`pair_reconstructions`),
    all of them are scored in one :meth:`Scorer.score` call, and the updates with shuffled patches
    get the per-region scores (settings b and c; :func:`metrics.regions.region_scores`). Setting (c)
    is scored on an MJP-aware attack's estimate of x (``unshuffled``) where it has one. Where
    ``ctx.flat_colour`` is set, every row also gets ``flat_psnr``: :func:`flat_psnr` of that colour
    against the same reference image as the row's own scores (x~ in b, x in a and c).

    Args:
        ctx: what the federation's rows share.
        attacker: (label, registry name).
        updates, batches, results: aligned: the tapped updates attacked, their private batches,
            the attack's result for each (:class:`attacks.api.base.AttackResult`).
        top1: the top-1 columns of these updates (:func:`round_top1`).
        patch: the model's patch side in pixels (for the region scores).
        t_attack: attack seconds per image (the ``time_attack_s`` column).
        skip: keys of rows already stored (not returned).
        grid_ids: images whose PNGs the grids show (``image_stored``).
    Returns:
        One :class:`ScoredImage` per image not in ``skip``, in (update, batch index) order.
    """
    from metrics.regions import region_scores

    label, name = attacker
    recons, refs, estimates, orders = [], [], [], []
    for batch, result in zip(batches, results):
        estimate = "unshuffled" if (setting == "c" and result.unshuffled is not None) else "images"
        recon = result.unshuffled if estimate == "unshuffled" else result.images
        reference = batch.shuffled if setting == "b" else batch.images
        order = pair_reconstructions(recon, reference, result.failed_images) if len(batch.image_ids) > 1 else [0]
        recons.append(recon[order])
        refs.append(reference)
        estimates.append(estimate)
        orders.append(order)
    t_score = time.perf_counter()
    flat = None if ctx.flat_colour is None else flat_psnr(torch.cat(refs), ctx.flat_colour)
    x = torch.cat([b.images for b in batches])
    xs = None if batches[0].shuffled is None else torch.cat([b.shuffled for b in batches])
    scores = scorer.score(setting, torch.cat(recons), x, xs, torch.cat([b.labels for b in batches]))
    regions: dict[int, dict] = {}
    with_mask = [j for j, b in enumerate(batches) if setting in ("b", "c") and b.unk_mask is not None
                 and bool(b.unk_mask.any())]
    if with_mask:
        got = region_scores(torch.cat([recons[j] for j in with_mask]).float().cpu(),
                            torch.cat([refs[j] for j in with_mask]).float().cpu(),
                            torch.cat([batches[j].unk_mask for j in with_mask]).cpu(), patch)
        start = 0
        for j in with_mask:
            n = len(batches[j].image_ids)
            regions[j] = {k: v[start:start + n] for k, v in got.items()}
            start += n
    t_score = (time.perf_counter() - t_score) / max(sum(len(b.image_ids) for b in batches), 1)
    out = []
    start = 0
    for j, (update, batch, result) in enumerate(zip(updates, batches, results)):
        rnd, part = int(update.server_round), int(update.partition_id)
        defence = ctx.defence_columns(update.metrics)
        for b, image_id in enumerate(batch.image_ids):
            metric_row = scores[start + b]
            if RowKey(ctx.model, label, setting, rnd, part, b, image_id) in skip:
                continue
            jj = orders[j][b]  # the reconstruction paired with image b
            stats = dict(result.stats[jj]) if jj < len(result.stats) else {}
            attack_failed = bool(result.failed or stats.get("failed", False))
            reason = (result.reason or stats.get("reason")) if attack_failed else metric_row["failure"]
            row_scores = {k: v for k, v in metric_row.items() if k not in ("failed", "failure")}
            if j in regions:
                row_scores.update({k: float(v[b]) for k, v in regions[j].items()})
            if flat is not None:  # the image's own floor: no reconstruction enters it, so failed rows have it too
                row_scores[FLAT_COLUMN] = float(flat[start + b])
            row = ResultRow(
                model=ctx.model, label=ctx.label, trained=ctx.trained, arch=ctx.arch, variant=ctx.variant,
                april=ctx.april, setting=setting, group=ctx.group, round=rnd, partition_id=part,
                node_id=int(update.node_id), batch_index=b, image_id=image_id,
                image_index=ctx.image_index.get(image_id, int(batch.indices[b])), image_class=int(batch.labels[b]),
                pred=int(top1.pred[j][b]), correct=float(top1.correct[j][b]),
                correct_attacked_model=float(top1.correct_attacked[j][b]), gamma=float(batch.gamma),
                attack=label, attack_name=name, seed=ctx.seed, recon_index=int(jj), scored_estimate=estimates[j],
                scores=row_scores, failed=bool(attack_failed or metric_row["failed"]), reason=reason,
                error=attack_failed and result.error is not None,
                attack_stats={k: v for k, v in stats.items() if k not in ("failed", "reason")},
                time_attack_s=t_attack, time_score_s=t_score, image_stored=image_id in grid_ids, **defence,
                extra=batch_columns(ctx, batch, result))
            out.append(ScoredImage(row, recons[j][b]))
        start += len(batch.image_ids)
    return out

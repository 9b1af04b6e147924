"""The scorer side of the benchmark: metrics of a reconstruction against the setting's reference,
and the model's top-1 on the setting's input (the Acc. column). Reads the ground truth that the
attacker never sees (:class:`clients.partition.PrivateBatch`)."""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

import metrics

from .errors import ConfigError

_logger = logging.getLogger(__name__)

#: Per-image metrics stored in results.jsonl: the paper's five plus the Hermitian FFT variant.
ROW_METRICS = tuple(metrics.PAPER_METRICS) + ("fft2d_hermitian",)


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
        self.names = [m for m in ROW_METRICS if m != "lpips" or options.get("lpips", True)]
        self.lpips_model = None
        self.lpips_cache: Optional[metrics.LpipsFeatureCache] = None
        self.lpips_source: Optional[str] = None
        self.lpips_note: Optional[str] = None
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

    def score(self, setting: str, reconstruction: torch.Tensor, x: torch.Tensor,
              x_tilde: Optional[torch.Tensor]) -> list[dict[str, Any]]:
        """One dict per image: every metric (NaN where failed), ``failed`` and ``failure``.

        Args:
            reconstruction, x, x_tilde: [B, 3, H, W] in [0, 1]; x_tilde None for setting (a).
        """
        rows = metrics.score(setting, reconstruction.float().cpu(), x.float().cpu(),
                             None if x_tilde is None else x_tilde.float().cpu(),
                             metrics=self.names, lpips_model=self.lpips_model, lpips_cache=self.lpips_cache)
        keep = set(self.names) | {"failed", "failure", "clamped"}
        out = [{k: v for k, v in r.items() if k in keep} for r in rows]
        if self.lpips_note is not None:
            for r in out:
                r["lpips"], r["lpips_note"] = float("nan"), self.lpips_note
        return out


def pair_reconstructions(reconstruction: torch.Tensor, reference: torch.Tensor,
                         failed: Optional[list[bool]] = None) -> list[int]:
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


def classifier_bias_name(model: nn.Module) -> Optional[str]:
    """Parameter name of the classifier's bias (``head.bias`` for timm ViTs), or None if it has none."""
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear) or head.bias is None:
        return None
    return next((f"{name}.bias" for name, module in model.named_modules() if module is head), None)


def prediction_from_gradient(bias_grad: torch.Tensor, label: int) -> Optional[int]:
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

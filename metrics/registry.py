"""Name -> metric table, the direction of each metric, and the paper's column order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import functools

from .fourier import fft2d, fft2d_clamped, fft2d_hermitian
from .perceptual import lpips
from .pixel import mse, psnr, ssim
from .quantize import SUFFIX_8BIT, quantize_8bit
from .registered import psnr_registered
from .structural import ssim_official

#: ``(reconstruction [B,3,H,W], reference [B,3,H,W]) -> [B] float64``.
MetricFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Metric:
    """One metric of the privacy table.

    Attributes:
        name: registry key and result-row field.
        fn: the per-image function.
        label: column heading in tables.
        higher_is_more_private: direction of privacy (True: a higher value = a worse reconstruction).
    """

    name: str
    fn: MetricFn
    label: str
    higher_is_more_private: bool

    @property
    def most_leaked(self) -> str:
        """The pandas aggregate that picks a group's most-leaked image: ``"min"`` where a higher value
        is more private (MSE, LPIPS, FFT2D), ``"max"`` otherwise (PSNR, SSIM)."""
        return "min" if self.higher_is_more_private else "max"

    @property
    def arrow(self) -> str:
        """Arrow pointing towards "more private"."""
        return "↑" if self.higher_is_more_private else "↓"


def on_8bit(fn: MetricFn) -> MetricFn:
    """``fn`` computed on both images after :func:`metrics.quantize_8bit` (as on saved PNGs).

    The reconstruction is clipped to [0, 1] first (as ``save_image`` clamps); keyword arguments
    (e.g. ``model=`` for LPIPS) pass through.
    """

    @functools.wraps(fn)
    def wrapped(reconstruction: torch.Tensor, reference: torch.Tensor, **kwargs) -> torch.Tensor:
        return fn(quantize_8bit(reconstruction.clamp(0.0, 1.0)), quantize_8bit(reference), **kwargs)

    wrapped.__name__ = f"{fn.__name__}{SUFFIX_8BIT}"
    return wrapped


_BASE: tuple[Metric, ...] = (
    Metric("mse", mse, "MSE", True),
    Metric("fft2d", fft2d, "FFT2D", True),
    Metric("psnr", psnr, "PSNR", False),
    Metric("ssim", ssim, "SSIM", False),
    Metric("lpips", lpips, "LPIPS", True),
    Metric("fft2d_hermitian", fft2d_hermitian, "FFT2D-H", False),
    # The official MJP evaluation's definitions, named apart from ours (docs/design.md, "Image metrics").
    Metric("ssim_official", ssim_official, "SSIM (official)", False),
    Metric("fft2d_clamped", fft2d_clamped, "FFT2D (clamped)", True),
    # breaching's registered PSNR (metrics/registered.py): the PSNR after a similarity alignment
    Metric("psnr_registered", psnr_registered, "rPSNR", False),
)
#: Metrics on 8-bit images (saved-PNG round trip) for the paper's five and the official variants.
_ON_8BIT = ("mse", "fft2d", "psnr", "ssim", "lpips", "ssim_official", "fft2d_clamped")

METRICS: dict[str, Metric] = {m.name: m for m in _BASE}
METRICS.update(
    {
        f"{n}{SUFFIX_8BIT}": Metric(f"{n}{SUFFIX_8BIT}", on_8bit(METRICS[n].fn), f"{METRICS[n].label} 8-bit",
                                    METRICS[n].higher_is_more_private)
        for n in _ON_8BIT
    }
)

#: The five metrics of the paper's privacy table (Table 5), in its column order.
PAPER_METRICS: tuple[str, ...] = ("mse", "fft2d", "psnr", "ssim", "lpips")
#: Table columns in the paper's order: the model's top-1 accuracy under the setting's input, then
#: the metrics. Key "acc" is the accuracy field of a result row (filled by the benchmark, not here).
PAPER_COLUMN_ORDER: tuple[str, ...] = ("acc",) + PAPER_METRICS
#: Column headings with arrows: for Acc. higher = more useful; for the metrics, the arrow points to
#: "more private" (higher MSE/FFT2D/LPIPS, lower PSNR/SSIM).
PAPER_COLUMN_LABELS: dict[str, str] = {"acc": "Acc. ↑", **{k: f"{m.label} {m.arrow}" for k, m in METRICS.items()}}


def get_metric(name: str) -> Metric:
    """The registered metric called ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; valid metrics: {', '.join(METRICS)}") from None

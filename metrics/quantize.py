"""8-bit quantisation as saving to PNG does, so that any metric can be computed on 8-bit images.

The official MJP evaluation scripts read reconstructions back from saved PNGs (``transforms.ToTensor``
on Pillow's decoded image), and those PNGs come from ``torchvision.utils.save_image``, which computes
``x * 255 + 0.5``, clamps to [0, 255] and converts to uint8 (truncation, i.e. round half up for
values in range). :func:`quantize_8bit` reproduces that save-and-reload round trip in memory.
"""
from __future__ import annotations

import torch

#: Suffix of the registry names of metrics computed on 8-bit images (``psnr_8bit``, ...).
SUFFIX_8BIT = "_8bit"


def quantize_8bit(images: torch.Tensor) -> torch.Tensor:
    """Round-trip through 8 bits as ``save_image`` -> PNG -> ``ToTensor`` would.

    Args:
        images: [..., H, W] floating point, meant to be in [0, 1] (out-of-range values are clamped,
            NaN stays NaN).
    Returns:
        Same shape and dtype: ``floor(clamp(x * 255 + 0.5, 0, 255)) / 255``, computed in the input's
        dtype as torchvision does (float32 for float32 input: identical to the saved PNG).
    Raises:
        ValueError: ``images`` is not a floating-point tensor.
    """
    if not isinstance(images, torch.Tensor) or not images.is_floating_point():
        got = images.dtype if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"quantize_8bit needs a floating-point tensor in [0, 1], got {got}")
    return images.mul(255).add_(0.5).clamp_(0, 255).floor_().div_(255)

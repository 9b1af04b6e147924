"""Build benchmark models from a plain-data spec (YAML rows, Flower run configs).

A spec is a mapping::

    name: DeiT+MJP          # row name in tables
    arch: mjp_vit_cifar_patch4_32   # a registered mjp_* timm model
    variant: mjp            # see fedmjp.models.VARIANTS
    kwargs: {embed_dim: 192}  # timm / MJP constructor arguments
    checkpoint: null        # path, or null for a seeded fresh initialisation ("untrained")
    april: trained          # null | trained (design-A block 0 built in) | surgery (applied after loading)
    seed: 0                 # seed of the fresh initialisation
"""
from __future__ import annotations

import copy
import functools
import json
import logging
import os
import threading
from typing import Any, Mapping, Sequence

import cachetools
import timm
import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from . import models  # noqa: F401  (registers the mjp_* models)
from .checkpoint import load_checkpoint
from . import plugins
from .models import VARIANTS, april_surgery, model_plugin

_logger = logging.getLogger(__name__)

APRIL_MODES = (None, "trained", "surgery")
SPEC_KEYS = ("name", "arch", "variant", "kwargs", "checkpoint", "april", "seed")


def available_archs() -> list[str]:
    return sorted(timm.list_models("mjp_*"))


def validate_spec(spec: Mapping[str, Any]) -> None:
    """Raise ValueError naming the bad key/value of a model spec."""
    unknown = set(spec) - set(SPEC_KEYS)
    if unknown:
        raise ValueError(f"unknown model spec keys {sorted(unknown)}; valid: {', '.join(SPEC_KEYS)}")
    arch = spec.get("arch")
    if arch not in available_archs() and model_plugin(arch) is None:  # a plug-in: docs/plugins.md
        raise ValueError(f"unknown model arch {arch!r}; valid: {', '.join(available_archs())}, "
                         "or a plug-in's package.module:fn")
    variant = spec.get("variant", "plain")
    if variant not in VARIANTS:
        raise ValueError(f"unknown MJP variant {variant!r} in model {spec.get('name', arch)!r}; valid: {', '.join(VARIANTS)}")
    if spec.get("april") not in APRIL_MODES:
        raise ValueError(f"april must be one of null, trained, surgery; got {spec.get('april')!r}")
    if spec.get("kwargs") is not None and not isinstance(spec.get("kwargs"), Mapping):
        raise ValueError(f"model kwargs must be a mapping, got {spec.get('kwargs')!r}")


def create_model(arch: str, **kwargs: Any) -> nn.Module:
    """``timm.create_model(arch, pretrained=False, **kwargs)`` with the ``mjp_*`` models registered:
    the one place a model object is constructed (central training builds any timm ViT here; the
    benchmark goes through :func:`build_model`). Uses the global RNG for the fresh weights."""
    loaders = sorted(set(kwargs) & LOADER_KWARGS)
    if loaders:
        # timm.create_model reads these itself: checkpoint_path loads a file with timm's own loader
        # (outside fedmjp's weights_only load and the checkpoint hash in provenance), the others
        # fetch or describe pretrained weights. A row's checkpoint goes in its `checkpoint` key.
        raise ValueError(f"model kwargs {loaders} are not constructor arguments: name a checkpoint in the "
                         "model row's `checkpoint` key (train: `resume`/`initial_checkpoint`)")
    plugin = model_plugin(arch) if not timm.is_model(arch) else None
    # a plug-in's constructor that exits or raises its own KeyboardInterrupt is a PluginError naming it
    fn = functools.partial(plugins.call, f"model {arch!r}", plugin, pretrained=False) if plugin is not None else \
        functools.partial(timm.create_model, arch, pretrained=False)
    _check_model_memory(arch, fn, kwargs)
    try:
        return fn(**kwargs)
    except MemoryError:
        raise ValueError(f"model {arch!r} with kwargs {kwargs} does not fit in memory") from None
    except Exception as err:
        # A constructor's reaction to kwargs it cannot take (depth 0: IndexError, heads 0:
        # ZeroDivisionError, width not divisible: AssertionError, ...) is a config error naming them.
        raise ValueError(f"model {arch!r} cannot be built with kwargs {kwargs}: {type(err).__name__}: "
                         f"{' '.join(str(err).split()) or 'no message'}") from None


#: Keyword arguments of ``timm.create_model`` that load or describe weights, not build a model.
LOADER_KWARGS = frozenset({"checkpoint_path", "pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"})
#: Fraction of the machine's memory one model's parameters may take (its gradients, the optimiser's
#: state, the attack's copies and the clients' copies need the rest).
MODEL_MEMORY_FRACTION = 0.25
#: Tokens one image may make, ``(img_size / patch_size)**2`` patches plus the prefix tokens (class,
#: distillation, registers). Attention holds a T x T matrix per head and image (4,096 tokens: 64 MiB
#: per head in float32, before the attacks' double backward keeps several), so memory and time grow
#: with T^2: 1024 px at patch 4 (65,537 tokens) needs 16 GiB per head. Every shipped preset is far
#: below (224 px at patch 16: 197 tokens; 32 px at patch 4: 65).
MAX_TOKENS = 4096


def _check_model_memory(arch: str, fn: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse kwargs whose model's parameters would take more than :data:`MODEL_MEMORY_FRACTION` of
    the available memory, counted on the meta device (no memory, no initialisation cost beyond
    shapes) before the real build allocates them (``embed_dim: 1e6`` would otherwise run the machine
    out of memory first); the same build's tokens per image are bounded (:func:`_check_tokens`)."""
    built: list[nn.Module] = []

    def count(**kw: Any) -> int:
        with torch.device("meta"):
            meta = fn(**kw)
        built.append(meta)
        return sum(p.numel() for p in meta.parameters()) + sum(b.numel() for b in meta.buffers())

    try:
        depth = kwargs.get("depth")
        if isinstance(depth, int) and depth > 2:
            # A ViT's size is linear in its depth; building a million blocks even on the meta
            # device takes minutes, so the count is extrapolated from depths 1 and 2.
            one, two = count(**{**kwargs, "depth": 1}), count(**{**kwargs, "depth": 2})
            numel = one + (depth - 1) * (two - one)
        else:
            numel = count(**kwargs)
    except Exception:  # noqa: BLE001 - a build that fails on meta fails the same way for real, with its message
        return
    _check_tokens(arch, built[-1], kwargs)
    # The machine's memory, not what is free now: a bound that does not move with other processes.
    need, memory = numel * 4, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > MODEL_MEMORY_FRACTION * memory:
        raise ValueError(f"model {arch!r} with kwargs {dict(kwargs)} has {numel:,} parameters ({need / 2**30:.1f} "
                         f"GiB in float32), more than {MODEL_MEMORY_FRACTION:.0%} of this machine's "
                         f"{memory / 2**30:.1f} GiB of memory; choose smaller kwargs (embed_dim, depth, mlp_ratio, "
                         "num_classes)")


def _check_tokens(arch: str, meta: nn.Module, kwargs: Mapping[str, Any]) -> None:
    """Refuse a model that makes more than :data:`MAX_TOKENS` tokens per image (its patch grid and
    prefix tokens, read from its meta-device build); a model without a timm-style ``patch_embed``
    (a plug-in) is left to the memory check."""
    patches = getattr(getattr(meta, "patch_embed", None), "num_patches", None)
    if not isinstance(patches, int):
        return
    prefix = getattr(meta, "num_prefix_tokens", 0)
    tokens = patches + (prefix if isinstance(prefix, int) else 0)
    if tokens > MAX_TOKENS:
        side = lambda v: "x".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)  # noqa: E731
        size, patch = side(getattr(meta.patch_embed, "img_size", "?")), side(getattr(meta.patch_embed, "patch_size", "?"))
        raise ValueError(f"model {arch!r} with kwargs {dict(kwargs)} makes {tokens:,} tokens per image "
                         f"({patches:,} patches of {patch} px in {size} px, {tokens - patches} prefix), more than "
                         f"{MAX_TOKENS:,} (fedmjp.factory.MAX_TOKENS: attention memory and time grow with the "
                         "square of the tokens); use smaller images (data.image_size and img_size) or a larger "
                         "patch_size")


def spec_kwargs(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The :func:`create_model` keyword arguments of a spec: its variant and kwargs, plus the
    design-A first block for ``april: trained``."""
    kwargs = {"variant": spec.get("variant", "plain"), **dict(spec.get("kwargs") or {})}
    if spec.get("april") == "trained":
        kwargs["first_block"] = "april"
    return kwargs


def build_model(spec: Mapping[str, Any], device: str | torch.device = "cpu") -> nn.Module:
    """Create the model a spec describes, in eval mode. Fresh weights are seeded by ``spec['seed']``."""
    validate_spec(spec)
    model = _fresh_model(spec["arch"], spec_kwargs(spec), int(spec.get("seed", 0)))
    if spec.get("checkpoint"):
        report = load_checkpoint(model, spec["checkpoint"])
        _logger.info("loaded %s%s", report.path, " (official MJP format)" if report.official_format else "")
    if spec.get("april") == "surgery":
        april_surgery(model)
    model.fedmjp_trained = bool(spec.get("checkpoint"))
    return model.to(device).eval()


#: Seeded fresh models by (arch, variant, kwargs, seed): a benchmark builds the same model in its
#: rows, in the server and in every client thread of every federation, and timm's initialisation
#: (trunc_normal_ over every weight) costs ~1 s for a DeiT-S on a CPU; even a meta-device build
#: filled from stored tensors cost ~0.5 s (timm's init runs through the meta dispatcher). A deep copy
#: of a stored template costs ~40 ms.
FRESH_TEMPLATES: cachetools.LRUCache = cachetools.LRUCache(maxsize=8)
_TEMPLATES_LOCK = threading.Lock()


def _fresh_model(arch: str, kwargs: Mapping[str, Any], seed: int) -> nn.Module:
    """:func:`create_model` with the weights seeded by ``seed`` (global RNG untouched): built once
    per key and kept as a template that nobody else holds; every call returns a deep copy of it
    (parameters, buffers, non-persistent ones too, and attributes), which equals a fresh build
    exactly and shares no storage with it."""
    key = json.dumps([arch, kwargs, seed], sort_keys=True, default=str)
    with _TEMPLATES_LOCK:
        template = FRESH_TEMPLATES.get(key)  # a hit counts as a use
    if template is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            template = create_model(arch, **kwargs)
        with _TEMPLATES_LOCK:
            FRESH_TEMPLATES[key] = template  # the least recently used template goes when 8 are held
    return copy.deepcopy(template)


def model_input_stats(model: nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) the model expects its input normalised with (ImageNet defaults)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return tuple(cfg.get("mean", IMAGENET_DEFAULT_MEAN)), tuple(cfg.get("std", IMAGENET_DEFAULT_STD))


def normalize(images: torch.Tensor, mean: Sequence[float] | torch.Tensor,
              std: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] images in [0, 1] -> model input ``(x - mean) / std``, in the images' dtype and
    device. ``mean``, ``std``: C values (sequences or tensors)."""
    # Straight to the images' dtype: a float32 detour would shift float64 inputs (APRIL's exact
    # closed form runs in float64) by the float32 rounding of 0.485 and friends.
    m = torch.as_tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - m) / s


def model_input(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] images in [0, 1] normalised as ``model`` expects (:func:`model_input_stats`)."""
    return normalize(images, *model_input_stats(model))

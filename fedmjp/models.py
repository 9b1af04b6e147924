"""MJP Vision Transformers built on timm's ``VisionTransformer`` through its override points.

Variants (the ablation table of the paper; docs/design.md, "MJP: selection, jigsaw, E_unk and DAL"):

========  =====  =======  =====================================================================
name      PE     shuffle  what the shuffled positions get
========  =====  =======  =====================================================================
plain     yes    no       (plain DeiT/ViT)
nope      no     no       (no position embedding at all)
jp        yes    yes      their own PE (the PE of the position they were moved to)
jp_idx    yes    yes      own PE, plus a second learnable absolute "index" embedding added at
                          every position (official ``use_idx_emb``)
jp_unk    yes    yes      the shared unknown embedding E_unk instead of the PE (Eq. 4)
mjp       yes    yes      E_unk, plus the DAL loss on the unshuffled positions' PEs
spp       yes    yes      every patch shuffled and the pixels inside patches permuted (baseline)
========  =====  =======  =====================================================================

``forward(x)`` never shuffles unless a plan or a mask is given (or ``auto_shuffle`` is set for a
training loop that calls ``forward``): models stay usable by timm, Flower and attack code as plain
classifiers. Training uses :meth:`MJPVisionTransformer.forward_mjp`, which draws the shuffle, applies
it as a token permutation, and returns the DAL loss beside the logits.
"""
from __future__ import annotations

import functools
import logging
import random
from dataclasses import dataclass
from typing import Callable, Literal, Optional, get_args

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, get_pretrained_cfg, register_model
from timm.models.vision_transformer import Block, VisionTransformer, checkpoint_filter_fn

from . import plugins
from .dal import DALHead, dal_loss, grid_targets
from .jigsaw import JigsawPlan, make_plan, make_spp_plan, shuffle_images, shuffle_tokens
from .masking import SeedLike, check_gamma, make_rng

_logger = logging.getLogger(__name__)

# Choices as Literal types (what a config schema and a type checker read) and tuples of their values
Variant = Literal["plain", "nope", "jp", "jp_idx", "jp_unk", "mjp", "spp"]
PeInit = Literal["timm", "official"]
FirstBlock = Literal["standard", "april"]
VARIANTS: tuple[str, ...] = get_args(Variant)
PE_INITS: tuple[str, ...] = get_args(PeInit)
FIRST_BLOCKS: tuple[str, ...] = get_args(FirstBlock)
_SHUFFLING = {"jp", "jp_idx", "jp_unk", "mjp", "spp"}
_UNK = {"jp_unk", "mjp"}


@dataclass
class MJPOutput:
    """Result of :meth:`MJPVisionTransformer.forward_mjp`.

    Attributes:
        logits: [B, num_classes].
        dal_loss: scalar tensor, or None for variants without DAL.
        plan: the shuffle applied this step, or None when the step was not shuffled.
    """

    logits: torch.Tensor
    dal_loss: Optional[torch.Tensor]
    plan: Optional[JigsawPlan]


class AprilBlock(Block):
    """APRIL's "design A" transformer block: no ``norm1`` and no residual around attention.

    The embedding Z = [prefix; W_e x + b_e] + P then feeds the qkv projection directly, which is
    what makes APRIL's closed-form attack exact (docs/design.md, "APRIL's closed form").
    """

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        x = self.drop_path1(self.ls1(self.attn(x, attn_mask=attn_mask, is_causal=is_causal)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def april_surgery(model: VisionTransformer, index: int = 0) -> VisionTransformer:
    """Turn block ``index`` of a (trained) timm ViT into design A in place, as breaching's
    ``vit_small_april`` does: drop ``norm1`` and the residual around attention. Parameter names of
    the block's other layers are unchanged."""
    if not 0 <= index < len(model.blocks):
        raise ValueError(f"april_surgery needs block {index}, but the model has {len(model.blocks)} block(s) "
                         "(model kwargs depth)")
    block = model.blocks[index]
    if isinstance(block, AprilBlock):
        return model
    if type(block) is not Block:
        raise ValueError(f"april_surgery supports timm's Block, got {type(block).__name__} at blocks.{index}")
    block.norm1 = nn.Identity()
    block.__class__ = AprilBlock
    return model


def is_april_model(model: nn.Module) -> bool:
    """True if block 0 is APRIL's design A."""
    blocks = getattr(model, "blocks", None)
    return blocks is not None and len(blocks) > 0 and isinstance(blocks[0], AprilBlock)


class MJPVisionTransformer(VisionTransformer):
    """timm ViT with the Masked Jigsaw Puzzle position embedding and its ablation variants.

    Args:
        variant: one of :data:`VARIANTS`.
        gamma: training shuffle ratio (share of patch positions selected per image), in [0, 1].
        per_sample: one mask per sample (True) or one shared by the batch (False, official).
        shuffle_prob: share of training steps that are shuffled (official code: ~0.5 after warm-up).
        dal_head: ``nln`` (paper default), ``ln`` or ``pca``; used by the ``mjp`` variant.
        dal_normalize: regress grid indices divided by the grid size instead of raw indices.
        pe_init: ``timm`` (trunc-normal 0.02, no weight decay) or ``official`` (N(0, 1), decayed).
        first_block: ``standard`` or ``april`` (design A, for APRIL's closed form).
        min_block, max_block: block area limits of the masking generator (official: 8 and 75).
        seed: seed of the model's own shuffle RNG (used by :meth:`forward_mjp`).
        **kwargs: timm ``VisionTransformer`` arguments (img_size, patch_size, embed_dim, ...).
    """

    def __init__(
        self,
        variant: str = "mjp",
        gamma: float = 0.27,
        per_sample: bool = False,
        shuffle_prob: float = 1.0,
        dal_head: str = "nln",
        dal_normalize: bool = False,
        pe_init: str = "timm",
        first_block: str = "standard",
        min_block: int = 8,
        max_block: Optional[int] = None,
        seed: Optional[int] = None,
        **kwargs,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown MJP variant {variant!r}; valid: {', '.join(VARIANTS)}")
        if pe_init not in PE_INITS:
            raise ValueError(f"unknown pe_init {pe_init!r}; valid: {', '.join(PE_INITS)}")
        if first_block not in FIRST_BLOCKS:
            raise ValueError(f"unknown first_block {first_block!r}; valid: {', '.join(FIRST_BLOCKS)}")
        img_size, patch_size = kwargs.get("img_size", 224), kwargs.get("patch_size", 16)
        for side in (img_size if isinstance(img_size, (tuple, list)) else (img_size, img_size)):
            if side % patch_size:
                raise ValueError(f"img_size {img_size} is not divisible by patch_size {patch_size}")
        depth = kwargs.get("depth", 12)
        if not (isinstance(depth, int) and depth >= 1):  # the attacks and APRIL read blocks[0]
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        if kwargs.get("no_embed_class") or kwargs.get("dynamic_img_size"):
            raise ValueError("MJP models need no_embed_class=False and dynamic_img_size=False")
        if variant == "nope":
            kwargs["pos_embed"] = "none"
        super().__init__(**kwargs)
        self.variant = variant
        self.gamma = check_gamma(gamma)
        self.per_sample = bool(per_sample)
        self.shuffle_prob = check_gamma(shuffle_prob, "shuffle_prob")
        self.pe_init = pe_init
        self.first_block = first_block
        self.min_block, self.max_block = min_block, max_block
        self.auto_shuffle = False
        self._rng = random.Random(seed)
        self.dal_normalize = dal_normalize
        D = self.embed_dim
        n_tokens = self.patch_embed.num_patches + self.num_prefix_tokens
        self.unk_embed = nn.Parameter(torch.zeros(1, 1, D)) if variant in _UNK else None
        self.index_embed = nn.Parameter(torch.zeros(1, n_tokens, D)) if variant == "jp_idx" else None
        self.dal_head = DALHead(D, dal_head) if variant == "mjp" else None
        self.register_buffer("dal_targets", grid_targets(self.grid_size, dal_normalize), persistent=False)
        self._init_mjp_params()
        if first_block == "april":
            april_surgery(self)

    # ----------------------------------------------------------------------------------- set-up
    @property
    def grid_size(self) -> tuple[int, int]:
        return tuple(self.patch_embed.grid_size)

    @property
    def patch_size(self) -> int:
        return int(self.patch_embed.patch_size[0])

    @property
    def shuffles(self) -> bool:
        """Whether this variant shuffles during training."""
        return self.variant in _SHUFFLING

    def _init_mjp_params(self) -> None:
        if self.pe_init == "official":
            # Official code: nn.Embedding default init N(0, 1) for PE and E_unk.
            for p in (self.pos_embed, self.unk_embed):
                if p is not None:
                    nn.init.normal_(p, std=1.0)
        else:
            for p in (self.unk_embed, self.index_embed):
                if p is not None:
                    trunc_normal_(p, std=0.02)
        if self.index_embed is not None and self.pe_init == "official":
            nn.init.zeros_(self.index_embed)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        names = set(super().no_weight_decay()) | {"index_embed"}
        if self.pe_init == "timm":
            names |= {"unk_embed"}
        else:
            names.discard("pos_embed")  # official: the PE table is an nn.Embedding with weight decay
        return names

    def set_seed(self, seed: int) -> None:
        """Reseed the model's own shuffle RNG (e.g. seed + rank under DDP)."""
        self._rng = random.Random(seed)

    # ----------------------------------------------------------------------------------- shuffle
    def draw_plan(self, batch_size: int, gamma: Optional[float] = None, seed: SeedLike = None,
                  per_sample: Optional[bool] = None) -> JigsawPlan:
        """Draw a shuffle for a batch at ``gamma`` (default: the training gamma).

        ``seed`` may be an int, a torch.Generator or a random.Random; None uses the model's RNG.
        """
        rng = self._rng if seed is None else make_rng(seed)
        per_sample = self.per_sample if per_sample is None else per_sample
        if self.variant == "spp":
            return make_spp_plan(batch_size, self.grid_size, self.patch_size, rng, per_sample)
        gamma = self.gamma if gamma is None else check_gamma(gamma)
        return make_plan(batch_size, self.grid_size, gamma, rng, per_sample, self.min_block, self.max_block)

    def shuffle_images(self, images: torch.Tensor, plan: JigsawPlan) -> torch.Tensor:
        """x -> x~ in pixel space, [B, C, H, W] -> [B, C, H, W]."""
        return shuffle_images(images, plan, self.patch_size)

    # ----------------------------------------------------------------------------------- forward
    def _pos_embed(self, x: torch.Tensor, unk_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Add prefix tokens and position embeddings; E_unk replaces the PE where ``unk_mask``.

        Args:
            x: patch tokens [B, N, D].
            unk_mask: [B, N] (or [B, prefix + N]) bool, True at shuffled positions.
        Returns:
            [B, prefix + N, D].
        """
        B = x.shape[0]
        to_cat = [t.expand(B, -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        x = torch.cat(to_cat + [x], dim=1) if to_cat else x
        if self.pos_embed is None:
            return self.pos_drop(x)
        pe = self.pos_embed
        P = self.num_prefix_tokens
        if unk_mask is not None and self.unk_embed is not None:
            unk_mask = self._check_mask(unk_mask, B)
            patch_pe = torch.where(unk_mask.unsqueeze(-1), self.unk_embed.to(pe.dtype), pe[:, P:])
            pe = torch.cat([pe[:, :P].expand(B, -1, -1), patch_pe], dim=1)
        if self.index_embed is not None:
            pe = pe + self.index_embed
        return self.pos_drop(x + pe)

    def _check_mask(self, mask: torch.Tensor, batch_size: int) -> torch.Tensor:
        N = self.patch_embed.num_patches
        if mask.dim() == 1:
            mask = mask.unsqueeze(0)
        if mask.shape[-1] == N + self.num_prefix_tokens:
            mask = mask[:, self.num_prefix_tokens:]  # official layout carries the cls position
        if mask.shape[-1] != N or mask.shape[0] not in (1, batch_size):
            raise ValueError(f"unk_mask must be [B, {N}] bool, got {tuple(mask.shape)}")
        return mask.to(device=self.pos_embed.device, dtype=torch.bool).expand(batch_size, -1)

    def forward_features(self, x: torch.Tensor, unk_mask: Optional[torch.Tensor] = None,
                         plan: Optional[JigsawPlan] = None) -> torch.Tensor:
        """Images [B, C, H, W] -> tokens [B, prefix + N, D].

        Args:
            unk_mask: positions of an *already shuffled* input that get E_unk.
            plan: a shuffle to apply here (token permutation; pixels for SPP); its mask then
                plays the role of ``unk_mask``.
        """
        if plan is not None and plan.pixel_perm is not None:
            x = shuffle_images(x, plan, self.patch_size)
        x = self.patch_embed(x)
        if plan is not None:
            if plan.pixel_perm is None:
                x = shuffle_tokens(x, plan)
            unk_mask = plan.mask
        x = self._pos_embed(x, unk_mask)
        x = self.patch_drop(x)
        x = self.norm_pre(x)
        x = self.blocks(x)
        return self.norm(x)

    def forward(self, x: torch.Tensor, unk_mask: Optional[torch.Tensor] = None,
                plan: Optional[JigsawPlan] = None) -> torch.Tensor:
        """Logits [B, num_classes]; shuffles only with a plan/mask (or ``auto_shuffle`` in training)."""
        if plan is None and unk_mask is None and self.auto_shuffle and self.training:
            plan = self._training_plan(x.shape[0])
        return self.forward_head(self.forward_features(x, unk_mask=unk_mask, plan=plan))

    def _training_plan(self, batch_size: int) -> Optional[JigsawPlan]:
        if not self.shuffles or self._rng.random() >= self.shuffle_prob:
            return None
        return self.draw_plan(batch_size)

    def forward_mjp(self, x: torch.Tensor, plan: Optional[JigsawPlan] = None) -> MJPOutput:
        """Training forward: draw a shuffle (train mode, shuffling variants, with probability
        ``shuffle_prob``) unless one is given, and compute the DAL loss."""
        if plan is None and self.training:
            plan = self._training_plan(x.shape[0])
        logits = self.forward_head(self.forward_features(x, plan=plan))
        loss = None
        if self.dal_head is not None:
            keep = None if plan is None else ~plan.mask.to(x.device)
            loss = self.compute_dal_loss(keep)
        return MJPOutput(logits, loss, plan)

    def compute_dal_loss(self, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """DAL loss on the patch PEs; ``keep`` [B, N] marks unshuffled positions (None: all)."""
        if self.dal_head is None or self.pos_embed is None:
            raise ValueError(f"variant {self.variant!r} has no DAL head")
        pe = self.pos_embed[0, self.num_prefix_tokens:]
        return dal_loss(self.dal_head(pe), self.dal_targets.to(pe.dtype), keep)


# --------------------------------------------------------------------------------- registration
_SIZES = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
}


# timm's builder: default cfgs registered under the MJP names (the DeiT weights' cfgs for the 224 px
# models, so ``pretrained=True`` downloads DeiT's and ``pretrained_cfg_overlay`` / ``features_only``
# work as for any timm model); the MJP-only parameters (E_unk, DAL head, index embedding) are
# missing from DeiT's weights and stay initialised (non-strict load).
def _deit_cfg(tag: str) -> dict:
    cfg = get_pretrained_cfg(tag)
    return cfg.to_dict() if cfg is not None else {}


default_cfgs = generate_default_cfgs({
    "mjp_deit_tiny_patch16_224.fb_in1k": _deit_cfg("deit_tiny_patch16_224.fb_in1k"),
    "mjp_deit_small_patch16_224.fb_in1k": _deit_cfg("deit_small_patch16_224.fb_in1k"),
    "mjp_deit_base_patch16_224.fb_in1k": _deit_cfg("deit_base_patch16_224.fb_in1k"),
    # No published weights: the cfg only records the input the model expects (ImageNet statistics,
    # as the CIFAR recipes normalise).
    "mjp_vit_cifar_patch4_32": {"url": "", "num_classes": 10, "input_size": (3, 32, 32), "pool_size": None,
                                "crop_pct": 1.0, "interpolation": "bicubic", "fixed_input_size": True,
                                "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
                                "first_conv": "patch_embed.proj", "classifier": "head"},
})


def _create(variant: str, pretrained: bool, defaults: dict, kwargs: dict) -> MJPVisionTransformer:
    """Build the model with timm's ``build_model_with_cfg``: ``pretrained=True`` loads timm's DeiT
    weights (needs a network), ``features_only=True`` gives timm's feature getter (blocks' outputs,
    ``out_indices``), ``pretrained_cfg_overlay`` changes the recorded cfg."""
    out_indices = kwargs.pop("out_indices", 3)
    if pretrained and not (default_cfgs[variant].default.url or default_cfgs[variant].default.hf_hub_id):
        raise ValueError(f"no pretrained weights exist for {variant}; use pretrained=False")
    # The MJP ``variant`` keyword would collide with the builder's ``variant`` (the model name).
    cls = functools.partial(MJPVisionTransformer, variant=kwargs.pop("variant")) if "variant" in kwargs else MJPVisionTransformer
    return build_model_with_cfg(cls, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                                pretrained_strict=False,
                                feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
                                **{**defaults, **kwargs})


@register_model
def mjp_deit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> MJPVisionTransformer:
    """DeiT-Ti/16 at 224 px with MJP (variant via ``variant=``)."""
    return _create("mjp_deit_tiny_patch16_224", pretrained, dict(patch_size=16, **_SIZES["tiny"]), kwargs)


@register_model
def mjp_deit_small_patch16_224(pretrained: bool = False, **kwargs) -> MJPVisionTransformer:
    """DeiT-S/16 at 224 px with MJP (the paper's main model)."""
    return _create("mjp_deit_small_patch16_224", pretrained, dict(patch_size=16, **_SIZES["small"]), kwargs)


@register_model
def mjp_deit_base_patch16_224(pretrained: bool = False, **kwargs) -> MJPVisionTransformer:
    """DeiT-B/16 at 224 px with MJP."""
    return _create("mjp_deit_base_patch16_224", pretrained, dict(patch_size=16, **_SIZES["base"]), kwargs)


@register_model
def mjp_vit_cifar_patch4_32(pretrained: bool = False, **kwargs) -> MJPVisionTransformer:
    """CIFAR-scale ViT for CPU work: 32 px, patch 4 (8x8 grid), width 192, depth 6, 10 classes."""
    defaults = dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3, num_classes=10)
    return _create("mjp_vit_cifar_patch4_32", pretrained, defaults, kwargs)


# --------------------------------------------------------------------------------- registry
# Built-in architectures are timm models (@register_model above); plug-in architectures from other
# packages are named by an entry point of group ``fedmjp.models`` or a ``package.module:fn``
# reference (fedmjp/plugins.py, docs/plugins.md) and imported when a model row names them.
def model_plugin(arch: str) -> Optional[Callable[..., nn.Module]]:
    """The model function a plug-in architecture name refers to, or None when ``arch`` is no plug-in
    name (a timm name, or unknown). Contract: ``fn(pretrained=False, **kwargs) -> nn.Module`` like a
    timm model function; it receives ``variant`` and the model row's ``kwargs``.

    Raises:
        ValueError (:class:`fedmjp.plugins.PluginError`): a plug-in that cannot be loaded or whose
            object is not callable.
    """
    plugin = plugins.find("model", arch)
    if plugin is None:
        return None
    fn = plugins.load("model", plugin)
    if not callable(fn):
        raise plugins.PluginError(f"model {arch!r}: {plugin.value} is not callable (got {type(fn).__name__})")
    return fn


def model_catalog() -> list[tuple[str, str]]:
    """(name, origin) of every architecture a model row can name: ``built-in`` (the ``mjp_*`` timm
    models) or the entry point's package and version."""
    import timm

    entries = plugins.entry_points("model")
    builtin = sorted(timm.list_models("mjp_*"))
    return [(n, "built-in") for n in builtin] + [(n, entries[n].origin) for n in sorted(entries) if n not in builtin]

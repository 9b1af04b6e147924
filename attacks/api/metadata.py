"""What a server passes with an update (:class:`AttackMetadata`: batch size, input size and
normalisation, labels, update type, the defence's spec) and the update read as gradients.

The benchmark builds :class:`AttackMetadata` typed; a plug-in's caller may pass a dict, read by
:meth:`AttackMetadata.parse` with every key checked like a config key (fedmjp.config).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal, Mapping, Optional, Union

import numpy as np
import torch
import torch.nn as nn
from pydantic import BeforeValidator, ConfigDict

from defences.spec import DefenceSpec, Observation, validate_defence
from fedmjp import config as core
from fedmjp.factory import normalize

from .errors import AttackFailure
from .estimates import EstimateStore

Update = Mapping[str, torch.Tensor]
#: What a server passes with an update: an :class:`AttackMetadata`, or a dict of its keys (read by
#: :meth:`AttackMetadata.parse`).
Metadata = Union["AttackMetadata", Mapping[str, Any]]


@dataclass
class AttackMetadata:
    """Parsed metadata a server sees with one update.

    Attributes:
        num_images: batch size of the update (default 1).
        image_size: (C, H, W) of the inputs.
        mean, std: [C] input normalisation; the model saw (x - mean) / std for x in [0, 1].
        labels: [num_images] long, if the threat model grants them; else None.
        update_type: ``gradient`` (FedSGD) or ``delta`` (FedAvg weight difference, local - global).
        lr, local_steps: local SGD hyper-parameters of a ``delta`` update.
        defence: the spec of the defence the client applied (a typed :class:`defences.spec.DefenceSpec`,
            ``spec.name``, ``spec.sigma``; the metadata may hold it as a mapping) when the server
            knows it, else None. Attacks that model a defence read its parameters here (Kerckhoffs's
            principle).
        defence_error: why the metadata's defence spec could not be read (an unknown name, a bad
            value), else None; ``defence`` is then None and attacks treat the defence as unknown.
        estimates: not something the server sees: the caller's store of what the attacks of this
            one update estimated (:class:`attacks.api.estimates.EstimateStore`), for one attack to
            start from another's estimate (``ig_closed_start`` from ``mjp_adaptive``'s x~); None:
            each attack computes its own. Never compared, never printed.
    """

    num_images: int
    image_size: tuple[int, int, int]
    mean: torch.Tensor
    std: torch.Tensor
    labels: Optional[torch.Tensor]
    update_type: str = "gradient"
    lr: Optional[float] = None
    local_steps: int = 1
    defence: Optional[DefenceSpec] = None
    defence_error: Optional[str] = None
    estimates: Optional[EstimateStore] = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, metadata: Union["AttackMetadata", Metadata, None], model: nn.Module) -> "AttackMetadata":
        """``metadata`` itself when typed (the benchmark builds it so: tensors stay tensors), else
        the dict read by :meth:`parse` (a plug-in's caller, a hand-written dict)."""
        return metadata if isinstance(metadata, AttackMetadata) else cls.parse(metadata, model)

    @classmethod
    def parse(cls, metadata: Optional[Mapping[str, Any]], model: nn.Module) -> "AttackMetadata":
        """Read the metadata dict (:class:`_MetadataSchema`; keys it does not name are ignored, for
        plug-in attacks to read). Missing entries default to batch 1, mean 0, std 1 and the model's
        input size (``model.patch_embed.img_size`` with ``patch_embed.proj.in_channels`` channels,
        3 if absent); a one-entry mean or std is repeated for every channel.

        Raises:
            AttackFailure: a value of the wrong type or out of range, naming the key and what it
                takes; labels not one per image; a ``delta`` update without a non-zero ``lr``. A
                defence spec that cannot be read is kept as ``defence_error`` instead.
        """
        try:
            md = core.parse(_MetadataSchema, {} if metadata is None else metadata, "metadata.")
        except core.ConfigError as err:
            raise AttackFailure(str(err)) from None
        # By hand what the schema cannot see: defaults and checks that depend on the model or on
        # another key, and length/range checks of the lists (fedmjp.config's messages name a
        # field's range, not that of a list's entries).
        n = md.num_images if md.num_images is not None else md.batch_size if md.batch_size is not None else 1
        size = _model_image_size(model) if md.image_size is None else tuple(md.image_size)
        if len(size) != 3 or min(size) < 1:
            raise _bad("image_size", "(C, H, W): three integers >= 1", list(size))
        mean = _per_channel("mean", md.mean, size[0], 0.0, "finite numbers", math.isfinite)
        std = _per_channel("std", md.std, size[0], 1.0, "finite numbers > 0", lambda v: 0.0 < v < math.inf)
        labels = None if md.labels is None else torch.tensor(md.labels, dtype=torch.long)
        if labels is not None and labels.numel() != n:
            raise _bad("labels", f"one label per image (num_images={n})", md.labels)
        if md.update_type == "delta" and not md.lr:
            raise _bad("lr", "the non-zero local learning rate of a 'delta' update", md.lr)
        defence, defence_error = md.defence, None
        try:
            defence = None if defence is None else validate_defence(defence)
        except ValueError as err:  # e.g. a plug-in defence the attacker's side does not have installed
            defence, defence_error = None, str(err)
        return cls(n, size, mean, std, labels, md.update_type, md.lr, md.local_steps, defence, defence_error)

    @property
    def gradient_scale(self) -> float:
        """The factor that turns this update's entries into gradient units: 1 for a FedSGD
        gradient; -1 / (lr * local_steps) for a FedAvg delta (local - global), exact after one local
        SGD step (-lr * grad), the mean gradient along the local trajectory after more."""
        if self.update_type == "gradient":
            return 1.0
        if not self.lr:
            raise _bad("lr", "the non-zero local learning rate of a 'delta' update", self.lr)
        return -1.0 / (float(self.lr) * max(self.local_steps, 1))

    def defence_noise(self, observation: Observation) -> tuple[float, float]:
        """(noise scale, clip) of a defence's additive noise (:class:`defences.spec.Observation`) in
        gradient units of this update. Noise added to the update sent (local DP) scales with it
        (``|gradient_scale|``); DP-SGD's is added to each local step's mean gradient (scale / batch
        size), and a delta's mean gradient averages ``local_steps`` independent draws (/ sqrt)."""
        if observation.per_example:
            steps = 1 if self.update_type == "gradient" else max(self.local_steps, 1)
            return observation.noise_scale / max(self.num_images, 1) / math.sqrt(steps), observation.clip
        unit = abs(self.gradient_scale)
        return observation.noise_scale * unit, observation.clip * unit

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] in [0, 1] -> model input (x - mean) / std."""
        return normalize(images, self.mean, self.std)

    def denormalize(self, inputs: torch.Tensor) -> torch.Tensor:
        """Model input -> [B, C, H, W] float32 CPU, clamped to [0, 1]."""
        m, s = self.mean.to(inputs), self.std.to(inputs)
        x = inputs * s[None, :, None, None] + m[None, :, None, None]
        return x.clamp(0.0, 1.0).to(device="cpu", dtype=torch.float32)

    def box(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounds [1, C, 1, 1] of the normalised input for images in [0, 1]."""
        m = self.mean.to(device=device, dtype=dtype)[None, :, None, None]
        s = self.std.to(device=device, dtype=dtype)[None, :, None, None]
        return -m / s, (1 - m) / s


def _python(value: Any, flat: bool = False) -> Any:
    """``value`` as the Python data strict pydantic takes: a tensor or NumPy value as numbers
    (flattened to a list when ``flat``), a tuple as a list, a lone number as a one-entry list when
    ``flat``. Written by hand: metadata come from Python (the benchmark passes ``labels`` as a
    LongTensor, ``mean``/``std`` as tuples or tensors), not from YAML, and pydantic knows no tensor."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        value = (value.reshape(-1) if flat else value).tolist()
    elif isinstance(value, tuple):
        value = list(value)
    return [value] if flat and isinstance(value, (int, float)) and not isinstance(value, bool) else value


_Scalar = BeforeValidator(_python)
_List = BeforeValidator(functools.partial(_python, flat=True))
_Int, _Float = Annotated[core.Int, _Scalar], Annotated[core.Float, _Scalar]  # a list's entries may be 0-d tensors


class _MetadataSchema(core.Schema):
    """The keys of the metadata a server passes with an update (:meth:`AttackMetadata.parse`): types,
    ranges and defaults that do not depend on the model or on another key."""

    model_config = ConfigDict(extra="ignore")  # plug-in attacks read their own keys from the raw dict
    num_images: Annotated[Optional[core.Int], _Scalar] = core.option(None, ge=1)
    # The old name of num_images, its own key (not a pydantic alias) so that an error names the key
    # the server wrote: fedmjp.config's messages name a field by its name or alias, not an AliasChoices.
    batch_size: Annotated[Optional[core.Int], _Scalar] = core.option(None, ge=1)
    image_size: Annotated[Optional[list[_Int]], _List] = None
    mean: Annotated[Optional[list[_Float]], _List] = None
    std: Annotated[Optional[list[_Float]], _List] = None
    labels: Annotated[Optional[list[_Int]], _List] = None
    update_type: Literal["gradient", "delta"] = "gradient"
    lr: Annotated[Optional[core.Float], _Scalar] = core.option(None, ge=0.0)
    local_steps: Annotated[core.Int, _Scalar] = core.option(1, ge=1)
    defence: Any = None  # validate_defence reads it; a spec it refuses is kept as defence_error


def _bad(key: str, takes: str, got: Any) -> AttackFailure:
    """A metadata value the schema's types let through but a check by hand refuses, worded like
    fedmjp.config's errors."""
    return AttackFailure(f"config key 'metadata.{key}' must be {takes}, got {got!r}")


def _model_image_size(model: nn.Module) -> tuple[int, int, int]:
    """(C, H, W) of the model's input: ``patch_embed.img_size`` and ``patch_embed.proj.in_channels`` (3
    if absent)."""
    embed = getattr(model, "patch_embed", None)
    img = getattr(embed, "img_size", None)
    if img is None:
        raise AttackFailure("metadata lacks image_size and the model has no patch_embed.img_size")
    return int(getattr(getattr(embed, "proj", None), "in_channels", 3)), int(img[0]), int(img[1])


def _per_channel(key: str, values: Optional[list[float]], channels: int, default: float, what: str,
                 valid: Callable[[float], bool]) -> torch.Tensor:
    """[C] float64 of ``values`` (``default`` when None; one entry repeated for every channel),
    each entry ``valid``."""
    given = [default] if values is None else values
    if len(given) not in (1, channels) or not all(map(valid, given)):
        raise _bad(key, f"{channels} (the channels of image_size) or 1 {what}", values)
    return torch.tensor(given * channels if len(given) == 1 else given, dtype=torch.float64)


class LazyGradients(MutableMapping[str, torch.Tensor]):
    """``convert`` applied to each array of ``source`` when it is first read, and kept.

    The server's updates copy an array out of the client's message only when it is read, so the
    closed form, which reads 2-3 of a DeiT-S gradient's 150 arrays, never pays for the others.
    Assigning a name replaces (or adds) that entry here; ``source`` is never modified.
    """

    def __init__(self, source: Mapping[str, torch.Tensor], convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._source, self._convert, self._done = source, convert, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        got = self._done.get(name)
        if got is None:
            got = self._done[name] = self._convert(self._source[name])
        return got

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._done[name] = value

    def __delitem__(self, name: str) -> None:
        raise TypeError("LazyGradients: entries cannot be deleted")

    def __iter__(self) -> Iterator[str]:
        yield from self._source
        yield from (k for k in self._done if k not in self._source)

    def __len__(self) -> int:
        return len(self._source) + sum(k not in self._source for k in self._done)

    def __contains__(self, name: object) -> bool:
        return name in self._source or name in self._done


def update_to_gradients(update: Update, meta: AttackMetadata) -> tuple[LazyGradients, list[str]]:
    """Turn an update into (gradients by name, notes).

    A FedSGD gradient is returned as is (detached). A FedAvg delta (local - global) after one local
    SGD step equals -lr * grad exactly; after ``local_steps`` > 1 steps, -delta / (lr * steps) is the
    mean of the gradients along the local trajectory, which the attacks use as an approximation
    (noted). Each array is converted when an attack first reads it.
    """
    if meta.update_type == "gradient":
        return LazyGradients(update, torch.Tensor.detach), []
    scale = meta.gradient_scale
    notes = [] if meta.local_steps <= 1 else [
        f"approximate: {meta.local_steps}-step FedAvg delta treated as -lr*steps*mean gradient"]
    return LazyGradients(update, lambda v: v.detach() * scale), notes

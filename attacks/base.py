"""The attack interface: one ``Attack`` base class, its result type, its metadata and options.

An honest-but-curious server calls ``attack.reconstruct(model, update, metadata)`` with the model
as it sent it, one client's update and what the server sees besides (docs/design.md,
"Threat model and the settings (a), (b), (c)"). Every attack
returns an :class:`AttackResult`; a failure becomes ``failed=True`` with a reason instead of an
exception, so that a benchmark run records a failure row and goes on.

Two kinds of failure are told apart, so that a bug cannot make a row look private:

- *condition failures*: :class:`AttackFailure` (a violated condition such as rank or batch size, a
  non-finite objective) and the numerical errors listed in :attr:`Attack.expected_errors`
  (``torch.linalg.LinAlgError`` by default). These are properties of the case attacked; the benchmark
  keeps them as failure rows.
- *unexpected errors*: any other exception (a bug in an attack, a third-party library error). The
  result is still failed, but :attr:`AttackResult.error` carries the traceback; the benchmark writes
  it to the run folder's ``errors/`` and ends with a non-zero exit status.

The name registry and building an attack by name with its options checked: :mod:`attacks.registry`.
"""
from __future__ import annotations

import functools
import logging
import math
import time
import traceback
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, ClassVar, Literal, Mapping, Optional, Sequence, TypeVar, Union

import numpy as np
import torch
import torch.nn as nn
from pydantic import BeforeValidator, ConfigDict, ValidationInfo, field_validator

from defences.spec import DefenceSpec, Observation, validate_defence
from fedmjp import config as core
from fedmjp.factory import normalize

from .estimates import EstimateStore

_logger = logging.getLogger(__name__)

Update = Mapping[str, torch.Tensor]
#: What a server passes with an update: an :class:`AttackMetadata`, or a dict of its keys (read by
#: :meth:`AttackMetadata.parse`).
Metadata = Union["AttackMetadata", Mapping[str, Any]]


class AttackFailure(RuntimeError):
    """Raised inside an attack for an expected failure; ``reconstruct`` turns it into a failed result."""


@dataclass
class AttackResult:
    """What an attack returns for one update.

    Attributes:
        images: [B, 3, H, W] float32 on the CPU, in [0, 1] (zeros where the attack failed).
        stats: one dict per image: ``objective``, ``iterations``, ``time_s``, attack-specific
            residuals, ``notes`` (list of str), and ``failed``/``reason`` for that image.
        failed: True if the attack as a whole failed (then every image is a failure).
        reason: why it failed, or None.
        labels: labels the attack used or recovered ([B] long), or None.
        unshuffled: [B, 3, H, W] in [0, 1]: an MJP-aware attack's estimate of the original x (its
            jigsaw solution, setting c); None for attacks that only estimate the client's input.
            The benchmark scores setting (c) against this when present, else ``images``.
        error: the traceback of an unexpected exception (a bug, not a condition failure), or None.
    """

    images: torch.Tensor
    stats: list[dict] = field(default_factory=list)
    failed: bool = False
    reason: Optional[str] = None
    labels: Optional[torch.Tensor] = None
    unshuffled: Optional[torch.Tensor] = None
    error: Optional[str] = None

    @property
    def failed_images(self) -> list[bool]:
        """Per-image failure flags (all True when the whole attack failed)."""
        return [self.failed or bool(s.get("failed", False)) for s in self.stats]


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
            one update estimated (:class:`attacks.estimates.EstimateStore`), for one attack to
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


class ErrorReason(str):
    """The reason string of an unexpected exception, carrying its traceback (``.traceback``)."""

    traceback: str = ""

    @classmethod
    def from_exception(cls, err: BaseException) -> "ErrorReason":
        reason = cls(f"unexpected error: {type(err).__name__}: {err}")
        reason.traceback = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return reason


def failed_result(meta: Optional[AttackMetadata], reason: str, num_images: int = 1,
                  image_size: Sequence[int] = (3, 32, 32)) -> AttackResult:
    """A result with zero images and the reason on every image (``error`` set for an
    :class:`ErrorReason`)."""
    n = meta.num_images if meta is not None else num_images
    size = meta.image_size if meta is not None else tuple(image_size)
    stats = [dict(failed=True, reason=str(reason), notes=[]) for _ in range(n)]
    error = reason.traceback if isinstance(reason, ErrorReason) else None
    return AttackResult(torch.zeros(n, *size), stats, failed=True, reason=str(reason), error=error)


class AttackOptions(core.Schema):
    """Base of an attack's options schema (its ``Options``): one field per option with its type,
    default and range, checked like a config key (fedmjp.config), as a defence's spec is
    (defences/spec.py). A built-in attack is built as ``Attack(**options)`` and reads
    ``self.options``.

    Attributes:
        raise_errors: re-raise unexpected exceptions instead of returning a failed result (debugging).
    """

    raise_errors: bool = False

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_count(cls, value: Any, info: ValidationInfo) -> Any:
        """Every integer option but a seed is a count (iterations, restarts, steps, windows): bounded
        before work starts, so that no config can ask for a run that never ends (``restarts: 1e9``)."""
        if isinstance(value, int) and not isinstance(value, bool) and "seed" not in (info.field_name or ""):
            limit = COUNT_LIMITS.get(info.field_name or "", COUNT_LIMIT)
            if not 0 <= value <= limit:
                raise ValueError(f"must be a count in [0, {limit:,}], got {value}")
        return value


#: The largest value of an integer attack option (a count); breaching's defaults run ~24k iterations.
COUNT_LIMIT = 1_000_000
#: Counts that multiply the whole attack (each restart or start is a full run).
COUNT_LIMITS = {"restarts": 1_000, "starts": 1_000}


OptionsT = TypeVar("OptionsT", bound=core.Schema)


def parse_options(name: str, schema: type[OptionsT], options: Mapping[str, Any]) -> OptionsT:
    """``options`` checked against an attack's options schema, defaults filled in.

    Raises:
        ValueError: ``bad options for attack 'name': ...``: every unknown option with the valid
            ones listed, or the option, what it takes and what it got (fedmjp.config's message).
    """
    unknown = sorted(set(options) - set(schema.model_fields), key=str)
    if unknown:  # every unknown option at once, not only the first
        valid = ", ".join(schema.model_fields) or "none"
        raise ValueError(f"bad options for attack {name!r}: unknown option(s) {unknown}; valid: {valid}")
    try:
        return core.parse(schema, options, "options.")
    except core.ConfigError as err:
        raise ValueError(f"bad options for attack {name!r}: {err}") from None


class Attack:
    """Base class: subclasses implement :meth:`_reconstruct` (and may vectorise
    :meth:`reconstruct_many`), and declare their options as a nested ``Options`` schema (an
    :class:`AttackOptions` subclass) read by :meth:`_parse_options`.

    Args:
        raise_errors: re-raise unexpected exceptions instead of returning a failed result (debugging).
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type[AttackOptions]] = AttackOptions
    #: Exceptions besides AttackFailure that are condition failures of the case attacked (kept as
    #: failure rows without an error); anything else is an unexpected error (see the module docstring).
    expected_errors: ClassVar[tuple[type[BaseException], ...]] = (torch.linalg.LinAlgError,)
    #: Whether the attack (as built, with its options) writes or reads the update's estimate store
    #: (``AttackMetadata.estimates``): a runner that spreads attackers over processes keeps those of
    #: one update together, one after the other, so that they see one store (benchmark/workers.py).
    shares_estimates: bool = False

    def __init__(self, raise_errors: bool = False) -> None:
        self.raise_errors = bool(raise_errors)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def _parse_options(self, options: Mapping[str, Any]) -> Any:
        """``options`` checked against this class's ``Options`` (:func:`parse_options`), kept as
        ``self.options``; ``raise_errors`` set from them. Raises ValueError naming a bad option."""
        self.options = parse_options(self.name or type(self).__name__, type(self).Options, options)
        self.raise_errors = self.options.raise_errors
        return self.options

    def reconstruct(self, model: nn.Module, update: Update, metadata: Optional[Metadata] = None) -> AttackResult:
        """Reconstruct the client's images from one update.

        Args:
            model: the model the server sent (all parameters known; not modified).
            update: gradients (or a FedAvg delta) by parameter name, names of ``model.named_parameters()``.
            metadata: see :class:`AttackMetadata`.
        Returns:
            An :class:`AttackResult`; failures are returned, not raised.
        """
        return self._guard(lambda: self._reconstruct(model, update, AttackMetadata.of(metadata, model)),
                           model, metadata)

    def reconstruct_many(self, model: nn.Module, updates: Sequence[Update],
                         metadatas: Union[Metadata, Sequence[Metadata], None] = None) -> list[AttackResult]:
        """Reconstruct several independent updates (default: one after the other)."""
        mds = _expand_metadatas(metadatas, len(updates))
        return [self.reconstruct(model, u, m) for u, m in zip(updates, mds)]

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        raise NotImplementedError

    def _guard(self, fn: Callable[[], AttackResult], model: nn.Module, metadata: Optional[Metadata]) -> AttackResult:
        """Run ``fn``; expected failures and errors become failed results with the reason logged."""
        t0 = time.perf_counter()
        result, reason = self._run_guarded(fn)
        if reason is not None:
            return self._failed(model, metadata, reason)
        return _check_finite(result, self.name, time.perf_counter() - t0)

    def _run_guarded(self, fn: Callable[[], Any]) -> tuple[Any, Optional[str]]:
        """(fn(), None), or (None, reason) for an AttackFailure, an expected error, or (unless
        raise_errors) any other error; the reason of the latter is an :class:`ErrorReason`."""
        try:
            return fn(), None
        except AttackFailure as err:
            _logger.warning("%s failed: %s", self.name, err)
            return None, str(err)
        except self.expected_errors as err:
            _logger.warning("%s failed (%s): %s", self.name, type(err).__name__, err)
            return None, f"{type(err).__name__}: {err}"
        except Exception as err:  # recorded with its traceback; the benchmark's exit status says so
            if self.raise_errors:
                raise
            _logger.exception("%s raised an unexpected error; recorded as a failed result with its traceback",
                              self.name)
            return None, ErrorReason.from_exception(err)

    def _failed(self, model: nn.Module, metadata: Optional[Metadata], reason: str) -> AttackResult:
        try:
            meta = AttackMetadata.of(metadata, model)
        except AttackFailure:
            meta = None
        return failed_result(meta, reason)


class BatchedSolveAttack(Attack):
    """An attack that solves K independent batch-1 updates in one vectorised ``_solve`` (the closed
    forms). ``reconstruct_many`` parses every update's metadata on its own (a bad one fails only its
    own result) and hands the rest to one ``_solve``, whose condition failure fails all of them."""

    def _solve(self, model: nn.Module, updates: Sequence[Update], metas: Sequence[AttackMetadata]) -> list[AttackResult]:
        raise NotImplementedError

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        return self._solve(model, [update], [meta])[0]

    def reconstruct_many(self, model: nn.Module, updates: Sequence[Update],
                         metadatas: Union[Metadata, Sequence[Metadata], None] = None) -> list[AttackResult]:
        mds = _expand_metadatas(metadatas, len(updates))
        results: list[Optional[AttackResult]] = [None] * len(updates)
        metas: list[AttackMetadata] = []
        good: list[int] = []
        for i, md in enumerate(mds):
            meta, reason = self._run_guarded(lambda md=md: AttackMetadata.of(md, model))
            if reason is None:
                metas.append(meta)
                good.append(i)
            else:
                results[i] = self._failed(model, md, reason)
        if good:
            solved, reason = self._run_guarded(lambda: self._solve(model, [updates[i] for i in good], metas))
            for j, i in enumerate(good):
                results[i] = (self._failed(model, mds[i], reason) if reason is not None
                              else _check_finite(solved[j], self.name, 0.0))
        return results  # type: ignore[return-value]


def _check_finite(result: AttackResult, name: str, elapsed: float) -> AttackResult:
    """Non-finite reconstructions become failures (images zeroed), per image."""
    bad = ~torch.isfinite(result.images.reshape(result.images.shape[0], -1)).all(dim=1)
    for i, s in enumerate(result.stats):
        s.setdefault("notes", [])
        s.setdefault("time_s", elapsed / max(len(result.stats), 1))
        if bool(bad[i]):
            s["failed"], s["reason"] = True, "non-finite reconstruction"
    if bool(bad.any()):
        result.images = torch.where(bad[:, None, None, None], torch.zeros_like(result.images), result.images)
        _logger.warning("%s: %d non-finite reconstruction(s)", name, int(bad.sum()))
        if bool(bad.all()) and not result.failed:
            result.failed, result.reason = True, "non-finite reconstruction"
    return result


def _expand_metadatas(metadatas: Union[Metadata, Sequence[Metadata], None], n: int) -> list[Optional[Metadata]]:
    if metadatas is None or isinstance(metadatas, (Mapping, AttackMetadata)):
        return [metadatas] * n
    mds = list(metadatas)
    if len(mds) != n:
        raise ValueError(f"{len(mds)} metadata dicts for {n} updates")
    return mds

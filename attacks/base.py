"""The attack interface: one ``Attack`` base class, its result type, and the name registry.

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
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import time
import traceback
import typing
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, ClassVar, Literal, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn as nn
from pydantic import BeforeValidator, ConfigDict, create_model

from defences.spec import DefenceSpec, validate_defence
from fedmjp import config as core
from fedmjp import plugins
from fedmjp.factory import normalize

_logger = logging.getLogger(__name__)

Update = Mapping[str, torch.Tensor]
Metadata = Mapping[str, Any]


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

    @classmethod
    def parse(cls, metadata: Optional[Metadata], model: nn.Module) -> "AttackMetadata":
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
    scale = -1.0 / (float(meta.lr) * max(meta.local_steps, 1))
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


class Attack:
    """Base class: subclasses implement :meth:`_reconstruct` (and may vectorise
    :meth:`reconstruct_many`).

    Args:
        raise_errors: re-raise unexpected exceptions instead of returning a failed result (debugging).
    """

    name: ClassVar[str] = ""
    #: Exceptions besides AttackFailure that are condition failures of the case attacked (kept as
    #: failure rows without an error); anything else is an unexpected error (see the module docstring).
    expected_errors: ClassVar[tuple[type[BaseException], ...]] = (torch.linalg.LinAlgError,)

    def __init__(self, raise_errors: bool = False) -> None:
        self.raise_errors = bool(raise_errors)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def reconstruct(self, model: nn.Module, update: Update, metadata: Optional[Metadata] = None) -> AttackResult:
        """Reconstruct the client's images from one update.

        Args:
            model: the model the server sent (all parameters known; not modified).
            update: gradients (or a FedAvg delta) by parameter name, names of ``model.named_parameters()``.
            metadata: see :class:`AttackMetadata`.
        Returns:
            An :class:`AttackResult`; failures are returned, not raised.
        """
        return self._guard(lambda: self._reconstruct(model, update, AttackMetadata.parse(metadata, model)),
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
            meta = AttackMetadata.parse(metadata, model)
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
            meta, reason = self._run_guarded(lambda md=md: AttackMetadata.parse(md, model))
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
    if metadatas is None or isinstance(metadatas, Mapping):
        return [metadatas] * n
    mds = list(metadatas)
    if len(mds) != n:
        raise ValueError(f"{len(mds)} metadata dicts for {n} updates")
    return mds


# --------------------------------------------------------------------------------- registry
# Built-ins register with @register_attack; plug-ins from other packages are named by an entry
# point of group ``fedmjp.attacks`` or a ``package.module:Name`` reference (fedmjp/plugins.py,
# docs/plugins.md) and loaded when a config names them.
_REGISTRY: dict[str, Callable[..., Attack]] = {}


def register_attack(name: str) -> Callable:
    """Class decorator: make ``create_attack(name)`` build this class."""

    def wrap(cls):
        _REGISTRY[name] = cls
        return cls

    return wrap


def attack_names() -> list[str]:
    """The valid names of :func:`create_attack`, sorted: built-ins and installed plug-ins' entry
    points (a ``package.module:Name`` reference is valid too)."""
    return sorted({*_REGISTRY, *plugins.entry_points("attack")})


def attack_catalog() -> list[tuple[str, str]]:
    """(name, origin) of every attack: ``built-in``, or the entry point's package and version."""
    entries = plugins.entry_points("attack")
    return [(name, "built-in" if name in _REGISTRY else entries[name].origin) for name in attack_names()]


def attack_class(name: str) -> Callable[..., Attack]:
    """The class (or factory) ``create_attack(name)`` calls: a built-in, else a plug-in (imported now).

    Raises:
        ValueError: unknown name (the valid ones listed), or a plug-in that cannot be loaded or is
            not an :class:`Attack` subclass (:class:`fedmjp.plugins.PluginError`).
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    plugin = plugins.find("attack", name)
    if plugin is None:
        raise ValueError(f"unknown attack {name!r}; valid: {', '.join(attack_names())}, "
                         "or a plug-in's package.module:Name")
    return plugins.load("attack", plugin, Attack)


def _init_options(factory: Callable[..., Any]) -> tuple[dict[str, Any], bool]:
    """(keyword arguments of an attack class's ``__init__`` by name, with their annotation or
    ``inspect.Parameter.empty``; whether it also takes any other keyword), following ``**options``
    up the base classes."""
    found: dict[str, Any] = {}
    chain = [k for k in factory.__mro__ if "__init__" in vars(k)] if isinstance(factory, type) else [factory]
    for owner in chain:
        init = owner.__init__ if isinstance(factory, type) else owner
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # no signature to read: any keyword may be valid
            return found, True
        try:
            hints = typing.get_type_hints(init)
        except (NameError, TypeError):  # unresolvable annotations: the names without types
            hints = {}
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                found.setdefault(p.name, hints.get(p.name, inspect.Parameter.empty))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return found, False
        if owner is object:
            break
    return found, True


def option_types(factory: Callable[..., Any]) -> dict[str, Any]:
    """Annotated keyword arguments of an attack class's ``__init__`` (following ``**options`` up
    the base classes), by name: what :func:`create_attack` converts number options to."""
    return {k: v for k, v in _init_options(factory)[0].items() if v is not inspect.Parameter.empty}


def attack_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of attack ``name`` checked against its ``__init__``: unknown ones refused (the
    valid ones listed), number options converted and type-checked (:func:`_number_options`).

    Raises:
        ValueError: an unknown name or option, or a number option of the wrong type.
    """
    factory = attack_class(name)
    known, open_ = _init_options(factory)
    unknown = [] if open_ else sorted(set(options) - set(known), key=str)
    if unknown:
        valid = ", ".join(k for k in known if k != "name") or "none"
        raise ValueError(f"bad options for attack {name!r}: unknown option(s) {unknown}; valid: {valid}")
    schema = _number_options(factory)
    try:
        numbers = core.conform(schema, {k: v for k, v in options.items() if k in schema.model_fields}, "options.")
    except core.ConfigError as err:
        raise ValueError(f"bad options for attack {name!r}: {err}") from err
    return {key: numbers[key] if key in schema.model_fields else value for key, value in options.items()}


@functools.cache
def _number_options(factory: Callable[..., Any]) -> type[core.Schema]:
    """A schema of the options an attack's ``__init__`` annotates as numbers (int, float, Optional
    of one), checked like config keys; the attack checks its other options itself."""
    numbers = {k: tp for k, tp in option_types(factory).items()
               if any(m in (int, float) for m in typing.get_args(tp) or (tp,))}
    return create_model(f"{getattr(factory, '__name__', 'Attack')}Options", __base__=core.Schema,
                        **{k: (core.number_type(tp), None) for k, tp in numbers.items()})


def create_attack(name: str, **options: Any) -> Attack:
    """Build an attack by name (built-in, entry point or ``package.module:Name``). An option annotated
    as a number is checked like a config key: written another way (``"1e-4"``, ``1e3`` for an
    ``int`` argument) it becomes the number its annotation asks for, a bool or text is refused
    (:func:`attack_options`).

    Raises:
        ValueError: unknown name (the message lists the valid ones), a plug-in that cannot be
            loaded, or bad options.
    """
    factory = attack_class(name)
    options = attack_options(name, options)
    try:
        attack = factory(name=name, **options) if getattr(factory, "takes_name", False) else factory(**options)
    except TypeError as err:  # unknown keyword -> a config error
        raise ValueError(f"bad options for attack {name!r}: {err}") from err
    if not isinstance(attack, Attack):
        raise ValueError(f"attack {name!r}: its factory returned {type(attack).__name__}, not an Attack")
    if not attack.name:  # a plug-in without its own name is known by the name the config gave
        attack.name = name
    return attack


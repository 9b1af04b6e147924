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

The name registry and building an attack by name with its options checked: :mod:`attacks.api.registry`;
the metadata and the update read as gradients: :mod:`attacks.api.metadata`; the failure types:
:mod:`attacks.api.errors` (both re-exported here, where attacks and plug-ins import them from).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Hashable, Mapping, Optional, Sequence, TypeVar, Union

import numpy as np
import torch
import torch.nn as nn
from pydantic import ValidationInfo, field_validator

from fedmjp import config as core

from fedmjp import plugins

from .errors import AttackFailure, ErrorReason, cap_reason
from .metadata import AttackMetadata, LazyGradients, Metadata, Update, update_to_gradients

__all__ = ["Attack", "AttackFailure", "AttackMetadata", "AttackOptions", "AttackResult", "BatchedSolveAttack",
           "ErrorReason", "LazyGradients", "Metadata", "Update", "check_result", "check_results", "failed_result",
           "parse_options", "update_to_gradients"]

_logger = logging.getLogger(__name__)

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


def failed_result(meta: Optional[AttackMetadata], reason: str, num_images: int = 1,
                  image_size: Sequence[int] = (3, 32, 32)) -> AttackResult:
    """A result with zero images and the reason on every image (``error`` set for an
    :class:`ErrorReason`)."""
    n = meta.num_images if meta is not None else num_images
    size = meta.image_size if meta is not None else tuple(image_size)
    reason = cap_reason(reason)
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

    @classmethod
    def run_key(cls, options: AttackOptions, model: nn.Module) -> Optional[Hashable]:
        """What decides this attack's results on ``model`` given its checked ``options``: two
        attackers of a run with equal keys compute the same thing, so the benchmark runs the first
        and scores its results under both labels (benchmark/group_attacker.py). None (the default):
        never shared; an attack says which of its options have no effect on which models
        (:meth:`options_key`), and only a deterministic one (a fixed seed) may return a key."""
        return None

    @classmethod
    def options_key(cls, options: AttackOptions, ignore: Sequence[str] = ()) -> Hashable:
        """(class, every option but ``ignore`` as repr) for :meth:`run_key`."""
        kept = {k: v for k, v in options if k not in ignore}
        return cls.__module__, cls.__qualname__, tuple(sorted((k, repr(v)) for k, v in kept.items()))

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
            An :class:`AttackResult` checked by :func:`check_result`; failures are returned, not raised.
        """
        meta, reason = self._run_guarded(lambda: AttackMetadata.of(metadata, model))
        if reason is not None:
            return self._failed(model, metadata, reason)
        return self._guard(lambda: self._reconstruct(model, update, meta), model, meta)

    def reconstruct_many(self, model: nn.Module, updates: Sequence[Update],
                         metadatas: Union[Metadata, Sequence[Metadata], None] = None) -> list[AttackResult]:
        """Reconstruct several independent updates (default: one after the other)."""
        mds = expand_metadatas(metadatas, len(updates))
        return [self.reconstruct(model, u, m) for u, m in zip(updates, mds)]

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        raise NotImplementedError

    def _guard(self, fn: Callable[[], AttackResult], model: nn.Module, metadata: Optional[Metadata]) -> AttackResult:
        """Run ``fn``; expected failures and errors become failed results with the reason logged, and
        what it returns is checked against the result contract (:func:`check_result`)."""
        t0 = time.perf_counter()
        result, reason = self._run_guarded(fn)
        if reason is not None:
            return self._failed(model, metadata, reason)
        try:
            meta: Optional[AttackMetadata] = AttackMetadata.of(metadata, model)
        except AttackFailure:
            meta = None
        return check_result(result, self.name or type(self).__name__, meta, time.perf_counter() - t0)

    def _run_guarded(self, fn: Callable[[], Any]) -> tuple[Any, Optional[str]]:
        """(fn(), None), or (None, reason) for an AttackFailure, an expected error, or (unless
        raise_errors) any other error; the reason of the latter is an :class:`ErrorReason`. A
        ``SystemExit`` and a ``KeyboardInterrupt`` no user signal came with
        (:func:`fedmjp.plugins.interrupted_by_user`) are the attack's errors too; the user's
        interrupt is re-raised."""
        name = self.name or type(self).__name__
        try:
            return fn(), None
        except AttackFailure as err:
            _logger.warning("%s failed: %s", name, cap_reason(err))
            return None, cap_reason(err)
        except self.expected_errors as err:
            _logger.warning("%s failed (%s): %s", name, type(err).__name__, cap_reason(err))
            return None, cap_reason(f"{type(err).__name__}: {err}")
        except (Exception, SystemExit, KeyboardInterrupt) as err:  # recorded with its traceback; exit status 8
            if self.raise_errors or (isinstance(err, KeyboardInterrupt) and plugins.interrupted_by_user()):
                raise
            _logger.error("%s raised an unexpected error (%s); recorded as a failed result with its traceback",
                          name, cap_reason(f"{type(err).__name__}: {err}", 200))
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
        mds = expand_metadatas(metadatas, len(updates))
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
            if reason is None and not (isinstance(solved, (list, tuple)) and len(solved) == len(good)):
                reason = ErrorReason.of(f"attack {self.name!r} returned a bad result: {_describe(solved)} from "
                                        f"_solve, expected a list of {len(good)} AttackResult(s)")
            for j, i in enumerate(good):
                results[i] = (self._failed(model, mds[i], reason) if reason is not None
                              else check_result(solved[j], self.name, metas[j], 0.0))
        return results  # type: ignore[return-value]


def _describe(value: Any) -> str:
    """What a value is, for a reason: ``None``, ``a str``, ``a tensor of shape (2, 3) and dtype torch.int64``."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("a builtins.", "a ")


def _image_problem(field_name: str, value: Any, shape: Optional[tuple[int, ...]]) -> Optional[str]:
    """What is wrong with a result's image tensor (None: nothing): a real floating-point torch
    tensor (B, C, H, W), of ``shape`` where the metadata fixes it."""
    if not isinstance(value, torch.Tensor):
        return f"{field_name} is {_describe(value)}, not a torch tensor (B, C, H, W)"
    if not value.is_floating_point():
        return f"{field_name} has dtype {value.dtype}, not a real floating-point dtype"
    if value.dim() != 4:
        return f"{field_name} has shape {tuple(value.shape)}, not (B, C, H, W)"
    if shape is not None and tuple(value.shape) != shape:
        return f"{field_name} has shape {tuple(value.shape)}, expected (B, C, H, W) = {shape}"
    return None


def _flag(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_)) or (isinstance(value, int) and value in (0, 1))


def result_problem(result: Any, meta: Optional[AttackMetadata]) -> Optional[str]:
    """What breaks the result contract (None: nothing), for :func:`check_result`: an
    :class:`AttackResult` whose ``images`` are a real floating-point tensor (B, C, H, W) with B and
    (C, H, W) of ``meta`` (where given), ``stats`` a list of B dicts (or empty: no stats), a bool
    ``failed``, str or None ``reason``/``error``, ``labels`` None or B integers >= 0, and
    ``unshuffled`` None or a tensor like ``images``."""
    if not isinstance(result, AttackResult):
        return f"{_describe(result)} instead of an AttackResult"
    expected = None if meta is None else (int(meta.num_images), *(int(v) for v in meta.image_size))
    problem = _image_problem("images", result.images, expected)
    if problem is not None:
        return problem
    n = int(result.images.shape[0])
    stats = result.stats
    if not isinstance(stats, (list, tuple)):
        return f"stats is {_describe(stats)}, not a list of one dict per image"
    if stats and len(stats) != n:
        return f"{len(stats)} stats dict(s) for {n} image(s)"
    for i, st in enumerate(stats):
        if not isinstance(st, dict):
            return f"stats[{i}] is {_describe(st)}, not a dict"
        if not _flag(st.get("failed", False)):
            return f"stats[{i}]['failed'] is {_describe(st['failed'])}, not a bool"
        if st.get("reason") is not None and not isinstance(st["reason"], str):
            return f"stats[{i}]['reason'] is {_describe(st['reason'])}, not a str"
        if not isinstance(st.get("notes", []), (list, tuple)):
            return f"stats[{i}]['notes'] is {_describe(st['notes'])}, not a list of str"
    if not _flag(result.failed):
        return f"failed is {_describe(result.failed)}, not a bool"
    for key in ("reason", "error"):
        if getattr(result, key) is not None and not isinstance(getattr(result, key), str):
            return f"{key} is {_describe(getattr(result, key))}, not a str or None"
    labels = result.labels
    if labels is not None:
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex() \
                or labels.dtype == torch.bool:
            return f"labels is {_describe(labels)}, not an integer tensor [B] or None"
        if labels.dim() != 1 or labels.numel() != n:
            return f"labels has shape {tuple(labels.shape)}, expected ({n},)"
        if labels.numel() and int(labels.min()) < 0:
            return f"labels hold {int(labels.min())}, a class index must be >= 0"
    if result.unshuffled is not None:
        problem = _image_problem("unshuffled", result.unshuffled, tuple(result.images.shape))
        if problem is not None:
            return problem
    return None


def check_result(result: Any, name: str, meta: Optional[AttackMetadata] = None, elapsed: float = 0.0) -> AttackResult:
    """The one check of what an attack returned: a result that breaks the contract
    (:func:`result_problem`) becomes a failed result whose reason names the attack and what was
    wrong (an unexpected error: a bug, exit status 8); a good one gets its tensors as float32 on the
    CPU, one stats dict per image, its reasons capped (:func:`attacks.api.errors.cap_reason`) and
    non-finite reconstructions failed per image."""
    problem = result_problem(result, meta)
    if problem is not None:
        reason = ErrorReason.of(f"attack {name!r} returned a bad result: {problem}")
        _logger.error("%s", reason)
        if meta is None and isinstance(result, AttackResult) and isinstance(result.images, torch.Tensor) \
                and result.images.dim() == 4:
            return failed_result(None, reason, int(result.images.shape[0]), tuple(result.images.shape[1:]))
        return failed_result(meta, reason)
    result.images = result.images.detach().to("cpu", torch.float32)
    if result.unshuffled is not None:
        result.unshuffled = result.unshuffled.detach().to("cpu", torch.float32)
    if result.labels is not None:
        result.labels = result.labels.detach().to("cpu", torch.long)
    result.failed = bool(result.failed)
    if result.reason is not None:
        result.reason = cap_reason(result.reason)
    result.stats = [dict(st) for st in result.stats] or [{} for _ in range(result.images.shape[0])]
    for st in result.stats:
        if st.get("reason") is not None:
            st["reason"] = cap_reason(st["reason"])
        if "failed" in st:
            st["failed"] = bool(st["failed"])
    return check_finite(result, name, elapsed)


def check_results(results: Any, name: str, metas: Sequence[Optional[AttackMetadata]],
                  elapsed: float = 0.0) -> list[AttackResult]:
    """:func:`check_result` of each of a ``reconstruct_many`` call's results: a list of one result
    per update, else every update's result failed with what was returned instead."""
    if not isinstance(results, (list, tuple)) or len(results) != len(metas):
        got = _describe(results) if not isinstance(results, (list, tuple)) else f"{len(results)} result(s)"
        reason = ErrorReason.of(f"attack {name!r} returned a bad result: {got} for {len(metas)} update(s), "
                                "expected a list of one AttackResult per update")
        _logger.error("%s", reason)
        return [failed_result(m, reason) for m in metas]
    share = elapsed / max(len(metas), 1)
    return [check_result(r, name, m, share) for r, m in zip(results, metas)]


def check_finite(result: AttackResult, name: str, elapsed: float) -> AttackResult:
    """Non-finite reconstructions become failures (images zeroed), per image; ``time_s`` and
    ``notes`` filled in."""
    bad = ~torch.isfinite(result.images.reshape(result.images.shape[0], -1)).all(dim=1)
    if result.unshuffled is not None:
        bad |= ~torch.isfinite(result.unshuffled.reshape(result.unshuffled.shape[0], -1)).all(dim=1)
    for i, s in enumerate(result.stats):
        s.setdefault("notes", [])
        s.setdefault("time_s", elapsed / max(len(result.stats), 1))
        if bool(bad[i]):
            s["failed"], s["reason"] = True, "non-finite reconstruction"
    if bool(bad.any()):
        result.images = torch.where(bad[:, None, None, None], torch.zeros_like(result.images), result.images)
        if result.unshuffled is not None:
            result.unshuffled = torch.where(bad[:, None, None, None], torch.zeros_like(result.unshuffled),
                                            result.unshuffled)
        _logger.warning("%s: %d non-finite reconstruction(s)", name, int(bad.sum()))
        if bool(bad.all()) and not result.failed:
            result.failed, result.reason = True, "non-finite reconstruction"
    return result


def expand_metadatas(metadatas: Union[Metadata, Sequence[Metadata], None], n: int) -> list[Optional[Metadata]]:
    if metadatas is None or isinstance(metadatas, (Mapping, AttackMetadata)):
        return [metadatas] * n
    mds = list(metadatas)
    if len(mds) != n:
        raise ValueError(f"{len(mds)} metadata dicts for {n} updates")
    return mds

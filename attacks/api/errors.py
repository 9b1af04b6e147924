"""The two failure kinds of an attack (attacks/api/base.py's docstring tells them apart): an expected
:class:`AttackFailure`, and the reason string of an unexpected exception with its traceback."""
from __future__ import annotations

import traceback


class AttackFailure(RuntimeError):
    """Raised inside an attack for an expected failure; ``reconstruct`` turns it into a failed result."""


class ErrorReason(str):
    """The reason string of an unexpected exception, carrying its traceback (``.traceback``)."""

    traceback: str = ""

    @classmethod
    def from_exception(cls, err: BaseException) -> "ErrorReason":
        reason = cls(f"unexpected error: {type(err).__name__}: {err}")
        reason.traceback = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return reason

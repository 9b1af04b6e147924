"""The two failure kinds of an attack (attacks/api/base.py's docstring tells them apart): an expected
:class:`AttackFailure`, and the reason string of an unexpected exception with its traceback.

A reason is one cell of the results table and one line of the printed table, so it is capped
(:func:`cap_reason`) where it is made; the full text of an unexpected error stays in its traceback
(the run folder's ``errors/``)."""
from __future__ import annotations

import traceback

#: The most characters of a failure reason kept in a row; the rest is cut with a note of how much.
REASON_LIMIT = 500
#: Room for that note: a text at most this much longer than the limit is kept whole, so that a
#: reason capped once is not cut again.
_NOTE_ROOM = 40


class AttackFailure(RuntimeError):
    """Raised inside an attack for an expected failure; ``reconstruct`` turns it into a failed result."""


def cap_reason(text: object, limit: int = REASON_LIMIT) -> str:
    """``text`` as a string of at most ``limit`` characters plus ``... (N characters cut)``; an
    :class:`ErrorReason` stays one, with its full traceback."""
    s = str(text)
    if len(s) <= limit + _NOTE_ROOM:
        return text if isinstance(text, str) else s
    capped = f"{s[:limit]}... ({len(s) - limit} characters cut)"
    if isinstance(text, ErrorReason):
        out = ErrorReason(capped)
        out.traceback = text.traceback
        return out
    return capped


class ErrorReason(str):
    """The reason string of an unexpected exception, carrying its traceback (``.traceback``)."""

    traceback: str = ""

    @classmethod
    def from_exception(cls, err: BaseException) -> "ErrorReason":
        reason = cls(cap_reason(f"unexpected error: {type(err).__name__}: {err}"))
        reason.traceback = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return reason

    @classmethod
    def of(cls, text: str) -> "ErrorReason":
        """An error reason without an exception (a result that breaks the contract): the capped text,
        the full text as its traceback."""
        reason = cls(cap_reason(text))
        reason.traceback = str(text)
        return reason

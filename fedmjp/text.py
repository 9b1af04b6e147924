"""Untrusted text made safe for a terminal or a log: :func:`printable`.

A file name, an archive member name, a plug-in's name or failure reason, a config value quoted in an
error: each is text that someone other than the user wrote. Printed raw, its control characters
act on the terminal (ESC starts sequences that clear the screen, recolour text or retitle the
window; C1 controls do the same on some terminals), a newline starts a forged log line, and a
bidirectional override (U+202E) shows the characters after it in reverse order. Every such string
goes through :func:`printable` where it is interpolated into a message; :class:`EscapingFormatter`
does the same to every log record's arguments, for the strings a message does not escape itself.

The rule is Python's ``repr``: a character that ``str.isprintable`` rejects (the Unicode categories
Cc, Cf, Cs, Co, Cn, Zl, Zp, and every space separator but the ASCII space) is written as its
escape (``\\n``, ``\\r``, ``\\t``, else ``\\xNN`` / ``\\uNNNN`` / ``\\UNNNNNNNN``); printable
characters, accented letters and other scripts included, stay as they are. Unlike ``repr`` there are no quotes and a backslash is kept:
the result holds printable characters only, so escaping it again changes nothing, and a message
escaped where it is built and again where it is printed reads the same.
"""
from __future__ import annotations

import logging
from typing import Any

__all__ = ["EscapingFormatter", "escape_log_output", "printable"]


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(value: object) -> str:
    """``str(value)`` with every non-printable character (control characters, ESC, C1 controls,
    newlines, bidirectional overrides, lone surrogates of undecodable file names, ...) written as
    its backslash escape, e.g. ``"a\\x1b[2Jb"`` for ``"a<ESC>[2Jb"``. Safe to print anywhere and
    idempotent: ``printable(printable(s)) == printable(s)``."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


class EscapingFormatter(logging.Formatter):
    """A log formatter that passes every string-like argument of a record (``str``, paths,
    exceptions: whatever ``%s`` would render from text) through :func:`printable`, then formats
    the record with ``inner`` (the handler's own formatter). Numbers and other values are left to
    their ``%d`` / ``%.3f`` format; the message template is the program's own text and is kept.
    A formatter rather than a filter: ``tqdm.contrib.logging.logging_redirect_tqdm`` hands a
    handler's formatter to the handler it puts in place, not its filters."""

    def __init__(self, inner: logging.Formatter | None = None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_escaped_arg(a) for a in args)
        elif isinstance(args, dict):
            record.args = {k: _escaped_arg(v) for k, v in args.items()}
        return self.inner.format(record)


def escape_log_output(logger: logging.Logger | None = None) -> None:
    """Wrap the formatter of every handler of ``logger`` (default: the root logger) in an
    :class:`EscapingFormatter`: call after ``logging.basicConfig``."""
    for handler in (logger or logging.getLogger()).handlers:
        if not isinstance(handler.formatter, EscapingFormatter):
            handler.setFormatter(EscapingFormatter(handler.formatter))


def _escaped_arg(value: Any) -> Any:
    if isinstance(value, (bool, int, float, complex)) or value is None:
        return value
    if isinstance(value, (str, BaseException)) or hasattr(value, "__fspath__"):
        return printable(value)
    return value

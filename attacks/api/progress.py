"""Progress of a long attack within one call: what its iteration loops report, and who shows it.

An attack calls :func:`report` from its loops (``report(self.name, it, iterations, "restart 1")``);
the caller decides what becomes of it by installing a :class:`Reporter` around the attack's call
(:func:`reporting`). Without one, :func:`report` is a context-variable read and returns: attacks
called from a script, a test or another thread (a Ray worker process included) report to no one.

The reporter is held in a :class:`contextvars.ContextVar`, so it belongs to the thread (and context)
that installed it: the benchmark's attack thread sees its own, no other thread does. A reporter
shows at most one step per ``every_s`` seconds (one clock read and compare per call otherwise),
and whatever its display raises is logged and dropped: progress never changes or fails an attack.
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

_logger = logging.getLogger(__name__)

#: Seconds between two log lines of a reporter that writes to the log (no progress bar shown).
LOG_EVERY_S = 10.0
#: Seconds between two refreshes of a progress bar's postfix.
BAR_EVERY_S = 0.5


@dataclass(frozen=True)
class Step:
    """One reported step: ``attack`` (its name), ``done`` of ``total`` (None: not known ahead)
    iterations, ``note`` (the stage, e.g. ``"restart 2 of 3"``) and ``seconds`` since the attack's
    first report to this reporter."""

    attack: str
    done: int
    total: Optional[int]
    note: str
    seconds: float

    def text(self) -> str:
        """``iteration 340 of 1000 (restart 1 of 2)``: the step in words, without the attack's name."""
        if self.total is None and self.done == 0 and self.note:  # a stage starting: its name says it
            return self.note
        count = f"iteration {self.done}" + ("" if self.total is None else f" of {self.total}")
        return f"{count} ({self.note})" if self.note else count

    def short(self) -> str:
        """``mjp_adaptive it 340/1000 span fit``: the step as a progress bar's postfix."""
        count = f"it {self.done}" + ("" if self.total is None else f"/{self.total}")
        return " ".join(part for part in (self.attack, count, self.note) if part)


class Reporter:
    """Shows at most one :class:`Step` per ``every_s`` seconds through ``show`` (the first at once).

    Safe to call from any thread: the rate limit is one monotonic-clock compare, and the thread that
    passes it first takes the slot under a lock; ``show`` runs outside the lock.
    """

    def __init__(self, show: Callable[[Step], None], every_s: float) -> None:
        self.show, self.every_s = show, float(every_s)
        self._lock = threading.Lock()
        self._next = 0.0  # monotonic time from which the next step is shown
        self._started: dict[str, float] = {}  # attack name -> monotonic time of its first report

    def __call__(self, attack: str, done: int, total: Optional[int] = None, note: str = "") -> None:
        now = time.monotonic()
        started = self._started.get(attack)
        if started is None:
            with self._lock:
                started = self._started.setdefault(attack, now)
        if now < self._next:
            return
        with self._lock:
            if now < self._next:
                return
            self._next = now + self.every_s
        try:
            self.show(Step(str(attack), int(done), None if total is None else int(total), note, now - started))
        except Exception:  # noqa: BLE001  (a display's error must not fail the attack it describes)
            _logger.debug("progress display failed", exc_info=True)


_current: contextvars.ContextVar[Optional[Reporter]] = contextvars.ContextVar("attack_progress", default=None)


@contextmanager
def reporting(reporter: Optional[Reporter]) -> Iterator[Optional[Reporter]]:
    """Within the block, :func:`report` in this thread goes to ``reporter`` (None: to no one)."""
    token = _current.set(reporter)
    try:
        yield reporter
    finally:
        _current.reset(token)


def report(attack: str, done: int, total: Optional[int] = None, note: str = "") -> None:
    """An attack's progress: ``done`` of ``total`` iterations (None: not known ahead) of its stage
    ``note``; goes to the reporter installed in this thread (:func:`reporting`), else nowhere. Cheap
    enough for every iteration of a loop (a context-variable read, and a clock compare where a
    reporter listens)."""
    reporter = _current.get()
    if reporter is not None:
        reporter(attack, done, total, note)

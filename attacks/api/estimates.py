"""What one attack estimated from an update, kept for the other attacks of the same update.

An attack may start from another's intermediate estimate: ``ig_closed_start`` starts from the x~
that ``mjp_adaptive`` computes (step 2-3 of its docstring, seconds to a minute per image). Whoever
hands a set of attacks one update passes them one :class:`EstimateStore` in the update's
:class:`attacks.api.base.AttackMetadata` (``estimates``): the benchmark creates one per update and
round (benchmark/group_attacker.py) and drops it with the round's calls. An attack called without
one computes what it needs itself.

Everything in a store belongs to one update: one model (the weights the server sent), one update,
one metadata. The key is therefore the producing attack's name and the options its estimate depends
on, nothing of the update; a store must not be reused for another update.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Mapping, Optional


class EstimateStore:
    """Intermediate estimates of one update, by producer (an attack's name) and the options the
    estimate depends on.

    :meth:`put` keeps a deep copy and :meth:`get` returns one, so no reader can change what another
    reads. A plain dict, no lock: the attacks of one update run one after the other (in one process
    or on one Ray worker, benchmark/workers.py); it pickles with the metadata that carries it.
    """

    def __init__(self) -> None:
        self._items: dict[tuple[str, str], Any] = {}
        self.computed = 0  # estimates put
        self.reused = 0  # estimates got

    @staticmethod
    def _key(producer: str, options: Mapping[str, Any]) -> tuple[str, str]:
        return producer, json.dumps(dict(options), sort_keys=True, default=str)

    def get(self, producer: str, options: Mapping[str, Any]) -> Optional[Any]:
        """A copy of what ``producer`` put with equal ``options``, or None."""
        got = self._items.get(self._key(producer, options))
        if got is None:
            return None
        self.reused += 1
        return copy.deepcopy(got)

    def put(self, producer: str, options: Mapping[str, Any], value: Any) -> None:
        """Keep a copy of ``value`` for later attacks of this update."""
        self._items[self._key(producer, options)] = copy.deepcopy(value)
        self.computed += 1

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"EstimateStore({len(self)} estimate(s), {self.reused} reuse(s))"

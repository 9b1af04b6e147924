"""What of a config must match for a run folder to resume, and how two configs differ.

:meth:`benchmark.store.RunFolder.check` compares the stored ``config.yaml`` with the requested
config through :func:`result_view` and lists the differences (:func:`diff_configs`).
"""
from __future__ import annotations

from typing import Any, Mapping

from .config import BenchmarkConfig, plain

#: Keys (dotted for nested ones) that change no stored row or image, only where the run writes, how
#: it spreads its work or how it draws its pictures; a resumed run may differ in them.
#: ``report.grid_images`` is not one: it decides which rows store their images (``image_stored``).
NON_RESULT_KEYS = ("output", "train_data", "attack_workers", "ray_address", "report.tile")


def result_view(cfg: Mapping[str, Any] | BenchmarkConfig) -> dict:
    """The part of a config that determines results (what must match to resume), as plain data."""
    view = plain(cfg)
    for key in NON_RESULT_KEYS:
        *parents, leaf = key.split(".")
        node: Any = view
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return view


def diff_configs(old: Any, new: Any, where: str = "") -> list[str]:
    """``key: old -> new`` for every dotted key whose value differs between two configs."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new), key=str)
        return [d for k in keys for d in diff_configs(old.get(k), new.get(k), f"{where}{k}.")]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in diff_configs(a, b, f"{where}{i}.")]
    return [] if old == new else [f"{where.rstrip('.')}: {old!r} -> {new!r}"]

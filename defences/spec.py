"""Defence specifications: names, keys, defaults and validation (plain data, no torch).

A defence spec is a mapping ``{name: <defence>, <key>: <value>, ...}``; keys left out take the
defaults below. :func:`validate_defence` returns the complete spec or raises ``ValueError`` naming
the bad name/key/value and listing the valid ones, so a typo fails before anything runs.

========== ============================================================ ============================
name       what the client does to what it sends                        keys (defaults)
========== ============================================================ ============================
none       nothing                                                      -
local_dp   clip the whole update to L2 norm ``clip``, add i.i.d. noise  clip 1.0, sigma 0.1,
           of std ``sigma * clip`` (gaussian) or Laplace scale           noise gaussian
           ``sigma * clip`` (laplace); sigma is a noise multiplier
dp_sgd     per-sample gradients clipped to ``clip``, summed, Gaussian   clip 1.0, sigma 1.0,
           noise of std ``sigma * clip`` added, divided by the batch     delta 1e-5
           size, in every local step (FedSGD: the one gradient); the
           RDP accountant's epsilon at ``delta`` is reported
central_dp server-side: Flower's DifferentialPrivacyServerSideFixedClipping clip 1.0, sigma 0.1
           (clip each reply, noise after aggregation); the client sends
           its clean update, so a server tapping replies sees no change
prune      keep the ``keep`` share of entries of largest magnitude      keep 0.1
           (over the whole update), zero the rest
quantize   ``bits`` = 1: sign(u) * mean|u| per tensor (signSGD with     bits 1, stochastic false
           scale); ``bits`` = k > 1: 2^k uniform levels on [-m, m],
           m = max|u| per tensor; nearest level, or unbiased stochastic
           rounding when ``stochastic``
mixup      instahide-style: each private image is mixed with ``k - 1``  k 2, alpha 1.0,
           other images of the client's partition with Dirichlet(alpha) sign_flip false
           weights (labels mixed alike, soft targets); ``sign_flip``
           flips random pixel signs of the mixture (InstaHide)
fedavg     FedAvg with ``steps`` local SGD steps instead of one          steps 5
           FedSGD gradient: the implicit defence of local training
========== ============================================================ ============================

Other packages add defences (plug-ins): a :class:`UpdateDefence` subclass named by an entry point
of group ``fedmjp.defences`` or a ``package.module:Name`` reference (fedmjp/plugins.py,
docs/plugins.md); its ``defaults`` are its keys, checked like the built-ins' here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional

from fedmjp import plugins
from fedmjp.config import as_number

if TYPE_CHECKING:  # the spec stays plain data; only a plug-in's apply() sees tensors
    import torch


class UpdateDefence:
    """Base class of a plug-in defence: a transform of a client's finished update (FedSGD
    gradients or FedAvg weight delta), applied on the client before it replies.

    Subclasses set ``defaults`` (every spec key with its default; a number key's default fixes its
    type: an int default makes an integer key) and implement :meth:`apply`; they may override
    :meth:`check` to refuse values. One instance serves every client of a process.
    """

    #: Spec keys (besides ``name``) and their defaults.
    defaults: ClassVar[dict[str, Any]] = {}

    def check(self, spec: dict[str, Any]) -> None:
        """Raise ValueError for a value ``spec`` (complete: defaults filled in) may not hold."""

    def apply(self, update: Mapping[str, "torch.Tensor"], spec: Mapping[str, Any],
              generator: "torch.Generator") -> dict[str, "torch.Tensor"]:
        """The update to send: a new dict with the same names, shapes and dtypes (``update`` is not
        modified). Draw randomness only from ``generator`` (seeded per client and round)."""
        raise NotImplementedError


def plugin_defence(name: Any) -> Optional[UpdateDefence]:
    """The plug-in defence ``name`` refers to (an instance), or None for a built-in or unknown name.

    Raises:
        ValueError (:class:`fedmjp.plugins.PluginError`): a plug-in that cannot be loaded or is not
            an :class:`UpdateDefence` subclass.
    """
    if name in DEFENCES:
        return None
    plugin = plugins.find("defence", name)
    return None if plugin is None else plugins.load("defence", plugin, UpdateDefence)()


def defence_names() -> list[tuple[str, str]]:
    """(name, origin) of every defence: ``built-in``, or the entry point's package and version."""
    entries = plugins.entry_points("defence")
    return [(n, "built-in") for n in DEFENCES] + [(n, entries[n].origin) for n in sorted(entries)
                                                  if n not in DEFENCES]

#: Every defence with its keys and their defaults.
DEFENCES: dict[str, dict[str, Any]] = {
    "none": {},
    "local_dp": {"clip": 1.0, "sigma": 0.1, "noise": "gaussian"},
    "dp_sgd": {"clip": 1.0, "sigma": 1.0, "delta": 1e-5},
    "central_dp": {"clip": 1.0, "sigma": 0.1},
    "prune": {"keep": 0.1},
    "quantize": {"bits": 1, "stochastic": False},
    "mixup": {"k": 2, "alpha": 1.0, "sign_flip": False},
    "fedavg": {"steps": 5},
}
NOISES = ("gaussian", "laplace")
#: Defences applied to the finished update (the rest change local training or the server).
UPDATE_TRANSFORMS = ("local_dp", "prune", "quantize")


#: The number keys of each defence and their type (what :func:`validate_defence` checks and converts).
NUMBER_KEYS: dict[str, type] = {"clip": float, "sigma": float, "delta": float, "keep": float, "alpha": float,
                                "bits": int, "k": int, "steps": int}


def _number(spec: dict[str, Any], key: str, low: float, high: float = float("inf"),
            low_open: bool = False, integer: bool = False) -> float:
    # a number written another way ("1e-3", 1e1 for an integer key) as the number (fedmjp.config.as_number)
    value = spec[key] = as_number(int if integer else float, spec[key])
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"defence {spec['name']!r}: {key} must be {kind}, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"defence {spec['name']!r}: {key}={value!r} outside {bracket}{low}, {high}]")
    return value


def validate_defence(spec: Any) -> dict[str, Any]:
    """The complete, checked defence spec for ``spec`` (a mapping with ``name``, or None for none).

    Raises:
        ValueError: unknown name or key (the valid ones are listed) or a value out of range.
    """
    if spec is None:
        spec = {"name": "none"}
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"a defence must be a mapping like {{name: local_dp, clip: 1.0, sigma: 0.1}}, got {spec!r}")
    name = spec.get("name", "none")
    if name not in DEFENCES:
        return _validate_plugin(name, spec)
    unknown = sorted(set(spec) - set(DEFENCES[name]) - {"name"})
    if unknown:
        valid = ", ".join(["name", *DEFENCES[name]])
        raise ValueError(f"defence {name!r}: unknown key(s) {unknown}; valid: {valid}")
    out = {"name": name, **DEFENCES[name], **{k: v for k, v in spec.items() if k != "name"}}
    if name in ("local_dp", "dp_sgd", "central_dp"):
        _number(out, "clip", 0.0, low_open=True)
        _number(out, "sigma", 0.0)
    if name == "local_dp" and out["noise"] not in NOISES:
        raise ValueError(f"defence 'local_dp': noise must be one of {', '.join(NOISES)}, got {out['noise']!r}")
    if name == "dp_sgd":
        _number(out, "delta", 0.0, 1.0, low_open=True)
    if name == "prune":
        _number(out, "keep", 0.0, 1.0, low_open=True)
    if name == "quantize":
        _number(out, "bits", 1, 16, integer=True)
        if not isinstance(out["stochastic"], bool):
            raise ValueError(f"defence 'quantize': stochastic must be true or false, got {out['stochastic']!r}")
    if name == "mixup":
        _number(out, "k", 1, integer=True)
        _number(out, "alpha", 0.0, low_open=True)
        if not isinstance(out["sign_flip"], bool):
            raise ValueError(f"defence 'mixup': sign_flip must be true or false, got {out['sign_flip']!r}")
    if name == "fedavg":
        _number(out, "steps", 1, integer=True)
    return {k: (float(v) if isinstance(v, int) and not isinstance(v, bool) and NUMBER_KEYS.get(k) is float else v)
            for k, v in out.items()}


def _validate_plugin(name: Any, spec: Mapping[str, Any]) -> dict[str, Any]:
    """A plug-in defence's complete spec: its keys and their defaults' types, then its own check."""
    defence = plugin_defence(name)
    if defence is None:
        valid = ", ".join(n for n, _ in defence_names())
        raise ValueError(f"unknown defence {name!r}; valid: {valid}, or a plug-in's package.module:Name")
    keys = dict(type(defence).defaults)
    unknown = sorted(set(spec) - set(keys) - {"name"})
    if unknown:
        raise ValueError(f"defence {name!r}: unknown key(s) {unknown}; valid: {', '.join(['name', *keys])}")
    out = {"name": name, **keys, **{k: v for k, v in spec.items() if k != "name"}}
    for key, default in keys.items():
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            kind = int if isinstance(default, int) else float
            out[key] = value = as_number(kind, out[key])
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
                raise ValueError(f"defence {name!r}: {key} must be {'an integer' if kind is int else 'a number'}, "
                                 f"got {value!r}")
            out[key] = kind(value)
        elif isinstance(default, bool) and not isinstance(out[key], bool):
            raise ValueError(f"defence {name!r}: {key} must be true or false, got {out[key]!r}")
    try:
        defence.check(out)
    except ValueError as err:
        raise ValueError(f"defence {name!r}: {err}") from err
    return out


def defence_label(spec: Mapping[str, Any]) -> str:
    """Short text for tables and plots: ``local_dp(clip=1.0, sigma=0.1)``."""
    spec = validate_defence(spec)
    args = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "name")
    return spec["name"] if not args else f"{spec['name']}({args})"

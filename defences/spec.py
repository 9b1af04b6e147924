"""Defence specifications: names, keys, defaults and validation (plain data, no torch).

A defence spec is a mapping ``{name: <defence>, <key>: <value>, ...}``; keys left out take the
defaults below. :func:`validate_defence` returns the complete spec as a typed, immutable
:class:`DefenceSpec` (``spec.sigma``) or raises ``ValueError`` naming the bad name/key/value and
listing the valid ones, so a typo fails before anything runs.

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

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Mapping, Optional, get_args

from pydantic import ConfigDict, create_model, model_validator

from fedmjp import config as core
from fedmjp import plugins
from fedmjp.config import Float, Int, Schema, option

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

Noise = Literal["gaussian", "laplace"]
NOISES: tuple[str, ...] = get_args(Noise)


@dataclass(frozen=True)
class Observation:
    """What a defence does to each entry of the update a client sends, as an attacker who knows its
    spec models it (Kerckhoffs's principle): :meth:`DefenceSpec.observation`, read by every attack
    that models a defence (``april_robust``'s noise model, ``ig_closed_start``'s ``defence_model``).
    Scales are in the units the defence acts in; ``attacks.AttackMetadata.defence_noise`` gives
    them in gradient units.

    Attributes:
        what: the defence in words, for an attack's notes.
        perturbs: False where the client sends its clean update (no defence, central DP, mixup,
            FedAvg's local steps): there is nothing to model entrywise.
        noise: the law of the i.i.d. additive noise per entry, or None.
        sigma: its noise multiplier: the scale (Gaussian std, Laplace b) is :attr:`noise_scale`,
            sigma * clip.
        clip: the L2 bound the signal is clipped to before the noise is added.
        per_example: DP-SGD: ``clip`` bounds each example's gradient; the noise is added to the
            sum over the batch, which is then divided by the batch size, at every local step.
            Otherwise (local DP) ``clip`` bounds the whole update and the noise is added to it.
        quant_bits, quant_stochastic: a per-tensor quantiser (defences/transforms.py), or None.
        prune_keep: the kept share of a top-k pruning (the zeros are missing entries), or None.
    """

    what: str
    perturbs: bool = True
    noise: Optional[Noise] = None
    sigma: float = 0.0
    clip: float = 0.0
    per_example: bool = False
    quant_bits: Optional[int] = None
    quant_stochastic: bool = False
    prune_keep: Optional[float] = None

    @property
    def noise_scale(self) -> float:
        return self.sigma * self.clip


class DefenceSpec(Schema):
    """A checked defence spec, as :func:`validate_defence` returns it: ``name`` and that defence's
    keys as typed, immutable attributes (``spec.sigma``); :meth:`as_dict` is the plain data a run
    config, a result row or a plug-in's :meth:`UpdateDefence.apply` receives."""

    model_config = ConfigDict(frozen=True)
    name: str

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @property
    def label(self) -> str:
        """Short text for tables and plots: ``local_dp(clip=1.0, sigma=0.1)``."""
        args = ", ".join(f"{k}={v}" for k, v in self.as_dict().items() if k != "name")
        return f"{self.name}({args})" if args else self.name

    def observation(self) -> Optional[Observation]:
        """What this defence does to each entry of the update (:class:`Observation`); None where no
        attack models it (a plug-in defence)."""
        return None


# One schema per defence (fedmjp.config, like every other config): keys, types, defaults, ranges,
# and what it does to an update (the table of the module docstring, as an Observation).
class NoDefence(DefenceSpec):
    name: Literal["none"] = "none"

    def observation(self) -> Observation:
        return Observation("no defence", perturbs=False)


#: The largest noise scale sigma * clip a DP defence takes: beyond it Gaussian or Laplace draws
#: overflow the clients' float32 updates (max 3.4e38) and the squared scale overflows float64, so no
#: update would arrive; 1e30 is already pure noise for any model.
MAX_NOISE_SCALE = 1e30
#: The largest magnitude of an entry a defence may send (clients/defence.py checks every defence's
#: update): room above MAX_NOISE_SCALE for the tails of its noise, while the update's squared norm
#: in float64 (the defence_cos column) stays finite for any model (1e72 per entry).
MAX_UPDATE_MAGNITUDE = 1e36


class _NoiseBounded(DefenceSpec):
    """A DP defence whose noise scale sigma * clip must stay representable (:data:`MAX_NOISE_SCALE`)."""

    @model_validator(mode="after")
    def _noise_in_range(self) -> "_NoiseBounded":
        scale = float(getattr(self, "sigma")) * float(getattr(self, "clip"))
        if not scale <= MAX_NOISE_SCALE:
            raise ValueError(f"sigma x clip = {scale:.3g} is beyond {MAX_NOISE_SCALE:g}: noise this large "
                             "overflows the clients' float32 updates; lower sigma or clip")
        return self


class LocalDp(_NoiseBounded):
    name: Literal["local_dp"] = "local_dp"
    clip: Float = option(1.0, gt=0.0)
    sigma: Float = option(0.1, ge=0.0)
    noise: Noise = "gaussian"

    def observation(self) -> Observation:
        return Observation("local_dp", noise=self.noise, sigma=self.sigma, clip=self.clip)


class DpSgd(_NoiseBounded):
    name: Literal["dp_sgd"] = "dp_sgd"
    clip: Float = option(1.0, gt=0.0)
    sigma: Float = option(1.0, ge=0.0)
    delta: Float = option(1e-5, gt=0.0, le=1.0)

    def observation(self) -> Observation:
        return Observation("dp_sgd", noise="gaussian", sigma=self.sigma, clip=self.clip, per_example=True)


class CentralDp(_NoiseBounded):
    name: Literal["central_dp"] = "central_dp"
    clip: Float = option(1.0, gt=0.0)
    sigma: Float = option(0.1, ge=0.0)

    def observation(self) -> Observation:
        return Observation("central DP (the client sends its clean update)", perturbs=False)


class Prune(DefenceSpec):
    name: Literal["prune"] = "prune"
    keep: Float = option(0.1, gt=0.0, le=1.0)

    def observation(self) -> Observation:
        return Observation(f"prune keep {self.keep}", prune_keep=self.keep)


class Quantize(DefenceSpec):
    name: Literal["quantize"] = "quantize"
    bits: Int = option(1, ge=1, le=16)
    stochastic: bool = False

    def observation(self) -> Observation:
        return Observation(f"quantize {self.bits} bit", quant_bits=self.bits, quant_stochastic=self.stochastic)


class Mixup(DefenceSpec):
    name: Literal["mixup"] = "mixup"
    k: Int = option(2, ge=1)
    alpha: Float = option(1.0, gt=0.0)
    sign_flip: bool = False

    def observation(self) -> Observation:
        return Observation("mixup (a clean gradient of the mixed image)", perturbs=False)


class FedAvg(DefenceSpec):
    name: Literal["fedavg"] = "fedavg"
    steps: Int = option(5, ge=1)

    def observation(self) -> Observation:
        return Observation("FedAvg local steps (the update is not perturbed entrywise)", perturbs=False)


SCHEMAS: dict[str, type[DefenceSpec]] = {
    schema.model_fields["name"].default: schema
    for schema in (NoDefence, LocalDp, DpSgd, CentralDp, Prune, Quantize, Mixup, FedAvg)}
#: Every defence with its keys (besides ``name``) and their defaults.
DEFENCES: dict[str, dict[str, Any]] = {name: schema.model_validate({}).as_dict() for name, schema in SCHEMAS.items()}
for _keys in DEFENCES.values():
    del _keys["name"]
#: Defences applied to the finished update (the rest change local training or the server).
UPDATE_TRANSFORMS = ("local_dp", "prune", "quantize")
#: The number keys of the defences and their type.
NUMBER_KEYS: dict[str, type] = {key: int if info.annotation is int else float for schema in SCHEMAS.values()
                                for key, info in core.keys(schema).items() if info.annotation in (int, float)}


def validate_defence(spec: Any) -> DefenceSpec:
    """The complete, checked defence spec for ``spec`` (a mapping with ``name``, a name, None for
    none, or a :class:`DefenceSpec`, returned as it is).

    Raises:
        ValueError: unknown name or key (the valid ones are listed) or a value out of range.
    """
    if isinstance(spec, DefenceSpec):
        return spec
    if spec is None or isinstance(spec, str):
        spec = {"name": spec or "none"}
    if not isinstance(spec, Mapping):
        raise ValueError(f"a defence must be a mapping like {{name: local_dp, clip: 1.0, sigma: 0.1}}, got {spec!r}")
    name = spec.get("name", "none")
    if not isinstance(name, str):
        raise ValueError(f"a defence's name must be a string (one of {', '.join(SCHEMAS)} or a plug-in's), got {name!r}")
    if name in SCHEMAS:
        return _parse(name, SCHEMAS[name], spec)
    defence = plugin_defence(name)
    if defence is None:
        valid = ", ".join(n for n, _ in defence_names())
        raise ValueError(f"unknown defence {name!r}; valid: {valid}, or a plug-in's package.module:Name")
    # ignore: mypy rejects a class object as typeshed's Hashable (the lru_cache argument type;
    # python/mypy#11470, type[C] is checked with C's unbound __hash__); every class is hashable.
    out = _parse(name, _plugin_schema(type(defence)), spec)  # type: ignore[arg-type]
    try:
        plugins.call(f"defence {name!r}", defence.check, out.as_dict())
    except plugins.PluginError:
        raise
    except ValueError as err:
        raise ValueError(f"defence {name!r}: {err}") from err
    return out


def _parse(name: Any, schema: type[DefenceSpec], spec: Mapping[str, Any]) -> DefenceSpec:
    """``spec`` as the schema's model, defaults filled in, every value checked (fedmjp.config)."""
    unknown = sorted(set(spec) - set(core.keys(schema)), key=str)
    if unknown:  # every unknown key at once, not only the first
        raise ValueError(f"defence {name!r}: unknown key(s) {unknown}; valid: {', '.join(core.keys(schema))}")
    try:
        return core.parse(schema, {"name": name, **spec})
    except core.ConfigError as err:
        raise ValueError(f"defence {name!r}: {err}") from None


@functools.cache
def _plugin_schema(cls: type[UpdateDefence]) -> type[DefenceSpec]:
    """A schema of a plug-in's ``defaults``: each key typed by its default (an int default makes an
    integer key, a float one a number key; a number written ``1e-3`` is a number)."""
    def kind(value: Any) -> Any:
        return core.number_type(type(value)) if isinstance(value, (bool, int, float, str)) else Any

    fields: dict[str, Any] = {key: (kind(value), value) for key, value in cls.defaults.items()}
    return create_model(f"{cls.__name__}Spec", __base__=DefenceSpec, **fields)


def defence_label(spec: Any) -> str:
    """Short text for tables and plots: ``local_dp(clip=1.0, sigma=0.1)`` (:attr:`DefenceSpec.label`)."""
    return validate_defence(spec).label

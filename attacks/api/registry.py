"""The attack registry and the options of an attack by name.

Built-ins register with :func:`register_attack`; plug-ins from other packages are named by an entry
point of group ``fedmjp.attacks`` or a ``package.module:Name`` reference (fedmjp/plugins.py,
docs/plugins.md) and loaded when a config names them. :func:`create_attack` builds an attack by name
with its options checked against the attack's schema (:func:`option_schema`: its ``Options``, or a
plug-in's ``__init__`` signature) first.
"""
from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from pydantic import create_model

from fedmjp import config as core
from fedmjp import plugins

from .base import Attack, AttackOptions, parse_options

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


@dataclass(frozen=True)
class Threat:
    """What an attack needs of the update it is given (its threat model), as an attack class
    declares it in a ``threat`` class attribute; each field a short text, ``any`` where it needs nothing.

    Attributes:
        batch: the batch sizes it reads (``1``, ``any``, ``B T <= width``).
        labels: whether the server must know the labels (``not needed``, ``known or counted``).
        architecture: the model it reads (``ViT with a learned position embedding``).
        precision: the client precision it needs to be exact (``float64``, ``any``).
    """

    batch: str = "any"
    labels: str = "any"
    architecture: str = "any"
    precision: str = "any"

    def text(self) -> str:
        return (f"batch {self.batch}; labels {self.labels}; architecture: {self.architecture}; "
                f"precision {self.precision}")


def attack_threat(name: str) -> Optional[Threat]:
    """The threat model attack ``name`` declares (its class's ``threat``), or None where it declares
    none (a plug-in, an attack not yet described). Raises like :func:`attack_class`."""
    threat = getattr(attack_class(name), "threat", None)
    return threat if isinstance(threat, Threat) else None


def attack_summary(name: str) -> str:
    """One line on attack ``name``: its declared threat model, else its class docstring's first
    sentence marked as such. A plug-in is not imported to describe it (listing runs no plug-in
    code): its line says so."""
    if name not in _REGISTRY:
        return "a plug-in's threat model: see its package (not imported to list it)"
    threat = attack_threat(name)
    if threat is not None:
        return threat.text()
    doc = " ".join(((attack_class(name).__doc__ or "").strip().split("\n\n")[0]).split())
    return f"threat model not declared; {doc}" if doc else "threat model not declared"


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


def option_schema(factory: Callable[..., Any]) -> type[core.Schema]:
    """The options schema of an attack class: the ``Options`` it declares (built-ins: one
    :class:`AttackOptions` per attack, like a defence's spec in defences/spec.py).

    A plug-in written against docs/plugins.md declares its options as annotated keyword arguments of
    its own ``__init__`` instead; its schema is read off that signature (number annotations typed as
    config keys, other options any value; ``**options`` adds the schema of the class they are passed
    up to). Parameters named ``_...`` and, for a ``takes_name`` factory, ``name`` are no options.
    """
    mro = factory.__mro__ if isinstance(factory, type) else ()
    owner = next((k for k in mro if "__init__" in vars(k)), None)
    declared = next((k for k in mro if "Options" in vars(k)), None)
    if declared is not None and owner is not None and mro.index(declared) <= mro.index(owner):
        return factory.Options  # type: ignore[attr-defined]
    return _signature_schema(factory, owner)


@functools.cache
def _signature_schema(factory: Callable[..., Any], owner: Optional[type]) -> type[core.Schema]:
    init = owner.__init__ if owner is not None else factory  # type: ignore[misc]
    params = list(inspect.signature(init).parameters.values())
    try:
        hints = typing.get_type_hints(init)
    except (NameError, TypeError):  # unresolvable annotations: the names without types
        hints = {}
    skip = {"self", "name"} if getattr(factory, "takes_name", False) else {"self"}
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in skip and not p.name.startswith("_"):
            tp = hints.get(p.name, Any)
            number = any(m in (int, float) for m in typing.get_args(tp) or (tp,))
            fields[p.name] = (core.number_type(tp) if number else Any, ... if p.default is p.empty else p.default)
    base: type[core.Schema] = core.Schema
    if any(p.kind is p.VAR_KEYWORD for p in params):
        base = getattr(factory, "Options", AttackOptions)
    return create_model(f"{getattr(factory, '__name__', 'Attack')}Options", __base__=base, **fields)



def attack_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of attack ``name`` checked against its schema (:func:`option_schema`), as given
    with number options converted (``"1e-4"`` -> 0.0001, ``1e3`` -> 1000 for an integer option).

    Raises:
        ValueError: an unknown name or option, or a value its option does not take.
    """
    checked = parse_options(name, option_schema(attack_class(name)), options)
    return {key: getattr(checked, key) for key in options}


def create_attack(name: str, **options: Any) -> Attack:
    """Build an attack by name (built-in, entry point or ``package.module:Name``), its options
    checked against its schema first (:func:`attack_options`): a number written another way
    (``"1e-4"``, ``1e3`` for an integer option) becomes that number, a bool or text is refused.

    Raises:
        ValueError: unknown name (the message lists the valid ones), a plug-in that cannot be
            loaded, or bad options.
    """
    factory = attack_class(name)
    options = attack_options(name, options)
    attack = factory(name=name, **options) if getattr(factory, "takes_name", False) else factory(**options)
    if not isinstance(attack, Attack):
        raise ValueError(f"attack {name!r}: its factory returned {type(attack).__name__}, not an Attack")
    if not attack.name:  # a plug-in without its own name is known by the name the config gave
        attack.name = name
    return attack


"""Attacks, defences and models from other installed packages (plug-ins), named two ways.

* **Entry points**: a package declares ``[project.entry-points."fedmjp.attacks"]`` (or
  ``fedmjp.defences``, ``fedmjp.models``) ``my_attack = "mypkg.attacks:MyAttack"``; a config then
  names ``my_attack`` like a built-in. Found through :func:`importlib.metadata.entry_points`, so the
  package must be installed (``pip install -e .`` of it, or any distribution on ``sys.path``).
* **A code reference** ``package.module:Name`` written where the name goes
  (``attack: {name: mypkg.attacks:MyAttack}``). This imports ``package.module`` the way
  ``import package.module`` would: only modules Python can already import (installed packages, the
  working directory, ``PYTHONPATH``); never a file path, never code written in the config itself.
  It is a deliberate reference to code the user installed, like an entry point without the
  packaging step.

Both are loaded lazily: listing names reads package metadata only; a plug-in's module is imported
when a config names it. Errors are :class:`PluginError` (a ``ValueError``) naming the reference and
what went wrong (module not found, attribute missing, wrong kind of object). See docs/plugins.md.

The processes that use a plug-in import it themselves: the clients (defences, models) and the
attack workers (attacks), so on a Ray cluster or a deployed federation the package must be
installed where they run (docs/plugins.md, "Where the plug-in must be installed").

A plug-in's call may raise what ``except Exception`` does not catch: ``SystemExit`` (``sys.exit()``)
or its own ``KeyboardInterrupt``. :func:`call` turns both into a :class:`PluginError` naming the
plug-in, so that neither ends a run as a success nor passes for the user's Ctrl-C: the CLI's
SIGINT and SIGTERM handlers record that a signal arrived, and a ``KeyboardInterrupt`` with no
signal recorded is the plug-in's (:func:`interrupted_by_user`).
"""
from __future__ import annotations

import importlib
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Optional, TypeVar

#: Entry-point group of each kind of plug-in.
GROUPS = {"attack": "fedmjp.attacks", "defence": "fedmjp.defences", "model": "fedmjp.models"}

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_REFERENCE = re.compile(rf"{_IDENT}(?:\.{_IDENT})*:{_IDENT}(?:\.{_IDENT})*")


#: The origin of a plug-in named by a ``package.module:Name`` reference in a config (not an entry point).
REFERENCE_ORIGIN = "module reference"


class PluginError(ValueError):
    """A plug-in reference that cannot be loaded or is not the kind of object its group takes, or a
    plug-in's call that exited, raised its own KeyboardInterrupt or returned what its kind may not."""


def interrupted_by_user() -> bool:
    """Whether a ``KeyboardInterrupt`` just raised is the user's. A SIGINT or SIGTERM handler that
    records the user's signals says so with a true ``records_signals`` attribute and sets its
    ``received`` attribute to the signal when one arrives (run_benchmark.py installs such handlers):
    with one installed, an interrupt is the user's only if a signal was received; with none, every
    interrupt is taken as the user's."""
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    recording = [h for h in handlers if getattr(h, "records_signals", False)]
    return not recording or any(getattr(h, "received", None) is not None for h in recording)


T = TypeVar("T")


def call(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, a plug-in's call: its ``SystemExit`` and its own ``KeyboardInterrupt``
    (no user signal recorded) become a :class:`PluginError` naming ``what``; other exceptions pass.
    The user's interrupt is re-raised as it is."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as err:
        raise PluginError(f"{what} called sys.exit({err.code!r}); a plug-in must return or raise an "
                          "exception") from None
    except KeyboardInterrupt:
        if interrupted_by_user():
            raise
        raise PluginError(f"{what} raised KeyboardInterrupt without a user interrupt; a plug-in must "
                          "return or raise an exception") from None


@dataclass(frozen=True)
class Plugin:
    """A named plug-in: ``value`` is its ``module:attribute`` reference, ``origin`` says where the
    name comes from (``entry point (mypkg 0.1)`` or ``module reference``)."""

    name: str
    value: str
    origin: str


def is_reference(name: Any) -> bool:
    """True for a ``package.module:Name`` code reference."""
    return isinstance(name, str) and _REFERENCE.fullmatch(name) is not None


def entry_points(kind: str) -> dict[str, Plugin]:
    """The plug-ins installed packages declare for ``kind`` (``attack``, ``defence``, ``model``), by
    name; read from package metadata on every call (nothing is imported)."""
    found: dict[str, Plugin] = {}
    for ep in metadata.entry_points(group=GROUPS[kind]):
        dist = getattr(ep, "dist", None)
        origin = f"entry point ({dist.name} {dist.version})" if dist is not None else "entry point"
        found.setdefault(ep.name, Plugin(ep.name, ep.value, origin))
    return found


def find(kind: str, name: Any) -> Optional[Plugin]:
    """The plug-in ``name`` stands for: an entry point of that name, else a ``module:Name``
    reference, else None (not a plug-in name)."""
    if not isinstance(name, str):
        return None
    plugin = entry_points(kind).get(name)
    if plugin is None and is_reference(name):
        plugin = Plugin(name, name, REFERENCE_ORIGIN)
    return plugin


def load(kind: str, plugin: Plugin, base: Optional[type] = None) -> Any:
    """Import the object ``plugin`` refers to; with ``base``, it must be a subclass of it.

    Raises:
        PluginError: the module is not importable (not installed here), it fails to import, the
            attribute is missing, or the object is not a ``base`` subclass.
    """
    what = f"{kind} {plugin.name!r}" + ("" if plugin.value == plugin.name else f" ({plugin.value})")
    if not is_reference(plugin.value):
        raise PluginError(f"{what}: an entry point must look like package.module:Name, got {plugin.value!r}")
    module_name, _, attribute = plugin.value.partition(":")
    if module_name.partition(".")[0] in sys.stdlib_module_names:
        # A plug-in is code a user installed; the standard library holds no fedmjp plug-in, and a
        # config naming os:system or subprocess:run must not reach a call.
        raise PluginError(f"{what}: {module_name!r} is a standard-library module, not a plug-in package")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise PluginError(f"{what}: module {module_name!r} not found; install the package that provides it "
                              "(it must be importable wherever fedmjp and its clients run)") from err
        raise PluginError(f"{what}: importing {module_name!r} failed: {err}") from err
    except (Exception, SystemExit) as err:  # the plug-in's own import-time error, reported with the reference
        # SystemExit too: a module calling sys.exit() on import would otherwise end the run with
        # its status (0: "success" with nothing done).
        raise PluginError(f"{what}: importing {module_name!r} failed: {type(err).__name__}: {err}") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what}: {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if kind == "model" and plugin.origin == REFERENCE_ORIGIN and not _timm_registered(obj):
        # A reference in a config reaches only the documented kinds of object: an arbitrary
        # callable (torch.hub:load, a loader, ...) called with the config's kwargs would execute
        # whatever the config points it at. Entry points are declared by an installed package.
        raise PluginError(f"{what}: {plugin.value} is not a model function registered with timm; decorate it "
                          "with @timm.models.register_model (docs/plugins.md, Models) or declare it as a "
                          "fedmjp.models entry point")
    if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
        got = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        raise PluginError(f"{what}: {plugin.value} is not a subclass of {base.__module__}.{base.__qualname__} "
                          f"(got {got})")
    return obj


def _timm_registered(obj: Any) -> bool:
    """True when ``obj`` is the model function timm's registry holds under its own name."""
    from timm.models import is_model, model_entrypoint

    name = getattr(obj, "__name__", None)
    return isinstance(name, str) and callable(obj) and is_model(name) and model_entrypoint(name) is obj

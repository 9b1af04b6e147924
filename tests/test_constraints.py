"""The install is reproducible: ``constraints.txt`` (which ``scripts/setup.sh`` passes to pip with
``-c``) pins every dependency pyproject.toml names, each pin inside pyproject's range.

A dependency added to pyproject without a pin would let a fresh machine resolve whatever is newest on
the day, the way pydantic 2.14 / mypy 2.4 once broke the typed-seams check on a new virtualenv while
this machine's older packages passed.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==", f"constraints.txt: {line!r} is not an exact pin"
        assert canonicalize_name(req.name) not in pins, f"constraints.txt pins {req.name} twice"
        pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra]
    return reqs


def test_every_dependency_is_pinned_inside_its_range():
    pins = _pins()
    declared = _declared()
    assert declared, "pyproject.toml declares no dependencies"
    for req in declared:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) has no pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]} outside pyproject's {req.specifier}")


def test_setup_installs_with_the_constraints():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-c constraints.txt" in setup
    # the install stamp changes when the pins change, so a new pin is installed
    assert "constraints.txt | sha256sum" in setup

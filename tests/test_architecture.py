"""The one-way import rules (``[tool.importlinter]`` in pyproject.toml) hold, and breaking one fails;
the typed modules (``[tool.mypy]``) pass mypy.

Data flows entry -> benchmark -> {server -> clients, attacks, metrics, defences} -> fedmjp. The
contracts are checked by import-linter in a subprocess whose working directory is the tree under
test (import-linter puts it first on ``sys.path``, ahead of any installed copy). The second test
copies the packages to a temporary folder, adds one wrong arrow and checks that the contract it
breaks is reported as broken with that very import: the check can fail.

mypy checks the config schemas and the code that reads them (``files`` of ``[tool.mypy]``: the
benchmark, fedmjp/config.py, ...) through its API from the project root, with mypy's incremental
cache (``.mypy_cache/``): a warm run takes a few seconds. A snippet that misreads a schema shows
that the check sees the schemas' field types (pydantic's mypy plugin) and can fail.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import importlinter  # noqa: F401  (a test dependency: pip install -e ".[test]"; missing is an error, not a skip)
import mypy.api  # a test dependency too: missing is an error, not a skip
import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES = CONFIG["root_packages"]
CONTRACT_NAMES = {c["id"]: c["name"] for c in CONFIG["contracts"]}


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the packages under ``root`` (no cache: the copies change between runs)."""
    cmd = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
           "--no-cache", "--no-logo", "--config", str(root / "pyproject.toml")]
    # COLUMNS: rich wraps long contract names at the terminal width, which would split them here.
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold() -> None:
    res = lint_imports(ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert f"Contracts: {len(CONTRACT_NAMES)} kept, 0 broken." in out, out
    for name in CONTRACT_NAMES.values():
        assert f"{name} KEPT" in out, out


#: (contract id, file to change, the line added, "importer -> imported" as import-linter reports it).
#: The lazy ones sit inside a function: import-linter sees them too.
WRONG_ARROWS = [
    ("core", "fedmjp/settings.py", "def _late():\n    import benchmark.config  # noqa: F401\n",
     "fedmjp.settings -> benchmark.config"),
    ("attacks", "attacks/api/base.py", "import metrics.pixel  # noqa: E402,F401\n", "attacks.api.base -> metrics.pixel"),
    ("attacks-layers", "attacks/closed_form/labels.py", "def _late():\n    from ..optimization import matching  # noqa: F401\n",
     "attacks.closed_form.labels -> attacks.optimization.matching"),
    ("attacks-layers", "attacks/solvers/spans.py", "def _late():\n    from ..api import base  # noqa: F401\n",
     "attacks.solvers.spans -> attacks.api.base"),
    ("metrics", "metrics/pixel.py", "def _late():\n    from fedmjp import devices  # noqa: F401\n",
     "metrics.pixel -> fedmjp.devices"),
    ("defences", "defences/dp.py", "import clients.runconfig  # noqa: E402,F401\n", "defences.dp -> clients.runconfig"),
    ("clients", "clients/update.py", "def _late():\n    import server.tap  # noqa: F401\n", "clients.update -> server.tap"),
    ("clients-plain-pytorch", "clients/partition.py", "import flwr.app  # noqa: E402,F401\n",
     "clients.partition -> flwr"),
    ("server", "server/tap.py", "import benchmark.store  # noqa: E402,F401\n", "server.tap -> benchmark.store"),
]


@pytest.mark.slow
@pytest.mark.parametrize("contract, path, line, arrow", WRONG_ARROWS, ids=[w[0] for w in WRONG_ARROWS])
def test_a_wrong_arrow_breaks_its_contract(tmp_path: Path, contract: str, path: str, line: str, arrow: str) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / path
    target.write_text(target.read_text() + "\n\n" + line)
    res = lint_imports(tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert f"{CONTRACT_NAMES[contract]} BROKEN" in out, out
    assert arrow in out, out  # the report names the added import, so it analysed the copy


def run_mypy(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    """(exit status, report) of mypy with pyproject.toml's ``[tool.mypy]``, run from the project root
    (``files`` and the cache are relative to it) in this process; ``args`` replace ``files``."""
    monkeypatch.chdir(ROOT)
    stdout, stderr, status = mypy.api.run(["--config-file", str(ROOT / "pyproject.toml"), *args])
    return status, stdout + stderr


@pytest.mark.slow
def test_typed_modules_pass_mypy(monkeypatch: pytest.MonkeyPatch) -> None:
    status, out = run_mypy(monkeypatch)
    assert status == 0, out
    assert "Success: no issues found" in out, out


@pytest.mark.slow
def test_mypy_reads_the_schema_types(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A misread schema field is an error: the check can fail, and it sees ``cfg.federation.rounds``
    as the schema's int (not Any)."""
    misread = tmp_path / "misread.py"
    misread.write_text("from benchmark.config import BenchmarkConfig\n\n\n"
                       "def rounds(cfg: BenchmarkConfig) -> str:\n"
                       "    return cfg.federation.rounds\n\n\n"
                       "def typo(cfg: BenchmarkConfig) -> int:\n"
                       "    return cfg.federation.round\n")
    status, out = run_mypy(monkeypatch, str(misread))
    assert status == 1, out
    assert 'Incompatible return value type (got "int", expected "str")' in out, out
    assert '"Federation" has no attribute "round"' in out, out


def test_no_test_module_rebinds_an_imported_name():
    """A later ``from ... import name`` silently replaces an earlier one. Tests that skip on the CI
    machine (the ``cuda`` ones) would only fail where they run: a GPU found one calling
    ``helpers.normalize`` with the arguments of ``fedmjp.factory.normalize``."""
    import ast

    clashes = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        bound: dict[str, int] = {}
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ImportFrom):
                names = [a.asname or a.name for a in node.names if a.name != "*"]
            elif isinstance(node, ast.Import):
                names = [a.asname for a in node.names if a.asname]  # ``import a.b`` binds ``a`` again: harmless
            else:
                continue
            for name in names:
                if name in bound:
                    clashes.append(f"{path.name}:{node.lineno}: {name} (imported at line {bound[name]})")
                bound[name] = node.lineno
    assert not clashes, clashes


def import_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` under ``root`` that its file imports, wherever in the file
    (inside functions too) and however written (relative imports resolved; ``from p import m`` is
    an arrow to the submodule m when p/m.py exists, else to the package p)."""
    import ast

    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for package in packages for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        arrows = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # ``import a.b.c`` of a name defined in a.b
                    target = target.rpartition(".")[0]
                if target and target != module:
                    arrows.add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of ``graph``: one list of modules per group that import each other round a loop
    (Tarjan's strongly connected components of more than one module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_module_of_a_product_package_is_on_an_import_circle() -> None:
    """The layers contracts order the modules of benchmark/ and attacks/ only; this reads every file
    of every product package, imports inside functions included, so a lazy import that closes a
    circle anywhere fails, named."""
    cycles = import_cycles(import_graph(ROOT, PACKAGES))
    assert not cycles, "modules that import each other round a circle: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_circle_check_finds_a_lazy_circle(tmp_path: Path) -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"d"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "top.py").write_text("from .sub import low\n")
    (package / "sub" / "low.py").write_text("def late():\n    from .. import top  # noqa: F401\n")
    (package / "apart.py").write_text("from pkg.sub.low import late  # noqa: F401\n")  # a name: its module
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.apart"] == {"pkg.sub.low"}
    assert import_cycles(graph) == [["pkg.sub.low", "pkg.top"]]

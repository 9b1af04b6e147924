"""Hostile configs: a config or an override that would run code, exhaust memory or time, or nest
without end is refused before any work, in one line naming the key (exit 3), one test per cause on
the tiny runs of tests/test_hostile_inputs.py; then Hypothesis fuzzing of the size keys and of YAML
structure (aliases, nesting, sizes), and the wording of the refusals. docs/security.md describes the
rules tested.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml

from test_hostile_inputs import cli, one_line_error, small_config


# ------------------------------------------------------------------ code execution from a config
def test_a_model_reference_to_any_callable_is_refused(tmp_path: Path, capsys) -> None:
    """torch.hub:load named as an arch with kwargs pointing at a hubconf.py: refused before it is
    called (a model reference must be a timm-registered model function), nothing executed."""
    hub = tmp_path / "hub"
    hub.mkdir()
    marker = tmp_path / "EXECUTED"
    (hub / "hubconf.py").write_text(f"open({str(marker)!r}, 'w').write('x')\ndef m(**kw):\n    return None\n")
    config, out = small_config(tmp_path), tmp_path / "out"
    code = cli(config, out, "--set", "models.0.arch=torch.hub:load", "--set",
               f"models.0.kwargs={{repo_or_dir: {hub}, model: m, source: local}}")
    assert code == 3
    one_line_error(capsys.readouterr().err, "torch.hub:load", "registered with timm")
    assert not marker.exists() and not out.exists()


def test_a_plugin_that_exits_on_import_is_a_config_error(tmp_path: Path, capsys, monkeypatch) -> None:
    """A module calling sys.exit(0) at import must not end the run with 'success' and nothing done."""
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code = cli(small_config(tmp_path), tmp_path / "out", "--set", "attacks=[{name: 'exits_on_import:Thing'}]")
    finally:
        sys.modules.pop("exits_on_import", None)
    assert code == 3
    one_line_error(capsys.readouterr().err, "exits_on_import", "SystemExit")


# ------------------------------------------------------------------ resources: YAML, models, sizes
def _bomb(levels: int = 9, width: int = 10) -> str:
    lines = ["a0: &a0 [" + ", ".join(["x"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "{" + ", ".join(line.replace(": ", ": ", 1) for line in lines) + f", top: *a{levels - 1}}}"


@pytest.mark.parametrize("where", ["models.0.kwargs", "attack.options", "federation"])
def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path: Path, capsys, where: str) -> None:
    """10^9 values in ~600 bytes of anchors: refused by the loader in milliseconds, naming the file."""
    config = small_config(tmp_path)
    text = config.read_text() + "\nbomb: " + _bomb() + "\n"
    config.write_text(text)
    start = time.monotonic()
    assert cli(config, tmp_path / "out") == 3
    assert time.monotonic() - start < 30
    one_line_error(capsys.readouterr().err, str(config), "aliases")
    # the same bomb as a --set value into a free-form mapping
    start = time.monotonic()
    assert cli(small_config(tmp_path), tmp_path / "out", "--set", f"{where}={_bomb()}") == 3
    assert time.monotonic() - start < 30
    one_line_error(capsys.readouterr().err, "aliases")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, words", [
    ("x: " + "[" * 100_000 + "]" * 100_000 + "\n", ["nests deeper"]),
    ("x: '" + "y" * (2 << 20) + "'\n", ["longer than the limit"]),
], ids=["deep", "huge"])
def test_deep_or_huge_configs_are_refused(tmp_path: Path, capsys, text: str, words: list[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    assert cli(config, tmp_path / "out") == 3
    one_line_error(capsys.readouterr().err, str(config), *words)


def test_a_deep_override_key_is_refused(tmp_path: Path, capsys) -> None:
    key = ".".join(["a"] * 50_000)
    assert cli(small_config(tmp_path), tmp_path / "out", "--set", f"{key}=1") == 3
    one_line_error(capsys.readouterr().err, "more than")


@pytest.mark.parametrize("kwargs, words", [
    ("{depth: 0}", ["depth", ">= 1"]),
    ("{embed_dim: 1}", ["embed_dim", "AssertionError"]),
    ("{num_heads: 0}", ["num_heads", "ZeroDivisionError"]),
    ("{embed_dim: 300000, num_heads: 1}", ["parameters", "memory"]),
    ("{depth: 1000000000}", ["parameters", "memory"]),
    ("{checkpoint_path: /nonexistent.pth}", ["checkpoint_path", "checkpoint"]),
])
def test_bad_model_kwargs_are_config_errors(tmp_path: Path, capsys, kwargs: str, words: list[str]) -> None:
    """Whatever a constructor raises for kwargs it cannot take, and kwargs whose model would not fit
    in memory (counted on the meta device first), are config errors naming them (exit 3)."""
    start = time.monotonic()
    assert cli(small_config(tmp_path), tmp_path / "out", "--set", f"models.0.kwargs={kwargs}") == 3
    assert time.monotonic() - start < 60
    one_line_error(capsys.readouterr().err, *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("setting, words", [
    ("data.image_size=100000", ["data.image_size", "[1, 1024]", "100000"]),
    ("federation.local_steps=1000000000", ["federation.local_steps", "[1, 1000]"]),
    ("federation.batch_size=5000", ["federation.batch_size", "[1, 1024]"]),
    ("federation.options={image-size: 100000}", ["image-size", "1024"]),
    ("defence={name: local_dp, sigma: 1.0e+308}", ["local_dp", "sigma x clip", "lower sigma or clip"]),
    ("defence={name: dp_sgd, sigma: 1.0e+308, clip: 1.0e+308}", ["dp_sgd", "sigma x clip"]),
    ("federation.rounds=1000000000", ["federation.rounds", "[1, 100000]"]),
    ("data.num_classes=1000000000", ["data.num_classes", "[1, 100000]"]),
    ("attacks=[{name: ig_closed_start, options: {restarts: 1000000000}}]", ["restarts", "[0, 1,000]"]),
    ("attacks=[{name: batch_match, options: {iterations: 10000000}}]", ["iterations", "[0, 1,000,000]"]),
])
def test_sizes_that_set_a_run_s_memory_and_time_are_bounded_before_work(tmp_path: Path, capsys, setting: str,
                                                                         words: list[str]) -> None:
    """An image side, a batch, a number of local steps or a DP noise scale beyond its bound is refused
    at once, before any image is resized to that side or any client trains."""
    start = time.monotonic()
    assert cli(small_config(tmp_path), tmp_path / "out", "--set", setting) == 3
    assert time.monotonic() - start < 30
    one_line_error(capsys.readouterr().err, *words)
    assert not (tmp_path / "out").exists()


def test_a_batch_larger_than_a_client_s_images_is_refused_naming_the_share(tmp_path: Path, capsys) -> None:
    """A batch holds distinct images: B beyond the images a client holds would repeat them (1,000
    copies of one image: 7.4 GB) and is a config error naming the per-client share."""
    cfg = small_config(tmp_path)
    n_images, n_clients = (yaml.safe_load(cfg.read_text())[k] for k in ("data", "federation"))
    per_client = n_images["num_images"] // n_clients["clients"]
    assert cli(cfg, tmp_path / "out", "--set", f"federation.batch_size={per_client + 1}") == 3
    one_line_error(capsys.readouterr().err, "federation.batch_size", f"<= {per_client}")
    assert not (tmp_path / "out").exists()


def test_a_client_never_repeats_an_image_within_a_batch() -> None:
    from clients.partition import private_batch
    from clients.runconfig import resolve_config

    cfg = resolve_config({"num-images": 4, "num-partitions": 2, "batch-size": 3})
    with pytest.raises(ValueError, match="holds 2 image"):
        private_batch(cfg, 0, 1)


# ------------------------------------------------------------------ fuzzing
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


def _yaml_tree(depth: int) -> st.SearchStrategy:
    leaf = st.one_of(st.integers(-5, 5), st.sampled_from(["x", "1e-3", "null", "true"]))
    return st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.sampled_from("abcd"), inner, max_size=3)),
                        max_leaves=depth)


_BOUNDED = {"data.image_size": 1024, "federation.batch_size": 1024, "federation.local_steps": 1000,
            "federation.rounds": 100_000, "data.num_classes": 100_000, "federation.clients": 100_000}


@settings(max_examples=60, deadline=None, database=None)
@given(key=st.sampled_from(sorted(_BOUNDED)),
       value=st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from(["1e9", "1024", "1025", "-1", "0", "x"])),
       sigma=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(0, 10**40)))
def test_fuzz_sizes_are_in_bounds_or_a_config_error_naming_them(key: str, value, sigma) -> None:
    """Whatever number (or text) a size key or a DP noise multiplier gets, validation either accepts a
    value within its bound or refuses it with a ConfigError naming the key; never anything else."""
    from benchmark.config import ConfigError
    from benchmark.validation import validate
    from tests.helpers import tiny_config

    base = tiny_config()
    section, name = key.split(".")
    cfg = {**base, section: {**base.get(section, {}), name: value}}
    try:
        got = validate(cfg)
    except ConfigError as err:
        assert key in str(err), (key, value, str(err))
    else:
        assert 1 <= getattr(getattr(got, section), name) <= _BOUNDED[key]
    try:
        spec = validate({**base, "defence": {"name": "local_dp", "clip": 1.0, "sigma": sigma}}).defence
    except ConfigError as err:
        assert "sigma" in str(err), (sigma, str(err))
    else:
        assert 0 <= spec.sigma * spec.clip <= 1e30


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=_yaml_tree(20), nest=st.integers(0, 200), aliases=st.integers(0, 12), width=st.integers(1, 12),
       key=st.sampled_from(["models.0.kwargs", "attack.options", "federation", "defence", "report", "data"]))
def test_fuzz_yaml_structure_gives_a_config_error_or_a_config(tree, nest: int, aliases: int, width: int,
                                                              key: str) -> None:
    """Any YAML tree, nested up to 200 deep, with up to 12 levels of aliases of width 12 (up to
    12^12 values expanded): a config or a one-line ConfigError, fast, never another exception."""
    from benchmark import config as C
    from benchmark.validation import validate
    from helpers import tiny_config

    body = yaml.safe_dump(tree, default_flow_style=True).strip().removesuffix("...").strip()
    body = "[" * nest + body + "]" * nest
    if aliases:
        body = "{" + _bomb(aliases, width)[1:-1] + f", v: {body}}}"
    base = C.apply_overrides(C.conform(tiny_config()), [])
    start = time.monotonic()
    try:
        validate(C.apply_overrides(base, [f"{key}={body}"]))
    except C.ConfigError as err:
        assert str(err).strip() and "\n" not in str(err).strip(), str(err)
    assert time.monotonic() - start < 20


# ------------------------------------------------------------------ messages
def test_a_file_name_too_long_gets_its_own_advice(tmp_path: Path, capsys) -> None:
    assert cli(small_config(tmp_path), tmp_path / ("x" * 300)) == 10
    line = one_line_error(capsys.readouterr().err, "File name too long", "shorter --output")
    assert "free disk space" not in line


def test_an_interrupt_before_the_output_folder_is_chosen_says_nothing_was_written(tmp_path: Path, capsys,
                                                                                   monkeypatch) -> None:
    import run_benchmark

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_benchmark, "resolve", interrupted)
    assert run_benchmark.main(["--config", str(small_config(tmp_path)), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert "nothing was written" in err and "None" not in err


def test_every_integer_attack_option_but_a_seed_is_a_bounded_count() -> None:
    """Iterations, restarts and other counts of the built-in attacks are bounded (no config can ask
    for a run that never ends); seeds are not counts."""
    import attacks
    from attacks.api.base import COUNT_LIMIT
    from attacks.api.registry import attack_class

    checked = 0
    for name in ("batch_match", "ig_closed_start", "april_robust", "mjp_adaptive", "invertinggradients"):
        fields = attack_class(name).Options.model_fields  # type: ignore[attr-defined]
        for field, info in fields.items():
            if type(info.default) is int and "seed" not in field:
                with pytest.raises(ValueError, match=f"{field}: must be a count"):
                    attacks.create_attack(name, **{field: COUNT_LIMIT + 1})
                checked += 1
    assert checked >= 10
    attacks.create_attack("batch_match", seed=2**31)


def test_a_sweep_s_size_is_counted_before_its_grid_is_built(tmp_path: Path, capsys) -> None:
    """Three swept keys of 100 values are a million runs: refused from the sizes alone (the grid's
    product is never built), with what to do."""
    start = time.monotonic()
    code = cli(small_config(tmp_path), tmp_path / "out", "--sweep", "seed=" + ",".join(map(str, range(100))),
               "--sweep", "gamma=" + ",".join(str(i / 1000) for i in range(100)),
               "--sweep", "federation.lr=" + ",".join(str(i + 1) for i in range(100)))
    assert code == 3 and time.monotonic() - start < 30
    one_line_error(capsys.readouterr().err, "1,000,000 points", "at most 1,000")
    assert not (tmp_path / "out").exists()


def test_a_huge_override_is_shown_cut_in_its_error(tmp_path: Path, capsys) -> None:
    """A 60 kB override value is refused in one line that quotes its start and its length, not the
    whole value."""
    code = cli(small_config(tmp_path), tmp_path / "out", "--set", "attacks=" + "[" * 30_000 + "]" * 30_000)
    assert code == 3
    err = capsys.readouterr().err
    one_line_error(err, "60,008 characters", "32 levels")
    assert len(err) < 1_000


def test_a_checkpoint_path_that_is_not_a_file_says_so(tmp_path: Path, capsys) -> None:
    """A device or folder named as a checkpoint is 'not a regular file' (not 'does not exist'), exit 5,
    before anything reads from it."""
    code = cli(small_config(tmp_path), tmp_path / "out", "--set", f"models.0.checkpoint={tmp_path}")
    assert code == 5
    one_line_error(capsys.readouterr().err, str(tmp_path), "is not a regular file")

"""The one configuration mechanism (fedmjp/config.py) and the three schemas built on it."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import pytest
from pydantic import ConfigDict

from fedmjp.config import (ByShape, ConfigError, Float, Int, Schema, conform, defaults, option, parse_override,
                           read_yaml, set_dotted)

ROOT = Path(__file__).resolve().parents[1]


class Section(Schema):
    rounds: Int = option(2, ge=1)
    lr: Float = option(0.1, ge=0.0)
    mode: Literal["a", "b"] = "a"
    limit: Optional[Int] = None


class Row(Schema):
    name: str
    seed: Optional[Int] = None


ListOrAll = Annotated[Union[list[str], Literal["all"]], ByShape()]


class Top(Schema):
    flag: bool = False
    title: str = "x"
    section: Section = Section()
    rows: list[Row] = []
    free: dict = {"name": "none", "clip": 1.0}
    either: ListOrAll = ["c"]


class Hyphenated(Schema):
    model_config = ConfigDict(alias_generator=lambda name: name.replace("_", "-"))
    batch_size: Int = 1


def test_defaults_are_plain_data_with_sections_as_mappings() -> None:
    assert defaults(Top) == {"flag": False, "title": "x", "section": {"rounds": 2, "lr": 0.1, "mode": "a",
                                                                         "limit": None},
                                "rows": [], "free": {"name": "none", "clip": 1.0}, "either": ["c"]}
    assert defaults(Top)["free"] is not defaults(Top)["free"]  # a copy per call
    assert defaults(Hyphenated) == {"batch-size": 1}


def test_conform_fills_defaults_and_replaces_free_mappings() -> None:
    cfg = conform(Top, {"section": {"rounds": 5, "lr": 1}, "free": {"name": "prune"}, "either": "all",
                           "rows": [{"name": "r"}]})
    assert cfg["section"] == {"rounds": 5, "lr": 1.0, "mode": "a", "limit": None}
    assert isinstance(cfg["section"]["lr"], float)  # an int is a valid float and becomes one
    assert cfg["free"] == {"name": "prune"}  # replaced, not merged with the default's clip
    assert cfg["rows"] == [{"name": "r", "seed": None}] and cfg["either"] == "all"
    assert conform(Top, cfg) == cfg  # conforming a conformed config changes nothing


@pytest.mark.parametrize("data, message", [
    ({"flagg": True}, "unknown config key 'flagg'; valid: either, flag, free, rows, section, title"),
    ({"section": {"roundz": 1}}, "unknown config key 'section.roundz'; valid keys here: limit, lr, mode, rounds"),
    ({"rows": [{"name": "r", "sed": 1}]}, "unknown config key 'rows.0.sed'; valid keys here: name, seed"),
])
def test_an_unknown_key_is_named_with_the_valid_ones(data, message) -> None:
    with pytest.raises(ConfigError) as err:
        conform(Top, data)
    assert str(err.value) == message


@pytest.mark.parametrize("data, message", [
    ({"flag": 3}, "config key 'flag' must be true or false, got 3"),
    ({"title": 5}, "config key 'title' must be a string, got 5"),
    ({"section": {"rounds": True}}, "config key 'section.rounds' must be an integer, got True"),
    ({"section": {"rounds": 1.5}}, "config key 'section.rounds' must be an integer, got 1.5"),
    ({"section": {"rounds": 0}}, "config key 'section.rounds' must be an integer >= 1, got 0"),
    ({"section": {"lr": "abc"}}, "config key 'section.lr' must be a number, got 'abc'"),
    ({"section": {"lr": float("nan")}}, "config key 'section.lr' must be a number >= 0.0, got nan"),
    ({"section": {"lr": None}}, "config key 'section.lr' must be a number, got None"),
    ({"section": {"mode": "c"}}, "config key 'section.mode': unknown value 'c'; valid: a, b"),
    # a string holding a number is that number ("3" -> 3, tests/test_number_keys.py); other text is refused
    ({"section": {"limit": "3 rounds"}}, "config key 'section.limit' must be an integer or null, got '3 rounds'"),
    ({"section": 5}, "config key 'section' must be a mapping, got 5"),
    ({"rows": [{"seed": 1}]}, "config key 'rows.0.name' is required (a string)"),
    ({"rows": [{"name": 1}]}, "config key 'rows.0.name' must be a string, got 1"),
    ({"free": [1]}, "config key 'free' must be a mapping, got [1]"),
    ({"either": 5}, "config key 'either' must be a list or one of all, got 5"),
    ({"either": ["c", 1]}, "config key 'either.1' must be a string, got 1"),
])
def test_a_wrong_value_names_the_key_and_what_it_takes(data, message) -> None:
    with pytest.raises(ConfigError) as err:
        conform(Top, data)
    assert str(err.value) == message


def test_hyphenated_keys() -> None:
    assert conform(Hyphenated, {"batch-size": 4}) == {"batch-size": 4}
    with pytest.raises(ConfigError, match="unknown config key 'batch_size'; valid: batch-size"):
        conform(Hyphenated, {"batch_size": 4})


def test_overrides_are_yaml_data_never_code() -> None:
    assert parse_override("a.b=0.5") == (["a", "b"], 0.5)
    assert parse_override("a={x: [1, 2]}") == (["a"], {"x": [1, 2]})
    assert parse_override("a=") == (["a"], None)
    assert parse_override("a=__import__('os').system('true')")[1] == "__import__('os').system('true')"
    for bad in ("a", "a..b=1", "=1", "a=[1"):
        with pytest.raises(ConfigError):
            parse_override(bad)
    cfg = defaults(Top)
    cfg["rows"] = [{"name": "r"}]
    set_dotted(cfg, ["rows", "0", "seed"], 3)
    set_dotted(cfg, ["free", "deep", "key"], 1)  # missing mappings are created; the schema check decides
    assert cfg["rows"][0]["seed"] == 3 and cfg["free"]["deep"] == {"key": 1}
    for index in ("1", "\u00b2"):  # a superscript two is a digit to str.isdigit, not to int()
        with pytest.raises(ConfigError, match="not a row index below 1"):
            set_dotted(cfg, ["rows", index, "seed"], 3)
    with pytest.raises(ConfigError, match="'title' is not a mapping"):
        set_dotted(cfg, ["title", "x"], 3)


def test_read_yaml(tmp_path) -> None:
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "list.yaml").write_text("[1, 2]\n")
    (tmp_path / "bad.yaml").write_text("a: [1\n")
    assert read_yaml(tmp_path / "empty.yaml") == {}
    for name, message in (("list.yaml", "must hold a mapping"), ("bad.yaml", "not valid YAML"),
                          ("missing.yaml", "does not exist")):
        with pytest.raises(ConfigError, match=message):
            read_yaml(tmp_path / name)


# ------------------------------------------------------------------------------------- the schemas
def test_training_config_checks_types_of_recipes_and_overrides(tmp_path) -> None:
    from fedmjp.trainconfig import TrainConfig, load_config, parse_overrides

    assert load_config() == TrainConfig()
    with pytest.raises(ValueError, match="config key 'epochs' must be an integer, got 'abc'"):
        parse_overrides(["--epochs", "abc"])
    (tmp_path / "c.yaml").write_text("per_sample: 3\n")
    with pytest.raises(ValueError, match="config key 'per_sample' must be true or false, got 3"):
        load_config(tmp_path / "c.yaml")
    for recipe in sorted((ROOT / "configs" / "train").glob("*.yaml")):
        assert isinstance(load_config(recipe), TrainConfig), recipe


def test_pyproject_run_config_is_the_run_config_schema() -> None:
    """Flower reads [tool.flwr.app.config]: the same keys and defaults as clients/runconfig.py's
    schema, each written in the TOML type the schema takes (600.0, not 600, for a float)."""
    from clients.runconfig import DEFAULTS, RunConfig, resolve_config
    from defences.spec import NoDefence

    toml = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert list(toml) == list(DEFAULTS) and toml == DEFAULTS
    assert {k: type(v) for k, v in toml.items()} == {k: type(v) for k, v in DEFAULTS.items()}
    assert conform(RunConfig, toml) == toml
    assert resolve_config(toml).defence == NoDefence() and resolve_config(toml).wire() == toml


def test_run_config_errors_name_the_key() -> None:
    from clients.runconfig import ROUND_KEYS, resolve_config

    assert ROUND_KEYS[:3] == ("mode", "setting", "gamma") and "defence" in ROUND_KEYS and "seed" not in ROUND_KEYS
    resolved = resolve_config({"lr": 1, "model-kwargs": {"depth": 2}})
    assert resolved.lr == 1.0 and isinstance(resolved.lr, float) and resolved.model_kwargs == {"depth": 2}
    # typed in Python, flat scalars on Flower's wire, and read back equal from there
    assert resolved.wire()["model-kwargs"] == '{"depth": 2}' and resolve_config(resolved.wire()) == resolved
    assert resolve_config({"model-kwargs": '{"depth": 2}'}).model_kwargs == {"depth": 2}
    for bad, message in (({"batch_size": 2}, "unknown config key 'batch_size'; valid: batch-size, "),
                         ({"mode": "fedprox"}, "config key 'mode': unknown value 'fedprox'; valid: fedsgd, fedavg"),
                         ({"gamma": 2.0}, r"config key 'gamma' must be a number in \[0.0, 1.0\], got 2.0"),
                         ({"per-sample": "yes"}, "config key 'per-sample' must be true or false, got 'yes'"),
                         ({"num-partitions": 0}, r"config key 'num-partitions' must be an integer in \[1, 100000\], got 0")):
        with pytest.raises(ValueError, match=message):
            resolve_config(bad)


def test_run_config_is_typed_in_python_and_flat_on_the_wire() -> None:
    """The defence is a typed spec and the model kwargs a dict; Flower's flat scalars (JSON for those
    two) read back equal; a changed copy leaves the keys its original left unset unset (a default a
    caller fills in later, as run_federation's min-nodes, still applies)."""
    from clients.runconfig import resolve_config
    from defences.spec import FedAvg, LocalDp
    from server.federation import run_federation

    spec = LocalDp(sigma=0.2)
    cfg = resolve_config({"defence": spec, "lr": 0.5})
    assert cfg.defence is spec and cfg.model_kwargs == {}
    wire = cfg.wire()
    assert json.loads(wire["defence"]) == spec.as_dict() and wire["model-kwargs"] == "{}"
    assert all(isinstance(v, (bool, int, float, str)) for v in wire.values())
    assert resolve_config(wire) == cfg
    fedavg = resolve_config({"defence": FedAvg(steps=3)})
    assert (fedavg.mode, fedavg.local_steps) == ("fedavg", 3)
    changed = cfg.with_values({"num-partitions": 5})
    assert changed.num_partitions == 5 and changed.lr == 0.5 and changed.defence == spec
    assert "min_nodes" not in changed.model_fields_set
    assert "min_nodes" in cfg.with_values({"min-nodes": 5}).model_fields_set
    with pytest.raises(ValueError, match="defence must be JSON"):
        resolve_config({"defence": "local_dp"})
    with pytest.raises(ValueError, match="model-kwargs must be JSON"):
        resolve_config({"model-kwargs": "{depth: 4}"})
    with pytest.raises(TypeError, match="takes a clients.runconfig.RunConfig .*got dict"):
        run_federation({"num-server-rounds": 1}, engine="inprocess")  # type: ignore[arg-type]


def test_benchmark_keys_feed_the_run_config_from_the_schema() -> None:
    """Every run-config key that a benchmark field names (``client=``) exists in the run-config
    schema, and the benchmark's run config of a federation passes the clients' check."""
    import torch

    from benchmark import config as C
    from benchmark.entries import model_spec
    from benchmark.inputs import client_values
    from benchmark.inputs import ModelRow, client_run_config
    from benchmark.validation import validate
    from clients.runconfig import DEFAULTS, resolve_config

    cfg = validate(C.apply_overrides(C.load_config(), ["data.num_images=null", "federation.lr=1", "dry_run=true",
                                                         "federation.options={round-timeout: 30.0}"]))
    values = client_values(cfg)
    assert set(values) <= set(DEFAULTS)
    assert values["num-images"] == 0 and values["lr"] == 1.0 and isinstance(values["lr"], float)
    assert values["num-partitions"] == values["min-nodes"] == cfg.federation.clients
    row = ModelRow(3, cfg.models[3].name, "x", model_spec(cfg, 3), torch.nn.Identity(), False)
    run_config = client_run_config(cfg, row, "shuffled")
    assert run_config.num_server_rounds == 1 and run_config.setting == "c" and run_config.round_timeout == 30.0
    assert (run_config.model_name, run_config.model_variant, run_config.model_seed) == ("DeiT+MJP", "mjp", 3)
    assert run_config.model_kwargs == {"depth": 4} and resolve_config(run_config.wire()) == run_config

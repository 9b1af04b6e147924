"""Bring your own attack, defence or model: a package outside this repository, named two ways.

The package is written into a temporary directory as an installed distribution looks on disk (its
modules beside a ``*.dist-info`` folder with ``METADATA`` and ``entry_points.txt``), and that
directory is put on ``sys.path``: exactly what ``pip install`` leaves in site-packages, without
touching the environment the tests run in. The default preset then runs with its attack and its
defence, once by their entry-point names and once by ``package.module:Name`` references.
"""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import run_benchmark
from attacks import create_attack
from attacks.api.registry import attack_catalog
from benchmark.cli import catalog
from defences import validate_defence
from fedmjp import plugins
from fedmjp.factory import build_model, validate_spec
from fedmjp.models import model_catalog

PACKAGE = "fedmjp_demo_plugin"

ATTACKS_PY = '''
"""A baseline attacker: the image every pixel of which is the input normalisation's mean, blurred."""
import torch
import torch.nn.functional as F

from attacks import Attack, AttackResult


class MeanImage(Attack):
    name = "demo_mean"

    def __init__(self, kernel: int = 3, raise_errors: bool = False) -> None:
        super().__init__(raise_errors)
        self.kernel = kernel

    def _reconstruct(self, model, update, meta):
        c, h, w = meta.image_size
        image = meta.mean.float().clamp(0, 1).view(1, c, 1, 1).expand(meta.num_images, c, h, w)
        image = F.avg_pool2d(image, self.kernel, stride=1, padding=self.kernel // 2, count_include_pad=False)
        stats = [{"objective": 0.0, "iterations": 0, "notes": ["mean image"]} for _ in range(meta.num_images)]
        return AttackResult(image.contiguous(), stats, labels=meta.labels)
'''

DEFENCES_PY = '''
"""Adds a constant to every entry of the update (a toy defence that moves the update's direction)."""
import math

from defences.spec import UpdateDefence


class AddConstant(UpdateDefence):
    defaults = {"value": 0.001}

    def check(self, spec):
        if not math.isfinite(spec["value"]):
            raise ValueError(f"value must be finite, got {spec['value']!r}")

    def apply(self, update, spec, generator):
        return {k: v + spec["value"] for k, v in update.items()}
'''

MODELS_PY = '''
"""A model function: fedmjp's CIFAR ViT with two blocks."""
from timm.models import register_model

from fedmjp.models import mjp_vit_cifar_patch4_32


@register_model
def tiny_vit(pretrained=False, **kwargs):
    return mjp_vit_cifar_patch4_32(pretrained=pretrained, **{"depth": 2, **kwargs})
'''

ENTRY_POINTS = f"""
[fedmjp.attacks]
demo_mean = {PACKAGE}.attacks:MeanImage

[fedmjp.defences]
add_constant = {PACKAGE}.defences:AddConstant

[fedmjp.models]
demo_tiny_vit = {PACKAGE}.models:tiny_vit
"""


@pytest.fixture
def plugin_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The demo package installed into a directory on ``sys.path`` (modules + dist-info)."""
    site = tmp_path / "site"
    pkg = site / PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name, text in (("attacks", ATTACKS_PY), ("defences", DEFENCES_PY), ("models", MODELS_PY)):
        (pkg / f"{name}.py").write_text(textwrap.dedent(text))
    info = site / f"{PACKAGE}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedmjp-demo-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def _run(tmp_path: Path, attack: str, defence: str, extra: tuple[str, ...] = ()) -> list[dict]:
    out = tmp_path / f"run-{attack.replace(':', '-')}"
    code = run_benchmark.main([
        "--num-images", "2", "--rounds", "1", "--clients", "2", "--setting", "c", "--models", "ViT",
        "--no-progress", "--output", str(out), "--set", f"attacks=[{{name: '{attack}'}}]",
        "--set", f"defence={{name: '{defence}', value: 2e-3}}", "--set", "metrics.lpips=false", *extra])
    assert code == 0
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def _check_rows(rows: list[dict], attack: str, defence: str) -> None:
    assert len(rows) == 2  # 2 images, one attacker, one model row, setting c
    for row in rows:
        assert row["attack"] == attack and row["defence"] == defence
        assert row["defence_label"] == f"{defence}(value=0.002)"
        assert row["defence_cos"] < 0.999  # the constant changed what the client sent
        assert not row["failed"] and row["psnr"] < 30  # a mean image is no reconstruction


def test_entry_points_run_in_the_default_preset(plugin_package: Path, tmp_path: Path) -> None:
    _check_rows(_run(tmp_path, "demo_mean", "add_constant"), "demo_mean", "add_constant")


def test_module_references_run_in_the_default_preset(plugin_package: Path, tmp_path: Path) -> None:
    attack, defence = f"{PACKAGE}.attacks:MeanImage", f"{PACKAGE}.defences:AddConstant"
    _check_rows(_run(tmp_path, attack, defence), attack, defence)


def test_the_plugins_are_listed_with_their_origin(plugin_package: Path, capsys: pytest.CaptureFixture) -> None:
    assert run_benchmark.main(["--list"]) == 0
    listing = capsys.readouterr().out
    origin = "entry point (fedmjp-demo-plugin 0.1)"
    for kind, name in (("attacks", "demo_mean"), ("defences", "add_constant"), ("models", "demo_tiny_vit")):
        assert (name, origin) in catalog()[kind]
        # an attack's line goes on with what it needs ("needs: ..."); the others end with the origin
        want = [name, *origin.split()]
        assert any(line.split()[:len(want)] == want and line.split()[len(want):len(want) + 1] in ([], ["needs:"])
                   for line in listing.splitlines())
    assert ("april_analytic", "built-in") in attack_catalog() and "april_analytic" in listing
    assert ("mjp_vit_cifar_patch4_32", "built-in") in model_catalog()
    assert PACKAGE not in sys.modules  # listing reads metadata only: nothing was imported


def test_a_plugin_is_typed_like_a_builtin(plugin_package: Path) -> None:
    assert create_attack("demo_mean", kernel="5e0").kernel == 5  # a number option converted by its annotation
    with pytest.raises(ValueError, match=r"bad options for attack 'demo_mean': unknown option\(s\) \['kernal'\]; "
                                         r"valid: kernel, raise_errors"):
        create_attack("demo_mean", kernal=3)
    assert validate_defence({"name": "add_constant", "value": "1e-2"}).as_dict() == {"name": "add_constant", "value": 0.01}
    with pytest.raises(ValueError, match=r"defence 'add_constant': unknown key\(s\) \['sigma'\]; valid: name, value"):
        validate_defence({"name": "add_constant", "sigma": 1.0})
    with pytest.raises(ValueError, match="defence 'add_constant': config key 'value' must be a number, got True"):
        validate_defence({"name": "add_constant", "value": True})
    with pytest.raises(ValueError, match="defence 'add_constant': value must be finite, got nan"):
        validate_defence({"name": "add_constant", "value": float("nan")})


def test_a_plugin_model_builds_by_name_and_by_reference(plugin_package: Path) -> None:
    for arch in ("demo_tiny_vit", f"{PACKAGE}.models:tiny_vit"):
        spec = {"name": "tiny", "arch": arch, "variant": "mjp", "kwargs": {}, "checkpoint": None, "april": None,
                "seed": 0}
        validate_spec(spec)
        model = build_model(spec)
        assert len(model.blocks) == 2 and model(torch.rand(1, 3, 32, 32)).shape == (1, 10)


@pytest.mark.parametrize("kind, reference, message", [
    ("attack", "no_such_pkg.attacks:Thing", "module 'no_such_pkg.attacks' not found; install the package"),
    ("attack", f"{PACKAGE}.attacks:Missing", f"'{PACKAGE}.attacks' has no attribute 'Missing'"),
    ("attack", f"{PACKAGE}.defences:AddConstant", "is not a subclass of attacks.api.base.Attack (got AddConstant)"),
    ("defence", f"{PACKAGE}.attacks:MeanImage", "is not a subclass of defences.spec.UpdateDefence (got MeanImage)"),
    ("model", f"{PACKAGE}.models:__name__", "is not a model function registered with timm"),
    ("model", f"{PACKAGE}.models:register_model", "is not a model function registered with timm"),
])
def test_a_bad_reference_is_named_with_what_went_wrong(plugin_package: Path, tmp_path: Path, kind: str,
                                                       reference: str, message: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    key = {"attack": f"attacks=[{{name: '{reference}'}}]", "defence": f"defence={{name: '{reference}'}}",
           "model": f"models.0.arch={reference}"}[kind]
    assert run_benchmark.main(["--output", str(tmp_path / "never"), "--set", key]) == 3  # a config error
    err = capsys.readouterr().err.strip()
    assert f"{kind} {reference!r}" in err and message in err and "Traceback" not in err
    assert not (tmp_path / "never").exists()


def test_a_reference_is_a_module_name_never_a_path() -> None:
    assert plugins.is_reference("pkg.mod:Name") and plugins.is_reference("pkg:Outer.Inner")
    for text in ("/tmp/x.py:Name", "../pkg.mod:Name", "pkg.mod", "pkg.mod:Name()", "pkg mod:Name", "a:b:c"):
        assert not plugins.is_reference(text)
    with pytest.raises(ValueError, match="unknown attack '/tmp/x.py:Name'"):
        create_attack("/tmp/x.py:Name")


def test_the_templates_of_docs_plugins_md_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack, defence and model templates users copy from docs/plugins.md, as a package named
    by reference: the attack reconstructs an image, the defence changes the update within its scale."""
    import re

    from defences import apply_update_defence

    blocks = re.findall(r"```python\n(.*?)```", (Path(__file__).parents[1] / "docs" / "plugins.md").read_text(), re.S)
    attack_py, defence_py, model_py = (b for b in blocks if "class " in b or "def tiny_vit" in b)
    pkg = tmp_path / "mypkg_docs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in (("attacks", attack_py), ("defences", defence_py), ("models", model_py)):
        (pkg / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        model = build_model({"name": "t", "arch": "mypkg_docs.models:tiny_vit", "variant": "plain", "kwargs": {},
                             "checkpoint": None, "april": None, "seed": 0})
        x, y = torch.rand(1, 3, 32, 32), torch.tensor([3])
        names = [n for n, _ in model.named_parameters()]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        update = dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))
        result = create_attack("mypkg_docs.attacks:MyAttack", steps=3).reconstruct(model, update, {"labels": [3]})
        assert not result.failed and result.images.shape == (1, 3, 32, 32)
        assert create_attack("mypkg_docs.attacks:MyAttack").reconstruct(model, update, {}).reason == \
            "my_attack needs the labels"
        spec = validate_defence({"name": "mypkg_docs.defences:MyNoise", "scale": "1e-3"})
        sent = apply_update_defence(update, spec, torch.Generator().manual_seed(0))
        change = max(float((sent[n] - update[n]).abs().max()) for n in names)
        assert 0 < change < 0.01
    finally:
        for name in [m for m in sys.modules if m.startswith("mypkg_docs")]:
            del sys.modules[name]


@pytest.mark.parametrize("reference", ["os:system", "subprocess:run", "builtins:exec", "os.path:join"])
def test_standard_library_references_are_refused(reference):
    """A config cannot name standard-library callables as plug-ins (nothing is imported or called)."""
    from fedmjp import plugins

    with pytest.raises(plugins.PluginError, match="standard-library"):
        plugins.load("model", plugins.Plugin(reference, reference, "module reference"))

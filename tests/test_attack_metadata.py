"""AttackMetadata.parse: the metadata a server passes with an update, read with a fedmjp.config schema.

The defaults and the forms the benchmark passes (tensors, tuples, the ``batch_size`` alias, numbers
as strings) parse to the values the hand-written parser gave; every bad value is an
:class:`AttackFailure` naming the key and what it takes, never a raw TypeError/ValueError.
"""
from __future__ import annotations

import math
import timeit

import numpy as np
import pytest
import torch
import torch.nn as nn

from attacks.api.base import Attack, AttackFailure, AttackMetadata, AttackResult
from defences.spec import DefenceSpec, validate_defence

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class _PatchEmbed(nn.Module):
    def __init__(self, channels: int = 3, size: int = 32, proj: bool = True) -> None:
        super().__init__()
        self.img_size = (size, size)
        if proj:
            self.proj = nn.Conv2d(channels, 4, 8, 8)


class _Model(nn.Module):
    """The parts of a ViT that parse reads: ``patch_embed.img_size`` and ``patch_embed.proj``."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.patch_embed = _PatchEmbed(**kwargs)


MODEL = _Model()


def bench_metadata(**changes) -> dict:
    """Metadata as benchmark/group_attacker.py's attack_metadata builds it."""
    md = {"num_images": 4, "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "image_size": (3, 224, 224),
          "update_type": "gradient", "lr": 0.01, "local_steps": 1,
          "defence": validate_defence({"name": "local_dp", "sigma": 0.1}), "labels": torch.tensor([3, 1, 4, 1])}
    md.update(changes)
    return md


def parse(md, model: nn.Module = MODEL) -> AttackMetadata:
    return AttackMetadata.parse(md, model)


# --- defaults and accepted forms (same values as the hand-written parser) ------------------------

@pytest.mark.parametrize("md", [None, {}])
def test_defaults(md):
    meta = parse(md)
    assert (meta.num_images, meta.image_size, meta.update_type, meta.lr, meta.local_steps) == (
        1, (3, 32, 32), "gradient", None, 1)
    assert meta.mean.dtype == meta.std.dtype == torch.float64
    assert meta.mean.tolist() == [0.0] * 3 and meta.std.tolist() == [1.0] * 3
    assert meta.labels is None and meta.defence is None and meta.defence_error is None


def test_default_image_size_follows_the_model_channels():
    meta = parse({}, _Model(channels=1, size=16))
    assert meta.image_size == (1, 16, 16) and meta.mean.tolist() == [0.0] and meta.std.tolist() == [1.0]


def test_default_channels_are_3_without_proj():
    assert parse({}, _Model(size=16, proj=False)).image_size == (3, 16, 16)


def test_no_image_size_and_no_patch_embed_fails():
    with pytest.raises(AttackFailure, match="image_size"):
        parse({}, nn.Linear(2, 2))


def test_benchmark_metadata():
    meta = parse(bench_metadata())
    assert (meta.num_images, meta.image_size, meta.update_type, meta.lr, meta.local_steps) == (
        4, (3, 224, 224), "gradient", 0.01, 1)
    assert isinstance(meta.image_size, tuple) and all(type(s) is int for s in meta.image_size)
    assert torch.equal(meta.mean, torch.tensor(IMAGENET_MEAN, dtype=torch.float64))
    assert torch.equal(meta.std, torch.tensor(IMAGENET_STD, dtype=torch.float64))
    assert meta.labels.dtype == torch.long and meta.labels.tolist() == [3, 1, 4, 1]
    assert isinstance(meta.defence, DefenceSpec) and meta.defence.name == "local_dp" and meta.defence.sigma == 0.1


@pytest.mark.parametrize("mean", [
    torch.tensor(IMAGENET_MEAN, dtype=torch.float32), torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1),
    np.array(IMAGENET_MEAN, dtype=np.float32), [torch.tensor(v, dtype=torch.float32) for v in IMAGENET_MEAN]])
def test_mean_as_tensor_or_array(mean):
    """A tensor (any shape, flattened) or array: its values in float64, as torch.as_tensor gave."""
    expected = torch.tensor(IMAGENET_MEAN, dtype=torch.float32).double()
    assert torch.equal(parse(bench_metadata(mean=mean)).mean, expected)


@pytest.mark.parametrize("labels", [[3, 1, 4, 1], (3, 1, 4, 1), np.array([3, 1, 4, 1]),
                                    torch.tensor([3.0, 1.0, 4.0, 1.0]), torch.tensor([[3, 1], [4, 1]])])
def test_labels_forms(labels):
    got = parse(bench_metadata(labels=labels)).labels
    assert got.dtype == torch.long and got.device.type == "cpu" and got.tolist() == [3, 1, 4, 1]


@pytest.mark.parametrize("size", [[3, 8, 8], torch.Size([3, 8, 8]), torch.tensor([3, 8, 8]), (3.0, 8, "8")])
def test_image_size_forms(size):
    assert parse({"image_size": size}).image_size == (3, 8, 8)


def test_batch_size_is_the_old_name_of_num_images():
    assert parse({"batch_size": 2, "labels": [0, 1]}).num_images == 2
    assert parse({"num_images": 2, "batch_size": 3, "labels": [0, 1]}).num_images == 2  # num_images wins


def test_numbers_as_strings_and_integral_floats():
    meta = parse({"num_images": "2", "lr": "1e-4", "local_steps": "3", "update_type": "delta", "labels": [0, 1]})
    assert (meta.num_images, meta.lr, meta.local_steps) == (2, 1e-4, 3)
    meta = parse({"num_images": 2.0, "local_steps": 1e1, "lr": 1, "update_type": "delta"})
    assert (meta.num_images, meta.local_steps, meta.lr) == (2, 10, 1.0)
    assert type(meta.num_images) is int and type(meta.local_steps) is int and type(meta.lr) is float


def test_zero_dim_tensors_as_numbers():
    meta = parse({"num_images": torch.tensor(2), "lr": torch.tensor(0.5), "local_steps": np.int64(2)})
    assert (meta.num_images, meta.lr, meta.local_steps) == (2, 0.5, 2)


def test_unknown_keys_are_ignored():
    meta = parse({"my_plugin_key": object(), "another": [1, "x"]})
    assert meta.num_images == 1


def test_delta_update():
    meta = parse(bench_metadata(update_type="delta", local_steps=5))
    assert (meta.update_type, meta.lr, meta.local_steps) == ("delta", 0.01, 5)


def test_defence_spec_forms():
    assert parse({"defence": {"name": "prune", "keep": 0.2}}).defence == validate_defence({"name": "prune", "keep": 0.2})
    assert parse({"defence": "quantize"}).defence.name == "quantize"


@pytest.mark.parametrize("spec", [{"name": "nope"}, {"name": "local_dp", "sigma": -1}, 5])
def test_unreadable_defence_is_kept_as_defence_error(spec):
    meta = parse({"defence": spec})
    assert meta.defence is None and meta.defence_error


def test_one_mean_or_std_entry_is_repeated_for_every_channel():
    meta = parse({"mean": [0.5], "std": 0.25})
    assert meta.mean.tolist() == [0.5] * 3 and meta.std.tolist() == [0.25] * 3


# --- refused values: AttackFailure naming the key and what it takes ------------------------------

@pytest.mark.parametrize("md, match", [
    # checks the hand-written parser had (its messages changed)
    ({"image_size": (3, 32)}, r"'metadata\.image_size' must be \(C, H, W\)"),
    ({"labels": [1, 2]}, r"'metadata\.labels' must be one label per image \(num_images=1\)"),
    ({"update_type": "foo"}, r"'metadata\.update_type': unknown value 'foo'; valid: gradient, delta"),
    ({"update_type": "delta"}, r"'metadata\.lr' must be the non-zero local learning rate"),
    ({"update_type": "delta", "lr": 0}, r"'metadata\.lr' must be the non-zero local learning rate"),
])
def test_kept_checks(md, match):
    with pytest.raises(AttackFailure, match=match):
        parse(md)


# Each of these the hand-written parser accepted silently or crashed on with a TypeError/ValueError.
@pytest.mark.parametrize("md, match", [
    ({"num_images": 0}, r"'metadata\.num_images' must be an integer >= 1, got 0"),
    ({"num_images": -2}, r"'metadata\.num_images' must be an integer >= 1"),
    ({"batch_size": 0}, r"'metadata\.batch_size' must be an integer >= 1"),
    ({"num_images": "x"}, r"'metadata\.num_images' must be an integer"),
    ({"num_images": 2.5}, r"'metadata\.num_images' must be an integer"),
    ({"num_images": True}, r"'metadata\.num_images' must be an integer"),
    ({"image_size": (3, 0, 32)}, r"'metadata\.image_size' must be \(C, H, W\): three integers >= 1"),
    ({"image_size": (3, -1, 32)}, r"'metadata\.image_size' must be \(C, H, W\): three integers >= 1"),
    ({"image_size": 32}, r"'metadata\.image_size' must be \(C, H, W\)"),
    ({"image_size": ("a", 1, 1)}, r"'metadata\.image_size\.0' must be an integer"),
    ({"std": (0.0, 1.0, 1.0)}, r"'metadata\.std' must be 3 \(the channels of image_size\) or 1 finite numbers > 0"),
    ({"std": (-1.0, 1.0, 1.0)}, r"'metadata\.std' must be .* > 0"),
    ({"std": (math.nan,) * 3}, r"'metadata\.std' must be .* finite numbers > 0"),
    ({"std": (math.inf,) * 3}, r"'metadata\.std' must be .* finite numbers > 0"),
    ({"std": (1.0,) * 4}, r"'metadata\.std' must be 3 \(the channels of image_size\) or 1"),
    ({"mean": (0.5, 0.5)}, r"'metadata\.mean' must be 3 \(the channels of image_size\) or 1 finite numbers"),
    ({"mean": (math.inf,) * 3}, r"'metadata\.mean' must be .* finite numbers"),
    ({"mean": "x"}, r"'metadata\.mean' must be a list"),
    ({"labels": "x"}, r"'metadata\.labels' must be a list"),
    ({"labels": [1.5]}, r"'metadata\.labels\.0' must be an integer, got 1\.5"),
    ({"lr": "abc"}, r"'metadata\.lr' must be a number"),
    ({"lr": math.nan}, r"'metadata\.lr' must be a number >= 0\.0, got nan"),
    ({"lr": math.inf, "update_type": "delta"}, r"'metadata\.lr' must be a number >= 0\.0, got inf"),
    ({"lr": -0.1}, r"'metadata\.lr' must be a number >= 0\.0"),
    ({"local_steps": 0}, r"'metadata\.local_steps' must be an integer >= 1, got 0"),
    ({"local_steps": -1}, r"'metadata\.local_steps' must be an integer >= 1"),
    ({"local_steps": "x"}, r"'metadata\.local_steps' must be an integer"),
    ({"local_steps": 1.5}, r"'metadata\.local_steps' must be an integer"),
    (["not", "a", "mapping"], r"'metadata' must be a mapping"),
])
def test_new_checks(md, match):
    with pytest.raises(AttackFailure, match=match):
        parse(md)


def test_channel_count_follows_image_size():
    assert parse({"image_size": (1, 8, 8), "mean": [0.5], "std": [0.5]}).mean.tolist() == [0.5]
    with pytest.raises(AttackFailure, match=r"'metadata\.mean' must be 1 \(the channels of image_size\)"):
        parse({"image_size": (1, 8, 8), "mean": IMAGENET_MEAN})


class _Echo(Attack):
    name = "echo"

    def _reconstruct(self, model, update, meta) -> AttackResult:
        return AttackResult(torch.zeros(meta.num_images, *meta.image_size), [{} for _ in range(meta.num_images)])


def test_bad_metadata_is_a_condition_failure_of_reconstruct():
    """A failed row with the reason, not an unexpected error with a traceback."""
    result = _Echo().reconstruct(MODEL, {}, {"num_images": "x"})
    assert result.failed and result.error is None and "metadata.num_images" in result.reason


def test_parse_is_fast():
    md = bench_metadata()
    per_call = min(timeit.repeat(lambda: parse(md), number=200, repeat=3)) / 200
    assert per_call < 1e-3, f"AttackMetadata.parse takes {per_call * 1e6:.0f} us per call"


# --- typed metadata from the benchmark ----------------------------------------------------------

def test_the_pipeline_builds_typed_metadata_equal_to_the_parsed_dict():
    """benchmark/group_attacker.py's attack_metadata gives an AttackMetadata (tensors stay tensors, one
    label per image, the local steps) equal to what parse reads from the same values as a dict, and
    an attack takes it as it is."""
    from types import SimpleNamespace

    from benchmark import config as C
    from benchmark.inputs import client_values
    from benchmark.validation import validate
    from benchmark.group_attacker import attack_metadata
    from clients.runconfig import resolve_config

    cfg = validate(C.apply_overrides(C.load_config(), ["attack.labels=known", "federation.algorithm=fedavg",
                                                         "federation.local_steps=3", "federation.lr=0.05"]))
    resolved = resolve_config({**client_values(cfg), "defence": '{"name": "local_dp", "sigma": 0.1}'})
    batch = SimpleNamespace(image_ids=[7, 8], labels=torch.tensor([3, 1]))
    meta = attack_metadata(cfg, resolved, MODEL, batch)
    assert isinstance(meta, AttackMetadata) and isinstance(meta.labels, torch.Tensor)
    size = cfg.data.image_size
    parsed = parse({"num_images": 2, "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "image_size": (3, size, size),
                    "update_type": "delta", "lr": 0.05, "local_steps": 3, "labels": batch.labels,
                    "defence": resolved.defence})
    for key, value in vars(parsed).items():
        got = getattr(meta, key)
        assert torch.equal(got, value) and got.dtype == value.dtype if isinstance(value, torch.Tensor) else \
            got == value, key
    assert AttackMetadata.of(meta, MODEL) is meta
    assert meta.gradient_scale == pytest.approx(-1 / (0.05 * 3))


def test_a_delta_without_lr_fails_where_it_is_turned_into_gradients():
    """A typed metadata is not parsed: a FedAvg delta with lr 0 is still a condition failure, named
    like parse names it, when an attack turns the update into gradient units."""
    meta = parse({"update_type": "gradient"})
    meta.update_type = "delta"
    with pytest.raises(AttackFailure, match=r"'metadata\.lr' must be the non-zero local learning rate"):
        meta.gradient_scale

"""The clients' Flower run config: its keys, their defaults, validation and the model spec.

Run-config keys (Flower style, flat, hyphenated; defaults in :data:`DEFAULTS`, mirrored by
``[tool.flwr.app.config]`` in pyproject.toml):

=================  ==========================================================================
key                meaning
=================  ==========================================================================
mode               ``fedsgd`` (reply one batch's gradients) or ``fedavg`` (reply a weight delta)
setting            ``a`` (gradient on x), ``b``/``c`` (gradient on the MJP-shuffled x~)
gamma              shuffle ratio of settings b and c
per-sample         one shuffle per image (true) or one per batch (false, official code)
batch-size         images per client update (the paper attacks batch size 1)
local-steps, lr    FedAvg local SGD steps and learning rate; lr is also FedSGD's server step
dal-weight         weight of the DAL loss in the client loss (0: cross-entropy only, as the
                   privacy study's gradients are classification gradients)
images, ...        private image set (``embedded`` or a folder), image-size, num-images (0: all),
                   num-classes
partitioner        ``iid`` or ``dirichlet`` (by label, ``dirichlet-alpha``), seeded by ``seed``
model-*            the model spec for :func:`fedmjp.factory.build_model` (model-kwargs is JSON)
precision          ``float32`` or ``float64``: dtype of the client's forward/backward (APRIL's
                   closed form is exact only on float64 gradients; DESIGN section 4)
device             where clients compute: ``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:N``
server-eval        false (default): the server evaluates nothing. true: after every round it
                   evaluates the global model on the *public split*
                   (:func:`clients.partition.public_eval_set`): the images of the same source after
                   the first ``num-images`` ones, which no client owns; never on the clients'
                   private images
defence            JSON of a :mod:`defences` spec, e.g. '{"name": "local_dp", "clip": 1.0}';
                   ``fedavg`` sets mode fedavg and local-steps (see :mod:`clients.defence`)
=================  ==========================================================================
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from defences import validate_defence
from fedmjp.settings import SETTINGS

MODES = ("fedsgd", "fedavg")
PARTITIONERS = ("iid", "dirichlet")
PRECISIONS = ("float32", "float64")

DEFAULTS: dict[str, Any] = {
    "num-server-rounds": 2,
    "mode": "fedsgd",
    "setting": "a",
    "gamma": 0.27,
    "per-sample": False,
    "batch-size": 1,
    "local-steps": 1,
    "lr": 0.1,
    "dal-weight": 0.0,
    "seed": 0,
    "images": "embedded",
    "image-size": 32,
    "num-images": 16,
    "num-classes": 10,
    "num-partitions": 2,
    "partitioner": "iid",
    "dirichlet-alpha": 0.5,
    "model-name": "ViT+MJP",
    "model-arch": "mjp_vit_cifar_patch4_32",
    "model-variant": "mjp",
    "model-kwargs": "{}",
    "model-checkpoint": "",
    "model-april": "",
    "model-seed": 0,
    "precision": "float32",
    "fraction-train": 1.0,
    "min-nodes": 2,
    "round-timeout": 600.0,
    "server-eval": False,
    "device": "auto",
    "out-dir": "",
    "fail-partition": -1,
    "slow-partition": -1,
    "slow-seconds": 0.0,
    "defence": '{"name": "none"}',
}

#: Keys the server sends to clients each round (the rest comes from the client's run config).
ROUND_KEYS = ("mode", "setting", "gamma", "per-sample", "batch-size", "local-steps", "lr", "dal-weight",
              "fail-partition", "slow-partition", "slow-seconds", "defence")


def resolve_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with ``run_config``, checked. ``model-kwargs`` may be a dict or JSON."""
    unknown = set(run_config) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown run-config keys {sorted(unknown)}; valid: {', '.join(DEFAULTS)}")
    cfg = {**DEFAULTS, **dict(run_config)}
    if isinstance(cfg["model-kwargs"], Mapping):
        cfg["model-kwargs"] = json.dumps(dict(cfg["model-kwargs"]), sort_keys=True)
    cfg["defence"] = _resolve_defence(cfg)
    for key, valid in (("mode", MODES), ("setting", SETTINGS), ("partitioner", PARTITIONERS),
                       ("precision", PRECISIONS)):
        if cfg[key] not in valid:
            raise ValueError(f"{key} must be one of {', '.join(valid)}, got {cfg[key]!r}")
    if not 0.0 <= float(cfg["gamma"]) <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {cfg['gamma']}")
    for key in ("batch-size", "local-steps", "num-server-rounds", "num-partitions"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    return cfg


def _resolve_defence(cfg: dict[str, Any]) -> str:
    """The checked defence spec as canonical JSON; ``fedavg`` rewrites mode and local-steps."""
    raw = cfg["defence"]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError as err:
            raise ValueError(f"defence must be JSON like '{{\"name\": \"local_dp\"}}', got {raw!r}: {err}") from err
    spec = validate_defence(raw)
    if spec["name"] == "fedavg":
        cfg["mode"], cfg["local-steps"] = "fedavg", int(spec["steps"])
    return json.dumps(spec, sort_keys=True)


def model_spec(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The :func:`fedmjp.factory.build_model` spec a resolved run config describes."""
    kwargs = cfg["model-kwargs"]
    kwargs = json.loads(kwargs) if isinstance(kwargs, str) else dict(kwargs)
    return {
        "name": cfg["model-name"], "arch": cfg["model-arch"], "variant": cfg["model-variant"],
        "kwargs": kwargs, "checkpoint": cfg["model-checkpoint"] or None,
        "april": cfg["model-april"] or None, "seed": int(cfg["model-seed"]),
    }

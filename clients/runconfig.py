"""The clients' Flower run config: its keys, their defaults, validation and the model spec.

Run-config keys (Flower style, flat, hyphenated; types and defaults in :class:`RunConfig`, checked by
:mod:`fedmjp.config`; ``[tool.flwr.app.config]`` in pyproject.toml holds the same, a test keeps them
equal). Flower carries them as a flat mapping of scalars (``context.run_config``, the round's
ConfigRecord); the client and server code takes the typed :class:`RunConfig` (field ``batch_size`` is
key ``batch-size``; ``defence`` a :class:`defences.spec.DefenceSpec`, ``model_kwargs`` a dict).
At Flower's edge (:mod:`server.federation`, :mod:`server.server_app`, :mod:`clients.client_app`)
:func:`resolve_config` turns a flat mapping into a :class:`RunConfig` and :meth:`RunConfig.wire`
turns it back (``defence`` and ``model-kwargs`` as JSON text):

=================  ==========================================================================
key                meaning
=================  ==========================================================================
mode               ``fedsgd`` (reply one batch's gradients) or ``fedavg`` (reply a weight delta)
setting            ``a`` (gradient on x), ``b``/``c`` (gradient on the MJP-shuffled x~)
gamma              shuffle ratio of settings b and c
per-sample         one shuffle per image (true) or one per batch (false, official code)
batch-size         images per client update (the paper attacks batch size 1)
local-steps, lr    FedAvg local SGD steps and learning rate; lr is also FedSGD's server step
server-opt, ...    FedAvg's server step on the round's mean client delta (FedOpt, Reddi et al.
                   2021): ``fedavg`` (w + server-lr * delta; 1.0 is plain FedAvg), ``fedavgm``
                   (server momentum ``server-momentum``), ``fedadam`` (Adam with beta1
                   ``server-momentum``, beta2 ``server-beta2``, eps ``server-tau``), at
                   ``server-lr``, constant or cosine-annealed to 0 over the rounds
                   (``server-schedule``); see :class:`server.strategy.ServerOptimizer`
dal-weight         weight of the DAL loss in the client loss (0: cross-entropy only, as the
                   privacy study's gradients are classification gradients)
images, ...        private image set (``embedded`` or a folder), image-size, num-images (0: all),
                   num-classes
partitioner        ``iid`` or ``dirichlet`` (by label, ``dirichlet-alpha``), seeded by ``seed``
model-*            the model spec for :func:`fedmjp.factory.build_model` (model-kwargs is JSON)
precision          ``float32`` or ``float64``: dtype of the client's forward/backward (APRIL's
                   closed form is exact only on float64 gradients; docs/design.md, "APRIL's closed form")
device             where clients compute: ``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:N``
server-eval        false (default): the server evaluates nothing. true: after every round it
                   evaluates the global model on the *public split*
                   (:func:`clients.partition.public_eval_set`): the images of the same source after
                   the first ``num-images`` ones, which no client owns; never on the clients'
                   private images
defence            JSON of a :mod:`defences` spec, e.g. '{"name": "local_dp", "clip": 1.0}';
                   ``fedavg`` sets mode fedavg and local-steps (see :mod:`clients.defence`)
train-mode         false (default): the client's forward is deterministic (eval mode). true:
                   its stochastic layers act, seeded by (seed, partition, round): drop-path at
                   ``drop-path`` (DeiT's linear rule over depth) and dropout layers of the model;
                   the server is not told (:mod:`clients.update`)
drop-path          the deepest block's drop-path rate in train mode, in [0, 1) (DeiT: 0.1)
secagg             false (default): the server sees every client's update. true: Flower's
                   SecAgg+ (``SecAggPlusWorkflow`` / ``secaggplus_mod``); the server sees only
                   the example-weighted mean of the round's clients (docs/federation.md)
secagg-*           SecAgg+'s parameters: num-shares and reconstruction-threshold (proportions, of
                   the sampled clients and of the shares), clipping-range (each update entry is
                   clipped to +-range before quantisation), quantization-range (levels over
                   the clipping range)
=================  ==========================================================================
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Mapping

from pydantic import ConfigDict, PlainSerializer, model_validator

from defences.spec import DefenceSpec, FedAvg, NoDefence, validate_defence
from fedmjp.config import ConfigError, Float, Int, Schema, defaults, keys, option, parse
from fedmjp.settings import Setting

Mode = Literal["fedsgd", "fedavg"]
ServerOpt = Literal["fedavg", "fedavgm", "fedadam"]
ServerSchedule = Literal["constant", "cosine"]
Partitioner = Literal["iid", "dirichlet"]
Precision = Literal["float32", "float64"]
#: Flower's SecAgg+ default quantisation levels (2**22) and its modulus (2**32, also its maximum):
#: the masked sum of K clients stays exact while K * quantization-range < modulus (at equality, 2
#: clients of 2**31 levels, the aggregate comes back non-finite: tests/test_hostile_federation.py).
SECAGG_QUANTIZATION_RANGE = 2 ** 22
SECAGG_MODULUS = 2 ** 32


def _json_text(value: Any) -> str:
    """A defence spec or a mapping as canonical JSON: how Flower carries it (a TOML value cannot nest)."""
    return json.dumps(value.as_dict() if isinstance(value, DefenceSpec) else dict(value), sort_keys=True)


#: The defence: typed in Python, canonical JSON on the wire (:meth:`RunConfig.wire`).
Defence = Annotated[DefenceSpec, PlainSerializer(_json_text)]
#: The model constructor's keyword arguments: a dict in Python, canonical JSON on the wire.
ModelKwargs = Annotated[dict[str, Any], PlainSerializer(_json_text)]

#: Bounds checked before any work starts (the memory and time a run needs grow with them): the side
#: of the square images (ViT inputs: 32 and 224 here; 1024 leaves room for larger patch grids), the
#: images per client update, and FedAvg's local SGD steps per round (an attacker simulating them
#: pays as many double backwards per evaluation), the classifier's classes (ImageNet-21k has 21,843),
#: the federation's rounds and clients, and the images a utility federation trains or scores on.
MAX_IMAGE_SIZE = 1024
MAX_BATCH_SIZE = 1024
MAX_LOCAL_STEPS = 1000
MAX_CLASSES = 100_000
MAX_ROUNDS = 100_000
MAX_CLIENTS = 100_000
MAX_DATASET_IMAGES = 10_000_000
#: A round's reply timeout, in seconds (a week: beyond it a run waits on a client that never comes).
MAX_ROUND_TIMEOUT = 7 * 24 * 3600.0


class RunConfig(Schema):
    """Every run-config key with its type and default. pyproject.toml's ``[tool.flwr.app.config]``
    holds the same keys and defaults in the same TOML types (tests/test_config.py checks it);
    ``round=True`` marks the keys the server sends to the clients each round."""

    model_config = ConfigDict(alias_generator=lambda name: name.replace("_", "-"))  # Flower's keys: batch-size

    num_server_rounds: Int = option(2, ge=1, le=MAX_ROUNDS)
    mode: Mode = option("fedsgd", round=True)
    setting: Setting = option("a", round=True)
    gamma: Float = option(0.27, ge=0.0, le=1.0, round=True)
    per_sample: bool = option(False, round=True)
    batch_size: Int = option(1, ge=1, le=MAX_BATCH_SIZE, round=True)
    local_steps: Int = option(1, ge=1, le=MAX_LOCAL_STEPS, round=True)
    lr: Float = option(0.1, round=True)
    server_opt: ServerOpt = "fedavg"
    server_lr: Float = option(1.0, gt=0.0, le=1e6)
    server_momentum: Float = option(0.9, ge=0.0, lt=1.0)
    server_beta2: Float = option(0.99, ge=0.0, lt=1.0)
    server_tau: Float = option(1e-3, gt=0.0, le=1.0)
    server_schedule: ServerSchedule = "constant"
    dal_weight: Float = option(0.0, round=True)
    seed: Int = 0
    images: str = "embedded"
    image_size: Int = option(32, ge=1, le=MAX_IMAGE_SIZE)
    num_images: Int = option(16, ge=0, le=MAX_DATASET_IMAGES)  # 0: all images of the source
    num_classes: Int = option(10, ge=1, le=MAX_CLASSES)
    num_partitions: Int = option(2, ge=1, le=MAX_CLIENTS)
    partitioner: Partitioner = "iid"
    dirichlet_alpha: Float = option(0.5, gt=0.0)
    model_name: str = "ViT+MJP"
    model_arch: str = "mjp_vit_cifar_patch4_32"
    model_variant: str = "mjp"
    model_kwargs: ModelKwargs = {}
    model_checkpoint: str = ""
    model_april: str = ""
    model_seed: Int = 0
    precision: Precision = "float32"
    fraction_train: Float = option(1.0, gt=0.0, le=1.0)  # share of the available clients sampled per round
    min_nodes: Int = option(2, ge=1, le=MAX_CLIENTS)
    round_timeout: Float = option(600.0, gt=0.0, le=MAX_ROUND_TIMEOUT)  # seconds a round waits for replies
    server_eval: bool = False
    device: str = "auto"
    out_dir: str = ""
    fail_partition: Int = option(-1, ge=-1, round=True)  # -1: none
    slow_partition: Int = option(-1, ge=-1, round=True)
    slow_seconds: Float = option(0.0, ge=0.0, le=MAX_ROUND_TIMEOUT, round=True)
    defence: Defence = option(NoDefence(), round=True)
    train_mode: bool = False
    drop_path: Float = option(0.0, ge=0.0, lt=1.0)  # 1 would drop every residual branch
    secagg: bool = False
    secagg_num_shares: Float = option(1.0, gt=0.0, le=1.0)
    secagg_reconstruction_threshold: Float = option(0.5, gt=0.0, le=1.0)
    secagg_clipping_range: Float = option(8.0, gt=0.0)
    secagg_quantization_range: Int = option(SECAGG_QUANTIZATION_RANGE, ge=2, le=SECAGG_MODULUS // 2)

    @model_validator(mode="before")
    @classmethod
    def _decode_json(cls, data: Any) -> Any:
        """The wire's JSON text of ``defence`` and ``model-kwargs`` as data; the defence checked
        (:func:`defences.spec.validate_defence`: its errors name the bad name, key or value)."""
        if not isinstance(data, Mapping):
            return data  # pydantic names the type it wanted
        data = dict(data)
        if "defence" in data:
            data["defence"] = validate_defence(_json_data("defence", data["defence"], '{"name": "local_dp"}'))
        if isinstance(data.get("model-kwargs"), str):
            data["model-kwargs"] = _json_data("model-kwargs", data["model-kwargs"], '{"depth": 4}')
        return data

    @model_validator(mode="after")
    def _settle(self) -> RunConfig:
        """The ``fedavg`` defence sets mode fedavg and its local steps; keys valid alone but not
        together are refused (:func:`_check_combinations`)."""
        if isinstance(self.defence, FedAvg):  # the one schema of name "fedavg" (built-ins come before plug-ins)
            self.mode, self.local_steps = "fedavg", self.defence.steps
        _check_combinations(self)
        return self

    def wire(self) -> dict[str, Any]:
        """The keys and values as Flower carries them (flat, hyphenated, scalars; JSON for the defence
        and the model kwargs): what :func:`resolve_config` reads back equal."""
        return self.model_dump(by_alias=True)

    def with_values(self, values: Mapping[str, Any]) -> RunConfig:
        """A checked copy with the run-config keys ``values`` changed; keys this config left at their
        defaults stay unset (:attr:`model_fields_set`), so a later default still applies to them."""
        given = self.model_dump(by_alias=True, include=self.model_fields_set)
        return resolve_config({**given, **values})

    def model_spec(self) -> dict[str, Any]:
        """The :func:`fedmjp.factory.build_model` spec this config describes."""
        return {"name": self.model_name, "arch": self.model_arch, "variant": self.model_variant,
                "kwargs": dict(self.model_kwargs), "checkpoint": self.model_checkpoint or None,
                "april": self.model_april or None, "seed": self.model_seed}


def resolve_config(run_config: Mapping[str, Any]) -> RunConfig:
    """The typed config of a flat run-config mapping (Flower's ``context.run_config`` and round
    config, a TOML table, ``--run-config`` values): defaults overlaid with ``run_config``, checked
    against :class:`RunConfig`. ``defence`` and ``model-kwargs`` may be JSON text (the wire) or, in
    Python, a mapping (the defence also a :class:`DefenceSpec`).

    Raises:
        ValueError (:class:`fedmjp.config.ConfigError`): an unknown key (the valid ones listed), a
            value of the wrong type or out of range, a bad defence spec.
    """
    return parse(RunConfig, run_config)


def _json_data(key: str, raw: Any, example: str) -> Any:
    """``raw`` read as JSON where it is text (empty text: None); any other value as it is."""
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw) if raw.strip() else None
    except json.JSONDecodeError as err:
        raise ValueError(f"{key} must be JSON like '{example}', got {raw!r}: {err}") from err


def _check_combinations(cfg: RunConfig) -> None:
    """Keys valid alone but not together (each message names the keys and what they take)."""
    if cfg.drop_path > 0 and not cfg.train_mode:
        raise ConfigError(f"drop-path={cfg.drop_path} needs train-mode=true (drop-path acts only in the "
                          "client's train-mode forward); set train-mode=true or drop-path=0.0")
    plain_step = cfg.server_opt == "fedavg" and cfg.server_lr == 1.0 and cfg.server_schedule == "constant"
    if not plain_step and cfg.mode != "fedavg":
        raise ConfigError(f"server-opt={cfg.server_opt} server-lr={cfg.server_lr:g} server-schedule="
                          f"{cfg.server_schedule} needs mode=fedavg (the server optimiser steps on the clients' mean "
                          "weight delta; FedSGD's server step is lr); set mode=fedavg, or server-opt=fedavg with "
                          "server-lr=1.0 and server-schedule=constant")
    if not cfg.secagg:
        return
    if not plain_step:
        raise ConfigError(f"secagg=true runs plain FedAvg on the aggregate; server-opt={cfg.server_opt} "
                          f"server-lr={cfg.server_lr:g} server-schedule={cfg.server_schedule} is not supported with "
                          "it: set server-opt=fedavg, server-lr=1.0, server-schedule=constant")
    if cfg.min_nodes < 2:
        raise ConfigError(f"secagg=true needs min-nodes >= 2 (SecAgg+ masks each update with its "
                          f"neighbours'), got min-nodes={cfg.min_nodes}")
    if cfg.min_nodes * cfg.secagg_quantization_range >= SECAGG_MODULUS:
        raise ConfigError(f"secagg-quantization-range={cfg.secagg_quantization_range} is too large for "
                          f"min-nodes={cfg.min_nodes}: the sum of the clients' quantised updates must stay "
                          f"below SecAgg+'s modulus 2**32 (quantization-range * clients < {SECAGG_MODULUS})")
    if cfg.defence.name == "central_dp":
        raise ConfigError("secagg=true does not combine with defence central_dp (its server-side wrapper "
                          "clips each reply, which SecAgg+ hides); use local_dp for noise under SecAgg+")


def model_keys(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The run-config keys of a :func:`fedmjp.factory.build_model` spec (the inverse of
    :meth:`RunConfig.model_spec`)."""
    return {"model-name": spec["name"], "model-arch": spec["arch"], "model-variant": spec["variant"],
            "model-kwargs": dict(spec["kwargs"]), "model-checkpoint": spec["checkpoint"] or "",
            "model-april": spec["april"] or "", "model-seed": int(spec["seed"])}


#: Every run-config key with its default (pyproject.toml's [tool.flwr.app.config]).
DEFAULTS: dict[str, Any] = defaults(RunConfig)

#: Keys the server sends to clients each round (the rest comes from the client's run config).
ROUND_KEYS = tuple(key for key, info in keys(RunConfig).items()
                   if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("round"))

"""breaching's attacks (0.1.2) as :class:`~attacks.api.base.Attack` s, through a thin adapter.

Nothing is re-implemented: the adapter loads the attack's YAML from breaching's own config folder
with OmegaConf (never Hydra's ``compose``: it must not run inside another Hydra app), applies the
options as overrides, builds the server payload and the user's shared data directly (breaching's
``construct_case`` downloads datasets), and calls ``breaching.attacks.prepare_attack(...).reconstruct``
with ``server_secrets={}``. Shims (docs/design.md, "Optimization attacks through breaching"),
applied to a private copy of the model:

- timm >= 0.6 renamed ``Block.drop_path`` to ``drop_path1``/``drop_path2``: alias ``drop_path``.
- fused SDPA attention has no double backward on CPU: ``attn.fused_attn = False``.
- breaching zips ``model.parameters()`` with the gradient list and reads the classifier's gradients
  at positions -2/-1: the model is wrapped in a view whose ``parameters()`` are exactly the
  parameters used by the plain forward pass that the update contains, in the model's order with the
  classifier moved last. Parameters the plain forward does not use (E_unk, the DAL head) are left
  out: the attacker does not know the shuffle, so it cannot reproduce their gradient.
- breaching's last-``nn.Linear`` hook (``modern``'s feature regulariser) must find the classifier:
  the view's ``modules()`` skips modules whose parameters are all left out (the DAL head).

FedAvg deltas are converted to gradients first (:func:`~attacks.api.base.update_to_gradients`).
"""
from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.nn as nn

from fedmjp.config import Float, Int
from fedmjp.devices import resolve_device

from ..api.base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, Update, update_to_gradients
from ..api.progress import report
from ..api.registry import Threat, register_attack

_logger = logging.getLogger(__name__)

BREACHING_ATTACKS = ("invertinggradients", "deepleakage", "modern", "seethroughgradients", "wei",
                     "beyondinfering")


def breaching_config_dir() -> Path:
    """breaching's attack config folder (inside the installed package)."""
    import breaching

    return Path(breaching.__file__).parent / "config" / "attack"


def load_attack_config(name: str, overrides: Optional[Mapping[str, Any]] = None):
    """breaching's attack config ``name`` with its ``defaults`` merged, then dotted-key overrides.

    Returns:
        an OmegaConf DictConfig, as Hydra would have composed it.
    """
    from omegaconf import OmegaConf

    folder = breaching_config_dir()
    path = folder / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"breaching has no attack config {name!r} in {folder}")
    cfg = OmegaConf.load(path)
    defaults = cfg.pop("defaults", []) if "defaults" in cfg else []
    merged = OmegaConf.create()
    for entry in defaults:
        if entry != "_self_":
            merged = OmegaConf.merge(merged, OmegaConf.load(folder / f"{entry}.yaml"))
    merged = OmegaConf.merge(merged, cfg)
    for key, value in (overrides or {}).items():
        OmegaConf.update(merged, key, value, force_add=True)
    return merged


class _Meta(dict):
    """breaching reads data metadata both as attributes and as items."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(key) from err


class BreachingView(nn.Module):
    """The model as breaching should see it: ``parameters()`` restricted to ``names`` (classifier
    last) and ``modules()`` without modules whose parameters are all excluded. ``.model`` is the
    wrapped ViT (breaching's AprilAttacker reads ``model.model.blocks``)."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = list(names)

    def forward(self, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.model(inputs)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        params = dict(self.model.named_parameters())
        for name in self.names:
            yield prefix + name, params[name]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def modules(self) -> Iterator[nn.Module]:
        keep = set(self.names)
        yield self
        for name, mod in self.model.named_modules():
            own = [n for n, _ in mod.named_parameters(prefix=name)]
            if not own or any(n in keep for n in own):
                yield mod


def attack_copy(model: nn.Module, dtype: Optional[torch.dtype] = None,
                device: Optional[torch.device] = None) -> nn.Module:
    """A private eval-mode copy with breaching's shims applied (fused attention off, drop_path alias)."""
    work = copy.deepcopy(model).eval()
    if dtype is not None or device is not None:
        work = work.to(device=device, dtype=dtype)
    for p in work.parameters():
        p.requires_grad_(True)
    for block in getattr(work, "blocks", []):
        attn = getattr(block, "attn", None)
        if attn is not None and hasattr(attn, "fused_attn"):
            attn.fused_attn = False
        if not hasattr(block, "drop_path") and hasattr(block, "drop_path1"):
            block.drop_path = block.drop_path1
    return work


def used_parameter_names(model: nn.Module, image_size: tuple[int, int, int]) -> list[str]:
    """Names of parameters the plain forward pass uses, model order, classifier last."""
    named = list(model.named_parameters())
    x = torch.zeros(1, *image_size, device=named[0][1].device, dtype=named[0][1].dtype)
    grads = torch.autograd.grad(model(x).sum(), [p for _, p in named], allow_unused=True)
    used = [n for (n, _), g in zip(named, grads) if g is not None]
    head = getattr(model, "get_classifier", lambda: None)()
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    head_names = [n for n, p in named if id(p) in head_ids and n in used]
    return [n for n in used if n not in head_names] + head_names


def matched_names(model: nn.Module, grads: Mapping[str, torch.Tensor], image_size: tuple[int, int, int]) -> list[str]:
    """Used parameters that the update carries (the gradients an attack can match)."""
    names = [n for n in used_parameter_names(model, image_size) if n in grads]
    if not names:
        raise AttackFailure("the update has no gradient of any parameter used by the forward pass")
    return names


class BreachingAttack(Attack):
    """One of breaching's optimisation attacks by config name.

    Args:
        name: breaching attack config (one of :data:`BREACHING_ATTACKS`).
        iterations: ``optim.max_iterations`` (breaching's defaults are 20k+: far too many for a CPU).
        restarts: ``restarts.num_trials``.
        label_strategy: breaching's strategy when labels are not granted (``iDLG``, ``analytic``,
            ``yin``, ``bias-corrected``, ``wainakh-simple``, ``random``); None keeps the config's.
            Ignored when ``metadata["labels"]`` is given.
        lr: ``optim.step_size``; None keeps the config's.
        overrides: further dotted-key overrides, e.g. ``{"regularization.total_variation.scale": 0.1}``.
        seed: seed of the candidate initialisation (the global RNG state is restored afterwards).
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available); the benchmark passes
            the run's ``--device``.
        dryrun: run one iteration per trial (breaching's dryrun).

    Stats per image: ``objective`` is breaching's restart score of the returned candidate
    (``restarts.scoring``: the cosine or Euclidean gradient distance, without priors);
    ``objective_first``/``objective_min``/``objective_last`` come from its per-iteration trace
    (objective including priors, evaluated before each step).
    """

    takes_name = True

    threat = Threat(batch="any", labels="given, or recovered (breaching's label strategy)", architecture="any",
                    precision="any (never exact: local optimisation)")

    class Options(AttackOptions):
        iterations: Int = 100
        restarts: Int = 1
        label_strategy: Optional[str] = None
        lr: Optional[Float] = None
        overrides: Optional[dict[str, Any]] = None
        seed: Optional[Int] = 0
        device: str = "cpu"
        dryrun: bool = False

    def __init__(self, name: str = "invertinggradients", **options: Any) -> None:
        self.name = name
        o = self._parse_options(options)
        ov: dict[str, Any] = {"optim.max_iterations": o.iterations, "restarts.num_trials": o.restarts,
                              "optim.callback": max(o.iterations // 4, 1)}
        if o.label_strategy is not None:
            ov["label_strategy"] = o.label_strategy
        if o.lr is not None:
            ov["optim.step_size"] = o.lr
        ov.update(o.overrides or {})
        self.cfg = load_attack_config(self._config_name(name), ov)  # ValueError on a bad name
        self.seed, self.dryrun = o.seed, o.dryrun
        self.device = resolve_device(o.device)

    @staticmethod
    def _config_name(name: str) -> str:
        return name

    def device_setup(self) -> dict:
        return dict(device=self.device, dtype=torch.float32)

    def prepare(self, model: nn.Module, update: Update, meta: AttackMetadata):
        """(view, payload, shared_data, cfg, notes) for breaching."""
        grads, notes = update_to_gradients(update, meta)
        dtype = self.device_setup()["dtype"]
        work = attack_copy(model, dtype, self.device)
        names = matched_names(work, grads, meta.image_size)
        view = BreachingView(work, names)
        payload = dict(
            parameters=[p.detach().clone() for p in view.parameters()],
            buffers=[b.detach().clone() for b in view.buffers()],  # public buffers: eval mode
            metadata=_Meta(shape=list(meta.image_size), mean=meta.mean.tolist(), std=meta.std.tolist(),
                           modality="vision", task="classification", name="fedmjp",
                           classes=int(grads[names[-1]].shape[0])),
        )
        labels = None if meta.labels is None else meta.labels.sort()[0].to(self.device)
        shared = dict(gradients=[grads[n].to(self.device, dtype) for n in names], buffers=None,
                      metadata=dict(num_data_points=meta.num_images, labels=labels, local_hyperparams=None))
        cfg = self.cfg.copy()
        if labels is not None and cfg.attack_type == "joint-optimization":
            # DLG optimises labels jointly only when they are unknown (breaching refuses otherwise).
            cfg.attack_type = "optimization"
            notes.append("labels granted: joint label optimisation replaced by the given labels")
        return view, payload, shared, cfg, notes

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        import breaching.attacks

        t0 = time.perf_counter()
        view, payload, shared, cfg, notes = self.prepare(model, update, meta)
        attacker = breaching.attacks.prepare_attack(view, nn.CrossEntropyLoss(), cfg, setup=self.device_setup())
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if self.seed is not None:
                torch.manual_seed(self.seed)
            # breaching's attacker has no hook into its loop: its start and its end are reported
            report(self.name, 0, int(cfg.optim.max_iterations), "breaching's attacker running")
            rec, stats = attacker.reconstruct([payload], [shared], server_secrets={}, dryrun=self.dryrun)
        elapsed = time.perf_counter() - t0
        report(self.name, int(cfg.optim.max_iterations), int(cfg.optim.max_iterations), "breaching's attacker done")
        trace = [v for k, vals in stats.items() if k.startswith("Trial_") for v in vals]
        opt = stats.get("opt_value", float("nan"))
        opt = float(opt) if not isinstance(opt, list) else float("nan")
        labels = rec.get("labels")
        if labels is not None and labels.dim() > 1:
            labels = labels.argmax(dim=-1)
        per_image = dict(
            objective=opt, objective_first=trace[0] if trace else float("nan"),
            objective_min=min(trace) if trace else float("nan"), objective_last=trace[-1] if trace else float("nan"),
            iterations=len(trace), time_s=elapsed / meta.num_images, attack=self.name,
            matched_parameters=len(view.names), failed=False, notes=list(notes),
        )
        stats_list = [dict(per_image) for _ in range(meta.num_images)]
        failed, reason = False, None
        if not torch.isfinite(torch.tensor(opt)) or not all(map(_finite, trace)):
            failed, reason = True, "non-finite objective (breaching cancelled the reconstruction)"
            for s in stats_list:
                s["failed"], s["reason"] = True, reason
        images = meta.denormalize(rec["data"].detach().to(torch.float64))
        return AttackResult(images, stats_list, failed=failed, reason=reason,
                            labels=None if labels is None else labels.detach().cpu().long())


def _finite(v: float) -> bool:
    return v == v and abs(v) != float("inf")


class BreachingApril(BreachingAttack):
    """breaching's own ``AprilAttacker`` (closed form, batch 1, gradients by *position*: [1] must be
    ``pos_embed`` and [4] ``blocks.0.attn.qkv.weight``; one prefix token). For comparison only:
    use ``april_analytic``."""

    threat = Threat(batch="1 per update", labels="not needed",
                    architecture="design-A block 0 with pos_embed and blocks.0.attn.qkv.weight as gradients [1], [4]",
                    precision="float64 clients for an exact copy")

    class Options(AttackOptions):
        solver: str = "gelsd"
        dtype: str = "double"

    def __init__(self, name: str = "april_analytic_breaching", **options: Any) -> None:
        self.name = name
        o = self._parse_options(options)
        self.cfg = load_attack_config("april_analytic", {"solver": o.solver, "impl.dtype": o.dtype})
        self.seed, self.dryrun, self.device = None, False, torch.device("cpu")

    def device_setup(self) -> dict:
        return dict(device=self.device, dtype=getattr(torch, self.cfg.impl.dtype))

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        import breaching.attacks

        t0 = time.perf_counter()
        view, payload, shared, cfg, notes = self.prepare(model, update, meta)
        if len(view.names) < 5 or view.names[1] != "pos_embed" or view.names[4] != "blocks.0.attn.qkv.weight":
            raise AttackFailure("breaching's AprilAttacker reads gradients [1] and [4] as pos_embed and "
                                f"blocks.0.attn.qkv.weight; this model gives {view.names[:5]}")
        attacker = breaching.attacks.prepare_attack(view, nn.CrossEntropyLoss(), cfg, setup=self.device_setup())
        rec, _ = attacker.reconstruct([payload], [shared], server_secrets={})
        stats = dict(objective=float("nan"), iterations=0, time_s=time.perf_counter() - t0,
                     attack=self.name, failed=False, notes=notes)
        return AttackResult(meta.denormalize(rec["data"].detach().to(torch.float64)), [stats])


for _name in BREACHING_ATTACKS:
    register_attack(_name)(BreachingAttack)
register_attack("april_analytic_breaching")(BreachingApril)

"""``ig_closed_start``: Inverting Gradients run to convergence from a closed-form start, MJP-aware
(:class:`InvertingGradientsClosedStart`; the matching machinery is :class:`attacks.optimization.matching.GradientMatching`)."""
from __future__ import annotations

from typing import Annotated, Any, Hashable, Literal, Optional, Sequence

import torch
import torch.nn as nn
from pydantic import Field

from fedmjp.config import Float, Int, option

from ..api.base import AttackMetadata, AttackOptions, Update
from ..api.registry import Threat, register_attack
from ..closed_form.first_layer import unwrap_vit
from .matching import GradientMatching
from ..closed_form.mjp_update import read_mjp_update


#: batch_match's options as the batch start of ig_closed_start at B > 1: the presets' batch_match row,
#: so a benchmark round fits the batch once, with the squared TV that gives the better start.
#: tests/test_ig_closed_start.py::test_batch_update_starts_from_batch_match_s_fitted_batch_in_the_update_s_store
#: pins that the start is that row's fitted batch.
BATCH_START: dict[str, Any] = {"iterations": 200, "tv": 1.0}


@register_attack("ig_closed_start")
class InvertingGradientsClosedStart(GradientMatching):
    """Inverting Gradients run to convergence from a closed-form start, MJP-aware.

    The cosine gradient-matching objective over every parameter the forward uses plus a total
    variation prior (:class:`GradientMatching`), with:

    - the first restart started from a closed-form estimate of the same update where one applies:
      on an MJP model with shuffled positions ``mjp_adaptive`` (the client's x~, its shuffled patches
      in the attack's own order), ``april_robust`` and ``pe_closed_form``, otherwise ``april_robust``
      (the regularised least squares, the best start under a perturbing defence, where the exact
      closed forms break), ``pe_closed_form`` and
      ``april_analytic``; of those that succeed, the one whose gradient matches the update best
      (cosine term: the attacker's own criterion, no ground truth); where none does (not
      registered, a failed condition) the restart starts from the seeded random draw like the
      others. ``start_attacks`` names other candidates (an empty list: random starts only). The
      start attacks get this attack's metadata, so ``mjp_adaptive`` takes its x~ from the update's
      estimate store (``meta.estimates``) where an ``mjp_adaptive`` with the same options already
      put it (a benchmark round), and computes it otherwise;
    - at B > 1, where no closed form applies, the first restart starts from ``batch_match``'s fitted
      batch (``BATCH_START``'s options, the presets' row: read from the update's estimate store where
      that row put it, else fitted here; in this attack's forward, the MJP mask as ``mjp_mask`` says);
    - further restarts from seeded random draws; the restart with the best cosine term is returned;
    - on MJP models (``mjp_mask``), each update's shuffled positions read off the zero rows of
      dL/dP (:func:`attacks.closed_form.mjp_update.read_mjp_update`,
      which also removes the client's DAL term from the gradients) and E_unk put there in the
      attacker's forward;
    - up to ``iterations`` Adam steps per restart, each update stopping once its best objective
      improved by less than ``converge_tol`` (relative) over ``converge_window`` steps, the step
      size halved on a plateau; the stats keep the loss curve (``objective_curve``) and whether
      it converged, per restart in ``trials``;
    - a start whose gradient already matches the update (1 - cos < ``exact_cos``: an exact closed
      form on a clean update) takes no steps and no random restarts: there is nothing to improve.

    Why the defaults: an unsigned Adam at lr 0.03 (normalised units) refines a start instead of
    moving every pixel by the signed step breaching's IG takes from noise (lr 0.1); a light TV
    (0.01) because the closed form's start needs no smoothing where it is exact; up to 2000 steps
    and a stop at < 0.1 % relative change per 50 steps, because from a quantised update's closed-form
    start the objective is still falling after 1500 (docs/results/attacks.md). ``time_s`` in the
    stats gives the cost.

    ``defence_model=True`` matches through the clients' known defence (``meta.defence``: the kept
    entries of a pruned update, the quantiser's bins, the DP noise likelihood). Off by default: it
    changes little and costs CPU time, since the runs go on to the step cap (docs/results/attacks.md);
    tests/test_ig_closed_start.py::test_modelled_defence_does_at_least_as_well_as_ignoring_it pins
    that it does no harm.
    """

    threat = Threat(batch="any", labels="given, or recovered", architecture="any ViT (MJP-aware where the model has E_unk)", precision="any (never exact: starts from the best closed form that applies)")

    name = "ig_closed_start"

    class Options(GradientMatching.Options):
        iterations: Int = option(2000, ge=1)
        lr: Float = 0.03
        tv: Float = 0.01
        signed: Optional[Literal["hard"]] = None
        scheduler: Optional[Literal["step-lr"]] = None
        restarts: Int = option(2, ge=1)
        converge_window: Int = option(50, ge=1)  # it runs to convergence
        converge_tol: Float = option(1e-3, ge=0.0)
        # None: the closed forms of the class docstring; [] random starts only. Any sequence of names.
        start_attacks: Annotated[Optional[list[str]], Field(strict=False)] = None
        # options of a start attack by name, checked against its schema when this attack is built
        start_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
        mjp_mask: bool = True
        exact_cos: Float = option(1e-6, ge=0.0, lt=1.0)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        self.start_attacks = None if o.start_attacks is None else tuple(o.start_attacks)
        self.start_options = self._checked_start_options(o.start_options)
        self.mjp_mask, self.exact_cos = o.mjp_mask, o.exact_cos
        # it reads mjp_adaptive's x~ (shuffled updates) or batch_match's fitted batch (B > 1) where
        # one is a start: its calls then run beside theirs
        self.shares_estimates = (self.start_attacks is None or "batch_match" in self.start_attacks
                                 or (self.mjp_mask and "mjp_adaptive" in self.start_attacks))

    @classmethod
    def run_key(cls, options: AttackOptions, model: nn.Module) -> Optional[Hashable]:
        """Seeded runs are deterministic; ``mjp_mask`` has no effect on a model without E_unk, so
        the preset's ``ig_plain_forward`` (``mjp_mask: false``) is ``ig_closed_start`` on a plain
        ViT and runs once there (``progress`` only draws a bar)."""
        if getattr(options, "seed", None) is None:
            return None
        vit = unwrap_vit(model)
        plain = getattr(vit, "unk_embed", None) is None or not hasattr(vit, "pos_embed")
        return cls.options_key(options, ("progress", "mjp_mask") if plain else ("progress",))

    def _prepare_groups(self, model: nn.Module, updates: Sequence[Update], metas: Sequence[AttackMetadata],
                        converted: list) -> tuple[Optional[torch.Tensor], Optional[list], list[list[str]]]:
        vit = unwrap_vit(model)
        mjp = self.mjp_mask and getattr(vit, "unk_embed", None) is not None and hasattr(vit, "pos_embed")
        masks, starts, notes = [], [], []
        for k, (update, meta) in enumerate(zip(updates, metas)):
            note: list[str] = []
            shuffled = False
            if mjp:
                S, cleaned, _ = read_mjp_update(vit, converted[k][0])
                converted[k] = (cleaned, converted[k][1])
                masks.append(S)
                shuffled = bool(S.any())
                note.append(f"MJP-aware forward: E_unk at the {int(S.sum())} positions whose dL/dP rows are zero")
            order = self.start_attacks
            start_options = self.start_options
            if order is None and meta.num_images > 1:
                # no closed form takes a batch: batch_match's fitted batch (the preset's row, shared
                # through the update's estimate store) in this attack's forward
                order = ("batch_match",)
                start_options = {**start_options, "batch_match": {**BATCH_START, "mjp_mask": self.mjp_mask,
                                                                  **start_options.get("batch_match", {})}}
            elif order is None:
                order = (("mjp_adaptive", "april_robust", "pe_closed_form") if shuffled
                         else ("april_robust", "pe_closed_form", "april_analytic"))
            starts.append(self._closed_form_start(model, update, meta, order, note, self.device, start_options))
            notes.append(note)
        return (torch.stack(masks) if mjp else None), starts, notes

    def _checked_start_options(self, start_options: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``start_options`` with every entry checked against its attack's schema now, so a bad
        name or value fails when the attack is built, naming the entry, not midway through a run."""
        from ..api.registry import attack_options

        checked = {}
        for name, options in start_options.items():
            if self.start_attacks is not None and name not in self.start_attacks:
                raise ValueError(f"ig_closed_start: start_options names {name!r}, which is not in "
                                 f"start_attacks {list(self.start_attacks)}; add it there or remove the entry")
            try:
                checked[name] = dict(attack_options(name, dict(options)))
            except ValueError as err:
                raise ValueError(f"ig_closed_start: start_options[{name!r}]: {err}") from None
        return checked

    @staticmethod
    def _closed_form_start(model: nn.Module, update: Update, meta: AttackMetadata, order: Sequence[str],
                           note: list[str], device: torch.device,
                           start_options: dict[str, dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
        """(name, normalised [n, C, H, W]) of every attack in ``order`` that succeeds; the first
        restart starts from the one whose gradient matches the update best (:meth:`_pick_starts`).
        A start attack with a ``device`` option runs on this attack's device."""
        from ..api.registry import attack_class, attack_names, create_attack, option_schema

        known = set(attack_names())
        out = []
        for name in order:
            if name not in known:
                note.append(f"start: {name} is not a registered attack")
                continue
            options: dict[str, Any] = dict(start_options.get(name, {}))
            if name in ("mjp_adaptive", "batch_match"):
                options["unshuffle"] = False  # the client's x~: this attack's forward puts E_unk at S
            if "device" in option_schema(attack_class(name)).model_fields:
                options["device"] = str(device)
            attack = create_attack(name, **options)
            result = attack.reconstruct(model, update, meta)
            if result.failed or any(result.failed_images) or result.images.shape[0] != meta.num_images:
                note.append(f"start: {name} failed ({result.reason})")
                continue
            out.append((name, meta.normalize(result.images.double()).float()))
        if not out:
            note.append("first restart started from a random draw (no closed form succeeded)")
        return out

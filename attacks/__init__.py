"""Gradient-inversion attacks behind one interface (docs/attacks.md; the mathematics: docs/design.md).

    attack = attacks.create_attack("april_analytic")
    result = attack.reconstruct(model, update, {"mean": ..., "std": ..., "num_images": 1})
    result.images  # [B, 3, H, W] in [0, 1]

Layout, by kind (each package imports only those listed after it; pyproject.toml's import contracts):
``structure`` (the block-0 read), ``optimization`` (gradient matching, the span fit, breaching's
attacks), ``closed_form`` (APRIL, the PE closed form, label counts, the MJP maths), then ``solvers``
(Levenberg-Marquardt, CG, spans, the jigsaw solver) and ``api`` (the Attack interface, registry,
metadata, errors), which import no other part of attacks.

Names: see :func:`attack_names`. No Flower import here: attacks run without a simulation.
"""
from .api.base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, update_to_gradients
from .api.estimates import EstimateStore
from .api.registry import attack_names, create_attack, register_attack
from .api.updates import compute_per_sample_updates, compute_update, defended_update
from .closed_form.first_layer import AprilConditionError, check_conditions
from .closed_form.april import AprilAnalytic
from .optimization.breaching_adapter import BREACHING_ATTACKS, BreachingAttack, load_attack_config
from .optimization.matching import AprilOptimization, GradientMatching, InvertingGradientsBatched
from .optimization.ig_closed_start import InvertingGradientsClosedStart
from .optimization.mjp_adaptive import MJPAdaptive
from .closed_form.mjp_maths import mjp_reduction
from .closed_form.mjp_update import detect_shuffled
from .solvers.jigsaw import solve_jigsaw
from .closed_form.pe_closed_form import PEClosedForm, PESystem, pe_closed_form_system, pe_conditions
from .closed_form.april_robust import AprilRobust
from .optimization.batch_match import BatchMatch
from .optimization.likelihood_match import LikelihoodMatch
from .structure.block0_roots import Block0Roots
from .closed_form.labels import LabelCounts, recover_label_counts, recover_labels

__all__ = [
    "BREACHING_ATTACKS", "AprilAnalytic", "AprilConditionError", "AprilOptimization", "Attack", "AttackFailure",
    "AttackMetadata", "AttackOptions", "AttackResult", "BatchMatch", "Block0Roots", "BreachingAttack", "EstimateStore", "LabelCounts", "GradientMatching", "InvertingGradientsBatched", "InvertingGradientsClosedStart", "LikelihoodMatch", "MJPAdaptive",
    "attack_names", "check_conditions", "compute_per_sample_updates", "compute_update", "create_attack", "defended_update", "detect_shuffled",
    "load_attack_config", "mjp_reduction", "recover_label_counts", "recover_labels", "register_attack", "solve_jigsaw", "update_to_gradients",
]

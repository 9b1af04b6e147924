"""Gradient-inversion attacks behind one interface (docs/attacks.md; the mathematics: docs/design.md).

    attack = attacks.create_attack("april_analytic")
    result = attack.reconstruct(model, update, {"mean": ..., "std": ..., "num_images": 1})
    result.images  # [B, 3, H, W] in [0, 1]

Names: see :func:`attack_names`. No Flower import here: attacks run without a simulation.
"""
from .base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, update_to_gradients
from .estimates import EstimateStore
from .registry import attack_names, create_attack, register_attack
from .updates import compute_per_sample_updates, compute_update
from .first_layer import AprilConditionError, check_conditions
from .april import AprilAnalytic
from .breaching_adapter import BREACHING_ATTACKS, BreachingAttack, load_attack_config
from .matching import AprilOptimization, GradientMatching, InvertingGradientsBatched
from .ig_closed_start import InvertingGradientsClosedStart
from .mjp_adaptive import MJPAdaptive
from .mjp_maths import mjp_reduction
from .mjp_update import detect_shuffled
from .jigsaw_solver import solve_jigsaw
from .pe_closed_form import PEClosedForm, PESystem, pe_closed_form_system, pe_conditions
from .april_robust import AprilRobust
from .batch_match import BatchMatch
from .block0_roots import Block0Roots
from .labels import LabelCounts, recover_label_counts, recover_labels

__all__ = [
    "BREACHING_ATTACKS", "AprilAnalytic", "AprilConditionError", "AprilOptimization", "Attack", "AttackFailure",
    "AttackMetadata", "AttackOptions", "AttackResult", "BatchMatch", "Block0Roots", "BreachingAttack", "EstimateStore", "LabelCounts", "GradientMatching", "InvertingGradientsBatched", "InvertingGradientsClosedStart", "MJPAdaptive",
    "attack_names", "check_conditions", "compute_per_sample_updates", "compute_update", "create_attack", "detect_shuffled",
    "load_attack_config", "mjp_reduction", "recover_label_counts", "recover_labels", "register_attack", "solve_jigsaw", "update_to_gradients",
]

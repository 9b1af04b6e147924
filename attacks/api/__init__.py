"""The attack interface: :class:`Attack` and its results, options and failures, the registry of names,
the metadata an attacker is given, and the client-update helpers. Imports no other part of attacks."""
from .base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, update_to_gradients
from .estimates import EstimateStore
from .registry import attack_catalog, attack_class, attack_names, attack_options, create_attack, option_schema, register_attack
from .updates import compute_per_sample_updates, compute_update, defended_update

__all__ = ["Attack", "AttackFailure", "AttackMetadata", "AttackOptions", "AttackResult", "EstimateStore",
           "attack_catalog", "attack_class", "attack_names", "attack_options", "compute_per_sample_updates", "compute_update", "defended_update",
           "create_attack", "option_schema", "register_attack", "update_to_gradients"]

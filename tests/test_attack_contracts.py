"""Every built-in attack of the registry keeps the interface's contract (attacks/api/base.py).

On a tiny model (16 px, patch 4, depth 2, width 96) and few iterations, so that every attack module
runs in the fast loop (``bash scripts/test.sh --fast``); whether an attack *succeeds* at its job is
for its own test file, run to convergence in the full suite. The contract:

- ``reconstruct`` returns an :class:`attacks.AttackResult` and raises nothing; a failure is
  ``failed=True`` with a reason on the result and on every image, never an unexpected error (a
  traceback in ``error`` is a bug);
- ``images`` (and ``unshuffled`` where given) are [B, 3, H, W] float32 on the CPU, finite, in [0, 1];
  one ``stats`` dict per image with its ``notes`` (and ``time_s`` where it ran); ``labels`` are None or [B] long;
- what the attack declares matches what it does: it is called by its registered name, and one that
  says it shares no estimates (``shares_estimates``) leaves the update's :class:`EstimateStore` alone.

Two cases per attack: one image's update of a plain design-A ViT, which every built-in attack
applies to (each must succeed there), and a batch of two images of a standard pre-norm MJP ViT
with shuffled patches, which some attacks refuse (batch size 1, design A), with a reason.
"""
from __future__ import annotations

import math

import pytest
import timm
import torch

import attacks
import fedmjp  # noqa: F401  (registers the mjp_* models)
from attacks.api.registry import attack_class
from helpers import MEAN, STD, bundled_images, normalize

SIZE = 16
#: Width 96 (not less): block0_roots finds the roots of block 0's MLP at 16 px only from about this
#: width on (at 48 it fails with "roots missing"), which test_every_attack_succeeds_on_one_image pins.
WIDTH = 96

#: Options that cut each attack's work to a few steps; the defaults of the others already take well
#: under a second on this model. Every built-in attack runs here; a new attack with a long default
#: run gets its own entry.
FEW_STEPS: dict[str, dict] = {
    "april_optimization": dict(iterations=3),
    "invertinggradients_batched": dict(iterations=3),
    "batch_match": dict(iterations=3),
    "april_robust": dict(iterations=2, cg_maxiter=20),
    "block0_roots": dict(starts=8, rounds=10),
    "mjp_adaptive": dict(iterations=2, starts=1, probe_iterations=2, fallback_iterations=2),
    "likelihood_match": dict(iterations=1, cg_iterations=2, start="april_robust", start_options=dict(iterations=2, cg_maxiter=20)),
    **{name: dict(iterations=2) for name in attacks.BREACHING_ATTACKS},
}
# ig_closed_start runs some of the above as its start (batch_match at B > 1, mjp_adaptive on a
# shuffled update): those with few steps too
FEW_STEPS["ig_closed_start"] = dict(iterations=3, restarts=1, start_options={
    name: FEW_STEPS[name] for name in ("april_robust", "batch_match", "mjp_adaptive")})


def built_in_attacks() -> list[str]:
    """The registry's built-in names (test modules and installed plug-ins register others)."""
    return [n for n in attacks.attack_names() if attack_class(n).__module__.startswith("attacks.")]


def tiny_model(first_block: str, variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("mjp_vit_cifar_patch4_32", img_size=SIZE, patch_size=4, depth=2, embed_dim=WIDTH,
                             num_heads=3, variant=variant, first_block=first_block).eval().double()


def attack_once(name: str, model: torch.nn.Module, B: int, shuffled: bool) -> tuple[attacks.Attack, attacks.AttackResult, attacks.EstimateStore]:
    """``name`` (few steps) on the update of ``B`` photographs; labels not given to the attack."""
    x = bundled_images(B, SIZE)
    mask = None
    if shuffled:  # setting (b): the client feeds a jigsaw-shuffled image with its positions masked
        from fedmjp.models import MJPVisionTransformer

        assert isinstance(model, MJPVisionTransformer)
        grid = (SIZE // 4) ** 2
        mask = torch.zeros(B, grid, dtype=torch.bool)
        mask[:, ::3] = True
    update = attacks.compute_update(model, normalize(x), torch.arange(B), unk_mask=mask)
    store = attacks.EstimateStore()
    meta = attacks.AttackMetadata(B, (3, SIZE, SIZE), MEAN.double(), STD.double(), None, estimates=store)
    attack = attacks.create_attack(name, **FEW_STEPS.get(name, {}))
    result = attack.reconstruct(model, update, meta)
    return attack, result, store


def check_contract(name: str, attack: attacks.Attack, result: attacks.AttackResult,
                   store: attacks.EstimateStore, B: int) -> None:
    assert isinstance(result, attacks.AttackResult), type(result)
    assert result.error is None, f"{name} raised an unexpected error:\n{result.error}"
    assert attack.name == name
    if not attack.shares_estimates:
        assert store.computed == 0 and store.reused == 0, f"{name} declares no shared estimates but used {store!r}"
    shape = (B, 3, SIZE, SIZE)
    for what, images in (("images", result.images), ("unshuffled", result.unshuffled)):
        if images is None and what == "unshuffled":
            continue
        assert tuple(images.shape) == shape, (name, what, tuple(images.shape))
        assert images.dtype == torch.float32 and images.device.type == "cpu", (name, what, images.dtype)
        assert bool(torch.isfinite(images).all()), (name, what)
        assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0, (name, what)
    assert len(result.stats) == B, (name, len(result.stats))
    for s in result.stats:
        assert isinstance(s.get("notes"), list), (name, s)
    if result.labels is not None:
        assert tuple(result.labels.shape) == (B,) and result.labels.dtype == torch.long, (name, result.labels)
    if result.failed:
        assert isinstance(result.reason, str) and result.reason.strip(), (name, result.reason)
        assert all(s.get("failed") and s.get("reason") for s in result.stats), (name, result.stats)
        assert result.failed_images == [True] * B
    else:
        assert result.reason is None, (name, result.reason)
        assert all(math.isfinite(float(s["time_s"])) for s in result.stats), (name, result.stats)


def test_the_contract_covers_every_built_in_attack() -> None:
    """The parametrisation below is the registry's built-in names, so an attack added later runs here."""
    names = built_in_attacks()
    assert {"april_analytic", "april_robust", "batch_match", "block0_roots", "ig_closed_start", "mjp_adaptive",
            "pe_closed_form", "invertinggradients"} <= set(names)
    assert set(FEW_STEPS) <= set(names), sorted(set(FEW_STEPS) - set(names))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", built_in_attacks())
def test_every_attack_succeeds_on_one_image(name: str) -> None:
    attack, result, store = attack_once(name, tiny_model("april", "plain"), B=1, shuffled=False)
    check_contract(name, attack, result, store, B=1)
    assert not result.failed, f"{name} failed on a model it applies to: {result.reason}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", built_in_attacks())
def test_every_attack_gives_images_or_a_reason_on_a_shuffled_batch_of_two(name: str) -> None:
    attack, result, store = attack_once(name, tiny_model("standard", "mjp"), B=2, shuffled=True)
    check_contract(name, attack, result, store, B=2)

"""Past the floor B T = D - 1: fc2's input span completed (attacks/structure/completion.py), and the
scales and positions of step 2 (attacks.structure.linear.scales_past_floor).

Three bundled photographs (scikit-image's), the shipped CIFAR DeiT with block 0 as trained, float64:
B T = 195 tokens against dL/dW_fc2's rank 191, where no true token is a root of the per-token problem
(tests/test_block0_roots.py: test_past_d_minus_1_tokens_no_true_token_is_in_fc2s_span).
"""
from __future__ import annotations

import pytest
import torch

from attacks.api.base import AttackFailure
from attacks.structure.completion import POINTS_PER_DIMENSION, complete_span, near_roots
from attacks.structure.roots import find_roots
from attacks.structure.token_roots import MLPSpans
from tests.test_block0_roots import _deit, _update_and_tokens


def _incomplete(B: int = 3):
    model = _deit()
    _, _, update, U = _update_and_tokens(model, B)
    G = update["blocks.0.mlp.fc2.weight"].double()
    _, sv, Vh = torch.linalg.svd(G, full_matrices=False)
    r = int((sv > 1e-10 * sv[0]).sum())
    return model, update, U, Vh[:r].T.contiguous()


@pytest.mark.slow
def test_the_completed_span_makes_every_true_token_a_root_and_the_search_finds_only_true_ones() -> None:
    model, update, U, S2 = _incomplete()
    blk, n, D = model.blocks[0], U.shape[0], int(model.embed_dim)
    full = torch.eye(D, dtype=torch.float64)
    k = n - S2.shape[1]
    assert k == 4
    before = MLPSpans(blk, full, S2).value(U)
    assert float(before.median()) > 1e-9  # against fc2's incomplete span no true token is a root
    gen = torch.Generator().manual_seed(0)
    points = near_roots(MLPSpans(blk, full, S2), POINTS_PER_DIMENSION * k, 16, 60, gen)
    assert points.shape[0] > k
    done = complete_span(blk, S2, n, points)
    unit = U / U.norm(dim=1, keepdim=True)
    assert done.value < 1e-20 < done.value_first
    assert float((1 - ((done.points / done.points.norm(dim=1, keepdim=True)) @ unit.T).max(1).values).max()) < 1e-12
    assert done.basis.shape == (4 * D, n)
    after = MLPSpans(blk, full, done.basis).value(U)
    assert float(after.max()) < 1e-16  # every true token is a root again (measured 1e-20)
    search = find_roots(blk, full, done.basis, update["blocks.0.mlp.fc1.weight"].double(),
                        update["blocks.0.mlp.fc2.weight"].double(), n, 8, 1, 60, gen)
    hits = (search.roots / search.roots.norm(dim=1, keepdim=True)) @ unit.T
    assert search.roots.shape[0] >= 3
    assert float((1 - hits.max(1).values).max()) < 1e-10  # every root found is a true token
    # D roots found: fc1's span (the whole input space) has no part left empty, so no missing-token
    # round (its equations would be empty: a singular solve); the tail round reads the last 3 off
    # fc1's update instead (attacks.structure.tail), here on the completed span
    late = find_roots(blk, full, done.basis, update["blocks.0.mlp.fc1.weight"].double(),
                      update["blocks.0.mlp.fc2.weight"].double(), n, 4, 2, 20, gen, found=U[:D], steered=False)
    assert late.modes[0] == "tail" and late.roots.shape[0] == n


def test_completion_refuses_what_it_cannot_do() -> None:
    torch.manual_seed(0)
    import timm

    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="standard", depth=1).double()
    blk = model.blocks[0]
    S2 = torch.linalg.qr(torch.randn(768, 10, dtype=torch.float64))[0]
    points = torch.randn(3, 192, dtype=torch.float64)
    with pytest.raises(AttackFailure, match="nothing to complete"):
        complete_span(blk, S2, 10, points)
    with pytest.raises(AttackFailure, match="needs more than 4 near-roots; got 3"):
        complete_span(blk, S2, 14, points)
    with pytest.raises(AttackFailure, match=r"Jacobian \(.* GB > 0.0 GB\)"):
        complete_span(blk, S2, 12, points, memory=1.0)


def test_the_scales_and_positions_past_the_floor_follow_linearly() -> None:
    """At B = 3 (195 tokens > D - 1) dL/db_proj no longer fixes norm2's scales; proj's weight update
    projected off the embeddings and the position offsets does (attacks.structure.linear.scales_past_floor),
    and with them every token's position is its best fit, given the roots in any order (measured:
    scales to 1e-11 relative, every position right). What is left open is the attention outputs'
    part in the null space of the tokens' output gradients (B T - rank dims): docs/design.md."""
    from attacks.structure.linear import embeddings_less_shift, token_equations
    from attacks.structure.placement import position_residuals, token_offsets

    model = _deit()
    blk = model.blocks[0]
    x, xn, update, U = _update_and_tokens(model, 3)
    with torch.no_grad():
        z = model.norm_pre(model._pos_embed(model.patch_embed(xn)))
        h = (z + blk.ls1(blk.attn(blk.norm1(z)))).reshape(-1, z.shape[-1])
        sigma = torch.sqrt(h.var(1, unbiased=False) + blk.norm2.eps)
    perm = torch.randperm(U.shape[0], generator=torch.Generator().manual_seed(3))
    eq = token_equations(model, update, U[perm])
    assert float(((1 / eq.inv_sigma - sigma[perm]) / sigma[perm]).abs().max()) < 1e-8
    base = embeddings_less_shift(blk.attn, eq)
    _, off, _, Qm = token_offsets(model)
    res = position_residuals(base, off, Qm)
    assert torch.equal(res.argmin(1), perm % 65)


def test_a_b3_batch_follows_from_its_roots_in_any_order() -> None:
    """Past the floor the linear steps still read the batch: given the 195 roots of three bundled
    photographs in random order, every position and every image is right and the images come back
    close, within what the position equations leave free of the attention outputs; the root polish
    (attacks.structure.polish.root_polish) then takes every image to the roots' rounding floor."""
    from attacks.structure.block0_roots import batch_from_roots
    from benchmark.scoring import pair_reconstructions
    from tests.helpers import MEAN, STD

    model = _deit()
    x, xn, update, U = _update_and_tokens(model, 3)
    perm = torch.randperm(U.shape[0], generator=torch.Generator().manual_seed(3))

    def psnr(out) -> list[float]:
        rec = out.images * STD.double()[:, None, None] + MEAN.double()[:, None, None]
        order = pair_reconstructions(rec.float(), x.float())
        return [float(-10 * torch.log10((rec[order[b]] - x[b]).pow(2).mean())) for b in range(3)]

    linear = batch_from_roots(model, update, U[perm], 3, polish_jacobians=0)
    assert linear.root_polish is None
    assert 60.0 < min(psnr(linear)) and max(psnr(linear)) < 120.0  # measured 74.3, 80.3, 82.1 dB; flat ~12
    out = batch_from_roots(model, update, U[perm], 3)
    assert torch.equal(out.position, perm % 65)
    same = out.image[:, None] == out.image[None]
    truth = (perm // 65)[:, None] == (perm // 65)[None]
    assert torch.equal(same, truth)
    assert out.root_polish is not None and max(out.root_polish.jacobians) <= 4  # measured 2 each
    assert float(out.root_polish.residual_after.max()) < 1e-18 < float(out.root_polish.residual_before.min())
    assert min(psnr(out)) > 200.0, psnr(out)  # measured 266-284 dB


@pytest.mark.slow
def test_the_completion_drops_a_point_that_is_no_true_token() -> None:
    """A near-root in the basin of something other than a true token stalls the rank-k fit (measured:
    the midpoint of two true tokens among 11 near ones ends it at a (k+1)-th singular value of 6.8e-4
    when nothing is dropped); complete_span drops the point whose removal lowers it most and refits,
    and the span completes (1e-13) on the true tokens alone."""
    model, update, U, S2 = _incomplete()
    unit = U / U.norm(dim=1, keepdim=True)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randperm(U.shape[0], generator=gen)[:11]
    near = U[idx] * (1 + 1e-5 * torch.randn(11, 1, generator=gen, dtype=torch.float64)) \
        + 1e-5 * torch.randn(11, U.shape[1], generator=gen, dtype=torch.float64)
    bad = 0.5 * (U[idx[0]] + U[idx[1]])
    points = torch.cat([near[:5], bad[None], near[5:]])
    done = complete_span(model.blocks[0], S2, U.shape[0], points)
    assert done.dropped == 1 and done.points.shape[0] == 11
    assert done.next_singular < 1e-10
    gap = 1 - ((done.points / done.points.norm(dim=1, keepdim=True)) @ unit.T).max(1).values
    assert float(gap.max()) < 1e-12


@pytest.mark.slow
def test_an_mjp_b3_batch_follows_from_its_roots_the_membership_repaired_on_them() -> None:
    """On the shipped DeiT+MJP at B = 3 (17 of 64 positions shuffled per image) the linear membership
    solve puts some tokens in the wrong image (measured 2,928 of 38,025 token pairs wrong, margin
    0.04), and no patch refit could then reach the roots. The repair on the roots
    (attacks.structure.polish.refit_membership) puts every token in its image, and each image's
    shuffled set and its other patches come out exact."""
    import attacks
    from attacks.structure.block0_roots import batch_from_roots
    from benchmark.scoring import pair_reconstructions
    from tests.helpers import MEAN, STD, bundled_images

    B = 3
    model = _deit(variant="mjp")
    gen = torch.Generator().manual_seed(B)
    mask = torch.zeros(B, 64, dtype=torch.bool)
    for b in range(B):
        mask[b, torch.randperm(64, generator=gen)[:17]] = True
    x = bundled_images(B, 32, 0)
    xn = (x - MEAN.double()[:, None, None]) / STD.double()[:, None, None]
    seen = {}
    hook = model.blocks[0].mlp.fc1.register_forward_hook(lambda m, a, o: seen.__setitem__("u", a[0].detach()))
    update = attacks.compute_update(model, xn, torch.tensor([3, 5, 1]), unk_mask=mask)
    hook.remove()
    U = seen["u"].reshape(-1, 192)
    perm = torch.randperm(U.shape[0], generator=gen)
    out = batch_from_roots(model, update, U[perm], B)
    same = out.image[:, None] == out.image[None]
    truth = (perm // 65)[:, None] == (perm // 65)[None]
    assert torch.equal(same, truth)
    assert out.membership_repairs > 0 and out.membership_margin < 0.2  # the linear solve alone was wrong
    assert out.root_polish is not None and out.root_polish.relative < 1e-18
    truth_patches = xn.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(B, 64, 48)
    got = out.images.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(B, 64, 48)
    pair = pair_reconstructions(out.images.float(), xn.float())
    for b in range(B):
        g = pair[b]
        assert torch.equal(out.shuffled[g], mask[b])
        assert float((got[g][~mask[b]] - truth_patches[b][~mask[b]]).abs().max()) < 1e-8  # measured 2e-10
        dist = torch.cdist(got[g][mask[b]], truth_patches[b][mask[b]])
        assert float(dist.min(1).values.max()) < 1e-8


def _tail_case():
    """The three photographs' update, its true roots and fc2's span completed from them (the tail
    round on its own, apart from the completion's near-roots)."""
    model = _deit()
    _, _, update, U = _update_and_tokens(model, 3)
    mlp = model.blocks[0].mlp
    with torch.no_grad():
        S2 = torch.linalg.qr(mlp.act(mlp.fc1(U)).T)[0]
    return model, update, U, S2


def test_the_missing_tokens_span_comes_off_fc1s_update_and_only_from_true_tokens() -> None:
    """Past D, with one token missing from the found roots, the alternation of
    attacks.structure.tail.missing_span converges to its fc1 input's direction (measured 2e-13 off
    in 200 steps); with one found point that is no token (the midpoint of two) it stays decades
    above the floor, and no start in it is a root."""
    from attacks.structure.tail import TAIL_FLOOR, missing_span

    model, update, U, _ = _tail_case()
    G1, G2 = update["blocks.0.mlp.fc1.weight"].double(), update["blocks.0.mlp.fc2.weight"].double()
    keep = torch.ones(U.shape[0], dtype=torch.bool)
    keep[150] = False
    got = missing_span(model.blocks[0], U[keep], G1, G2, 1)
    q = got.basis[:, 0]
    assert got.misfit < 1e-12
    assert float((U[150] - (U[150] @ q) * q).norm() / U[150].norm()) < 1e-10
    planted = U[keep].clone()
    planted[5] = (U[5] + U[70]) / 2
    bad = missing_span(model.blocks[0], planted, G1, G2, 1, iterations=60)
    assert bad.misfit > 1e3 * TAIL_FLOOR


@pytest.mark.slow
def test_the_tail_round_finds_the_last_roots_past_d() -> None:
    """Two tokens missing past D (40 and 150: the alternation pins the first while the second's part
    stalls): one tail round finds the first, the next the second, each a true token to 1e-13."""
    model, update, U, S2 = _tail_case()
    n, D = U.shape[0], int(model.embed_dim)
    keep = torch.ones(n, dtype=torch.bool)
    keep[[40, 150]] = False
    search = find_roots(model.blocks[0], torch.eye(D, dtype=torch.float64), S2,
                        update["blocks.0.mlp.fc1.weight"].double(), update["blocks.0.mlp.fc2.weight"].double(),
                        n, 8, 3, 30, torch.Generator().manual_seed(0), found=U[keep])
    assert search.roots.shape[0] == n and search.modes[0] == "tail", (search.per_round, search.modes)
    err = torch.cdist(search.roots, U[~keep], compute_mode="donot_use_mm_for_euclid_dist").min(0).values
    assert float((err / U[~keep].norm(dim=1)).max()) < 1e-12

"""Steps 3 and 4 of the block-0 read (:mod:`attacks.structure.block0_roots`): every token's position
and patch, then its image, and the images assembled.

3. **Positions and patches.** Every token's embedding z_t = W_e x_t + b_e + P_p is known up to a shift
   mu_t (the standard block: through h_t = sigma_t n_t + mu_t and h_t = z_t + W_proj c_t + b_proj) or
   exactly (design A: the attention solve's). For each position p, least squares in (mu_t, x_t)
   (1 + C p^2 unknowns, D equations) leaves a residual at the rounding floor at the token's own
   position only (the class token: z = cls + P_0). On MJP E_unk is one more candidate position.
4. **Which image.** A token's attention output is its image's values averaged by its softmax weights:
   sum_s m_s exp(q_t . k_s) (v_s - c_t) = 0 per head, linear in the indicators m_s of the tokens that
   share its image (D equations, B T - 1 unknowns). Solved for each class token, it says which token
   of every position belongs to which image (an optimal assignment per position); the E_unk tokens
   go to the images with free positions, in root order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, cast

import torch
import torch.nn as nn
from scipy.optimize import linear_sum_assignment

from ..api.base import AttackFailure
from .linear import lstsq, token_offsets

#: a token is placed where its relative position residual is below this: the true position's sits at
#: the rounding floor, every other one orders of magnitude above (tests/test_block0_roots.py:
#: test_the_batch_follows_exactly_from_the_true_roots_in_any_order, test_a_token_of_another_batch_fits_no_position)
POSITION_TOL = 1e-6
#: the same on design A, where the embeddings come through the attention solve and carry step 2's error
#: in c: embeddings 1e-5 off (relative) are still placed, 1e-2 off are not
#: (tests/test_block0_roots.py: test_design_a_places_tokens_the_attention_solve_returns_at_its_floor)
DESIGN_A_POSITION_TOL = 1e-3


def position_residuals(base: torch.Tensor, off: torch.Tensor, Qm: torch.Tensor) -> torch.Tensor:
    """[n, positions] each token's relative residual at each position (step 3): the class token's
    up to a multiple of the ones vector, every other up to (mu, x)."""
    D = base.shape[1]
    one = torch.ones(D, dtype=torch.float64) / D ** 0.5
    scale = base.norm(dim=1)
    res = torch.empty(base.shape[0], off.shape[0], dtype=torch.float64)
    r0 = base - off[0]
    res[:, 0] = (r0 - (r0 @ one)[:, None] * one).norm(dim=1) / scale
    for p in range(1, off.shape[0]):
        r = base - off[p]
        res[:, p] = (r - (r @ Qm) @ Qm.T).norm(dim=1) / scale
    return res


def assign_positions(res: torch.Tensor, T: int) -> torch.Tensor:
    """Design A: one position per token [n] by an optimal assignment on the residuals ``res``
    [n, T (+1 with E_unk)]: one class token, each patch position at most once, E_unk any number."""
    n = res.shape[0]
    cols = torch.arange(T)
    if res.shape[1] > T:  # E_unk (index T) as often as there are tokens
        cols = torch.cat([cols, torch.full((n,), T)])
    rows, picked = linear_sum_assignment(res[:, cols].numpy())
    pos = torch.empty(n, dtype=torch.long)
    pos[torch.as_tensor(rows, dtype=torch.long)] = cols[torch.as_tensor(picked, dtype=torch.long)]
    return pos


@dataclass(frozen=True)
class Placement:
    """Outcome of :func:`place_tokens`, one row per root: its position [n] (0: the class token, T:
    E_unk), its relative residual there [n], its smallest at any other position [n], its embedding
    Z [n, D] and its patch X [n, C p^2] (zero for the class token)."""

    position: torch.Tensor
    residual: torch.Tensor
    runner_up: torch.Tensor
    tokens: torch.Tensor
    patches: torch.Tensor


def place_tokens(vit: nn.Module, base: torch.Tensor, batch: int, tol: float) -> Placement:
    """Step 3 (module doc): every token ``base`` [n, D] (its embedding up to a shift mu) at its best
    position, refused where one fits none within ``tol`` or a position gets a wrong number of tokens."""
    n, D = base.shape
    We, off, M, Qm = token_offsets(vit)
    T = int(vit.pos_embed.shape[1])
    unk = getattr(vit, "unk_embed", None)
    res = position_residuals(base, off, Qm)
    best, pos = res.min(1)
    runner_up = res.scatter(1, pos[:, None], float("inf")).min(1).values
    bad = (best > tol).nonzero().flatten()
    if bad.numel():
        raise AttackFailure(f"{bad.numel()} of the {n} roots fit no position (best relative residual "
                            f"{float(best.max()):.1e} > {tol:g}): not the client's tokens")
    counts = torch.bincount(pos, minlength=off.shape[0])[:T]
    # one token per image at every position, but where MJP's shuffle put E_unk instead
    ok = (counts == batch) if unk is None else (counts <= batch)
    ok[0] = counts[0] == batch  # the class tokens
    if not bool(ok.all()):
        p_bad = int((~ok).nonzero()[0])
        raise AttackFailure(f"position {p_bad} holds {int(counts[p_bad])} roots where a batch of {batch} has "
                            f"{batch}: roots missing or duplicated")
    Z = torch.empty(n, D, dtype=torch.float64)
    X = torch.zeros(n, We.shape[1], dtype=torch.float64)
    for i in range(n):
        p = int(pos[i])
        if p == 0:
            Z[i] = off[0]
        else:
            mu, X[i] = patch_at(M, off[p], base[i])
            Z[i] = base[i] + mu
    return Placement(pos, best, runner_up, Z, X)


def patch_at(M: torch.Tensor, offset: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu, x [C p^2]): a token's shift and patch at the position of ``offset`` [D] (``token_offsets``),
    the least squares of z = base + mu 1 = W_e x + offset in (mu, x), ``M`` = [1, -W_e]."""
    sol = lstsq(M, (offset - base)[:, None])[:, 0]
    return sol[0], sol[1:]


def needs_gradient_placement(vit: nn.Module) -> bool:
    """Whether step 3's least squares in (mu, x) cannot tell positions apart: where 1 + C p^2 >= D
    (DeiT-S/16 at 224 px: 769 unknowns against D = 384 equations) every position fits every token.
    :func:`place_by_gradients` places them instead (B = 1)."""
    _, _, M, _ = token_offsets(vit)
    return M.shape[1] >= M.shape[0]


def place_by_gradients(vit: nn.Module, grads: Mapping[str, torch.Tensor], base: torch.Tensor,
                       h_grads: torch.Tensor, tol: float = POSITION_TOL) -> Placement:
    """Step 3 at B = 1 from the tokens' gradients, for any C p^2 (the least squares of
    :func:`place_tokens` needs 1 + C p^2 < D).

    Block 0 is h = z + attn(norm1(z)), and norm1 does not see the shift mu_t of ``base`` [n, D]
    (z_t - mu_t 1), so every token's gradient dL/dz_t = dL/dh_t + (attention's backward of
    ``h_grads`` [n, D] = dL/dh) follows from the tokens alone, in any order (attention without
    positions is permutation-equivariant). At B = 1 the position embedding's gradient holds dL/dz at
    each position, so each token's gradient matches its own position's row to the rounding floor
    (the class token row 0); on MJP the shuffled positions' rows are zero and their tokens match none
    (E_unk: position T). The patches, the shuffled ones included, are then the closed form's
    dL/dW_e = G^T X in all of them at once (n - 1 <= D). Raises AttackFailure where a token matches
    no position and the model has no E_unk, or the patches' system leaves a residual."""
    from .linear import gradient_of

    blk = cast(nn.Module, vit.blocks[0])
    g = gradient_of(vit, grads)
    n, D = base.shape
    T = int(vit.pos_embed.shape[1])
    unk = getattr(vit, "unk_embed", None)
    zb = base.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = blk.ls1(blk.attn(blk.norm1(zb)[None]))[0]
        back = torch.autograd.grad(out, zb, grad_outputs=h_grads)[0]
    Gz = (h_grads + back).detach()  # dL/dz_t per token
    rows = g(vit.pos_embed).reshape(-1, D)  # [T, D]: dL/dP, zero at MJP's shuffled positions
    res = torch.cdist(Gz, rows) / Gz.norm(dim=1, keepdim=True)
    res[:, rows.abs().amax(1) == 0] = float("inf")  # a zero row (E_unk's position) matches no token
    best, pos = res.min(1)
    runner_up = res.scatter(1, pos[:, None], float("inf")).min(1).values
    unmatched = best > tol
    if bool(unmatched.any()):
        if unk is None:
            raise AttackFailure(f"{int(unmatched.sum())} of the {n} roots match no position's gradient (best "
                                f"relative residual {float(best.max()):.1e} > {tol:g}): not the client's tokens")
        pos[unmatched] = T  # E_unk: the patch positions whose PE gradient is zero
        g_unk = g(unk).reshape(D)
        best[unmatched] = float((Gz[unmatched].sum(0) - g_unk).norm() / g_unk.norm().clamp_min(1e-300))
    counts = torch.bincount(pos, minlength=T + 1)
    if int(counts[0]) != 1 or bool((counts[1:T] > 1).any()) or int(counts[1:T].sum() + counts[T]) != T - 1:
        raise AttackFailure(f"the tokens' gradients match {int(counts[0])} class tokens, {int((counts[1:T] > 0).sum())} "
                            f"positions and {int(counts[T])} E_unk tokens of a batch of 1 with {T - 1} patches: roots "
                            "missing or duplicated")
    We, off, _, _ = token_offsets(vit)
    patch = (pos != 0).nonzero().flatten()
    dWe = g(vit.patch_embed.proj.weight).reshape(D, -1)
    Xp = lstsq(Gz[patch].T, dWe)
    fit = float((Gz[patch].T @ Xp - dWe).norm() / dWe.norm())
    if fit > tol:
        raise AttackFailure(f"the patches' system dL/dW_e = G^T X leaves a relative residual {fit:.1e} > {tol:g}")
    X = torch.zeros(n, We.shape[1], dtype=torch.float64)
    X[patch] = Xp
    Z = X @ We.T + off[pos]
    return Placement(pos, best, runner_up, Z, X)


def image_indicators(blk: nn.Module, Z: torch.Tensor, C: torch.Tensor, pos: torch.Tensor,
                     batch: int) -> torch.Tensor:
    """Step 4's indicators m [B, n] (module doc): for each class token, the tokens that share its image,
    from block 0 ``blk``'s attention on the embeddings Z [n, D] and the attention outputs C [n, D]."""
    attn = blk.attn
    n, D = Z.shape
    heads = int(attn.num_heads)
    hd = D // heads
    qkv = attn.qkv(blk.norm1(Z)).reshape(n, 3, heads, hd)
    q, k, v = attn.q_norm(qkv[:, 0]), attn.k_norm(qkv[:, 1]), qkv[:, 2]
    cls_rows = (pos == 0).nonzero().flatten()
    m = torch.zeros(batch, n, dtype=torch.float64)
    for j, t in enumerate(cls_rows.tolist()):
        logits = torch.einsum("hd,shd->hs", q[t], k) * float(attn.scale)
        wgt = torch.exp(logits - logits.max(1, keepdim=True).values)
        E = (wgt[:, :, None] * (v.transpose(0, 1) - C[t].reshape(heads, hd)[:, None, :]))
        E = E.permute(0, 2, 1).reshape(heads * hd, n)
        others = (pos != 0).nonzero().flatten()  # the class tokens' own columns are all equal
        m[j, others] = lstsq(E[:, others], -E[:, t:t + 1])[:, 0]
        m[j, t] = 1.0
    return m


def assign_images(m: torch.Tensor, pos: torch.Tensor, T: int,
                  missing: bool = False) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Step 4's assignment from the indicators ``m`` [B, n]: (each token's image [n], the smallest
    |m - 0.5| the assignment used, the patch positions no placed token holds [B, T - 1] bool: the
    shuffled ones, each taken by one E_unk token). ``missing`` (a plain client's roots read to a
    defence's noise): positions no token holds are roots the search missed, not refused."""
    batch, n = m.shape
    image = torch.empty(n, dtype=torch.long)
    image[(pos == 0).nonzero().flatten()] = torch.arange(batch)
    margin = 0.5
    for p in range(1, T):  # at most one token of a position per image
        idx = (pos == p).nonzero().flatten()
        if idx.numel() == 0:
            continue
        score = m[:, idx]  # [image, token]
        rows, cols = linear_sum_assignment(-score.numpy())
        image[idx[cols]] = torch.as_tensor(rows, dtype=torch.long)
        margin = min(margin, float((score[rows, cols] - 0.5).abs().min()))
    free = torch.ones(batch, T - 1, dtype=torch.bool)  # patch positions no placed token holds
    placed = (pos >= 1) & (pos < T)
    free[image[placed], pos[placed] - 1] = False
    idx = (pos == T).nonzero().flatten()
    if idx.numel():  # E_unk tokens: as many to each image as it has free positions
        if idx.numel() != int(free.sum()):
            raise AttackFailure(f"{idx.numel()} roots carry E_unk where the placed tokens leave "
                                f"{int(free.sum())} positions free: roots missing or duplicated")
        slots = torch.repeat_interleave(torch.arange(batch), free.sum(1))
        rows, cols = linear_sum_assignment(-m[slots][:, idx].numpy())
        image[idx[cols]] = slots[torch.as_tensor(rows, dtype=torch.long)]
        margin = min(margin, float((m[slots[rows], idx[cols]] - 0.5).abs().min()))
    elif bool(free.any()) and not missing:
        raise AttackFailure("an image lacks tokens at some positions and no root carries E_unk")
    return image, margin, free


def assemble_images(vit: nn.Module, X: torch.Tensor, pos: torch.Tensor, image: torch.Tensor,
                    free: torch.Tensor) -> torch.Tensor:
    """The model inputs [B, C, H, W]: every token's patch X [n, C p^2] at its position in its image, the
    E_unk tokens' in their image's ``free`` positions in root order."""
    T = int(vit.pos_embed.shape[1])
    batch = free.shape[0]
    C_in = vit.patch_embed.proj.weight.shape[1]
    ps = int(vit.patch_embed.patch_size[0])
    gh, gw = (int(s_) for s_ in vit.patch_embed.grid_size)
    images = torch.zeros(batch, C_in, gh * ps, gw * ps, dtype=torch.float64)
    spots = [free[b].nonzero().flatten().tolist() for b in range(batch)]  # E_unk patches, in root order
    for i in range(X.shape[0]):
        p = int(pos[i])
        if p == T:
            p = 1 + spots[int(image[i])].pop(0)
        if p:
            r_, c_ = divmod(p - 1, gw)
            images[image[i], :, r_ * ps:(r_ + 1) * ps, c_ * ps:(c_ + 1) * ps] = X[i].reshape(C_in, ps, ps)
    return images

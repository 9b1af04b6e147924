"""Step 2 of the block-0 read (:mod:`attacks.structure.block0_roots`): every token's backward
quantities and attention output from its root, linearly.

With every token's fc1 input u_t (a root) and so its activation a_t known, dL/dW_fc2 = sum_t g_t a_t^T
gives each token's output gradient g_t (B T <= 4D), and with it the gradient reaching norm2's input
up to the LayerNorm's scale 1/sigma_t, which dL/db_proj = sum_t dL/dh_t fixes (B T <= D unknowns);
then dL/dW_proj = sum_t (dL/dh_t) c_t^T gives every token's attention output c_t (B T <= D). The
roots themselves need B T <= D - 1 (:func:`attacks.structure.block0_roots.max_tokens`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, cast

import torch
import torch.nn as nn


def lstsq(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Least squares by SVD (gelsd: rank-revealing, the same answer on every LAPACK build)."""
    return torch.linalg.lstsq(A, B, driver="gelsd").solution


def gradient_of(vit: nn.Module, grads: Mapping[str, torch.Tensor]) -> Callable[[nn.Parameter], torch.Tensor]:
    """The update's gradient of a parameter of ``vit``, looked up by the parameter itself, in float64."""
    name = {id(p): n for n, p in vit.named_parameters()}
    return lambda p: grads[name[id(p)]].to(torch.float64)


def token_offsets(vit: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W_e [D, C p^2], each candidate position's offset [T (+1 with MJP's E_unk), D] with the class
    token's row cls + P_0 and every other row P_p + b_e, M [D, 1 + C p^2] the (mu, x) unknowns of
    step 3, its orthonormal basis), detached in float64."""
    D = int(vit.pos_embed.shape[-1])
    f64 = lambda t: t.detach().to(torch.float64)  # noqa: E731
    We = f64(vit.patch_embed.proj.weight).reshape(D, -1)
    be = f64(vit.patch_embed.proj.bias)
    P = f64(vit.pos_embed[0])
    unk = getattr(vit, "unk_embed", None)
    if unk is not None:  # MJP: a shuffled token's "position" is E_unk (index T here)
        P = torch.cat([P, f64(unk).reshape(1, D)])
    off = P + be
    off[0] = f64(vit.cls_token[0, 0]) + P[0]
    M = torch.cat([torch.ones(D, 1, dtype=torch.float64), -We], 1)
    return We, off, M, torch.linalg.qr(M)[0]


@dataclass(frozen=True)
class TokenEquations:
    """Step 2's per-token quantities of block 0, one row per root [n, D] (:func:`token_equations`).

    Attributes:
        roots: the fc1 inputs u_t (norm2 outputs), float64.
        normalized: (u_t - beta) / gamma = (h_t - mu_t) / sigma_t, norm2's input normalised.
        output_grads: g_t, each token's block-0 output gradient (fc2's output).
        scaled_grads: sigma_t dL/dh_t as the path through norm2 alone gives it.
        inv_sigma: [n] 1 / sigma_t, norm2's scale per token (fixed by dL/db_proj).
        h_grads: dL/dh_t, each token's gradient at norm2's input.
        outputs: c_t, each token's attention output (the proj input).
    """

    roots: torch.Tensor
    normalized: torch.Tensor
    output_grads: torch.Tensor
    scaled_grads: torch.Tensor
    inv_sigma: torch.Tensor
    h_grads: torch.Tensor
    outputs: torch.Tensor


def embeddings_less_shift(attn: nn.Module, eq: TokenEquations) -> torch.Tensor:
    """[n, D]: each token's embedding z_t less its LayerNorm shift mu_t 1 on the standard block (the
    residual around attention: z_t = sigma_t nh_t - W_proj c_t - b_proj + mu_t 1), from step 2's ``eq``."""
    return eq.normalized / eq.inv_sigma[:, None] - (eq.outputs @ attn.proj.weight.T + attn.proj.bias)


def token_equations(vit: nn.Module, grads: Mapping[str, torch.Tensor], roots: torch.Tensor) -> TokenEquations:
    """Step 2 (module doc) from all roots [n, D] (fc1 inputs) of block 0's MLP and the update.

    GELU's slope is taken by autograd on a copy of the pre-activations; nothing else records a graph."""
    blk = cast(nn.Module, vit.blocks[0])
    attn, mlp = cast(nn.Module, blk.attn), cast(nn.Module, blk.mlp)
    g = gradient_of(vit, grads)
    U = roots.to(torch.float64)
    W1, b1, W2 = mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight
    gamma, beta = blk.norm2.weight, blk.norm2.bias
    with torch.no_grad():
        pre = U @ W1.T + b1
    pre_r = pre.clone().requires_grad_(True)
    with torch.enable_grad():
        A = mlp.act(pre_r)
        dact = torch.autograd.grad(A.sum(), pre_r)[0]
    with torch.no_grad():
        A = A.detach()
        G2 = lstsq(A.T, g(mlp.fc2.weight).T)  # [n, D]: each token's block-0 output gradient
        gu = ((G2 @ W2) * dact) @ W1  # dL/du per token
        nh = (U - beta) / gamma  # (h - mu) / sigma
        gn = gu * gamma
        w = gn - gn.mean(1, keepdim=True) - nh * (gn * nh).mean(1, keepdim=True)  # sigma * dL/dh via norm2
        if U.shape[0] < U.shape[1]:  # B T <= D - 1: dL/db_proj fixes the scales
            s = lstsq(w.T, (g(attn.proj.bias) - G2.sum(0))[:, None])[:, 0]  # 1 / sigma per token
        else:  # past it dL/db_proj is short of equations: proj's weight update fixes them (scales_past_floor)
            s = 1 / scales_past_floor(vit, grads, G2, nh, w)
        Dh = G2 + s[:, None] * w  # dL/dh per token
        C = lstsq(Dh.T, g(attn.proj.weight))  # [n, D] attention outputs (proj inputs)
    return TokenEquations(U, nh, G2, w, s, Dh, C)


def scales_past_floor(vit: nn.Module, grads: Mapping[str, torch.Tensor], G2: torch.Tensor, nh: torch.Tensor,
                      w: torch.Tensor) -> torch.Tensor:
    """norm2's scale sigma_t [n] of every token where B T > D - 1, from proj's weight update, linearly.

    With h_t = sigma_t nh_t + mu_t 1 (the root) and h_t = z_t + W_proj c_t + b_proj, where z_t =
    W_e x_t + o_p (o_p: P_p + b_e, the class token's cls + P_0), dL/dW_proj W_proj^T = sum_t dL/dh_t
    (sigma_t nh_t - o_p - b_proj + M y_t)^T with M = [1, -W_e] and y_t = (mu_t, x_t). Projected on
    the right off range(M) (P) and off the T offsets' part in the rest (their span, independent:
    T <= D - C p^2 - 1), the unknown patches, shifts and positions drop out, and with dL/dh_t =
    g_t + w_t / sigma_t what is left, K P' = sum_t (sigma_t g_t + w_t) (P' nh_t)^T, is linear in the
    scales: D (D - 1 - C p^2 - T) equations in B T unknowns, with no position assigned
    (tests/test_block0_completion.py: test_the_scales_and_positions_past_the_floor_follow_linearly).
    The class tokens' offsets lie in the offsets' span too, so every token's is removed."""
    attn = cast(nn.Module, cast(nn.Module, vit.blocks[0]).attn)
    g = gradient_of(vit, grads)
    D = nh.shape[1]
    _, off, _, Qm = token_offsets(vit)
    P = torch.eye(D, dtype=torch.float64) - Qm @ Qm.T  # off range(M)
    Qe = torch.linalg.qr(((off + attn.proj.bias.to(torch.float64)) @ P).T)[0]  # the offsets' part (E_unk's too)
    Pp = P - Qe @ Qe.T
    K = g(attn.proj.weight) @ attn.proj.weight.to(torch.float64).T  # dL/dW_proj W_proj^T
    rhs = (K - w.T @ nh) @ Pp  # the w_t nh_t^T term moved over: sigma_t (1/sigma_t) = 1
    A = torch.einsum("ti,tj->ijt", G2, nh @ Pp).reshape(D * D, -1)
    return lstsq(A, rhs.reshape(-1, 1))[:, 0]


def outputs_past_floor(vit: nn.Module, eq: TokenEquations, position: torch.Tensor) -> torch.Tensor:
    """The attention outputs C [n, D] where B T > D - 1, from each token's position [n] (0: the class
    token; T: MJP's E_unk).

    dL/dW_proj = sum_t dL/dh_t c_t^T gives C only up to N F: N [n, k] the null vectors of the
    output gradients (k >= B T - D + 1), F [k, D] unknown. Every token's embedding z_t = sigma_t nh_t
    + mu_t 1 - W_proj c_t - b_proj must sit at its position: z_t - o_p in range([1, -W_e]) for a
    patch, in span(1) for a class token (z = cls + P_0: no patch). Both are linear in F (D - 1 - C p^2
    equations a patch, D - 1 a class token), solved together by least squares; what they leave free
    moves the patches too little to matter for the images (tests/test_block0_completion.py:
    test_a_b3_batch_follows_from_its_roots_in_any_order)."""
    attn = cast(nn.Module, cast(nn.Module, vit.blocks[0]).attn)
    Wp = attn.proj.weight.to(torch.float64)
    _, off, _, Qm = token_offsets(vit)
    n, D = eq.outputs.shape
    _, sv, Vh = torch.linalg.svd(eq.h_grads.T, full_matrices=True)
    N = Vh[int((sv > 1e-10 * sv[0]).sum()):].T  # [n, k]
    base = embeddings_less_shift(attn, eq)  # with F = 0
    one = torch.full((D, 1), D ** -0.5, dtype=torch.float64)
    P_patch = torch.eye(D, dtype=torch.float64) - Qm @ Qm.T
    P_cls = torch.eye(D, dtype=torch.float64) - one @ one.T
    # z_t(F) - o_p = base_t - o_p - W_proj F^T N_t^T: per token, P (base_t - o_p) = P W_proj F^T N_t
    lhs = torch.empty(n, D, N.shape[1] * D, dtype=torch.float64)
    rhs = torch.empty(n, D, dtype=torch.float64)
    for t in range(n):
        P = P_cls if int(position[t]) == 0 else P_patch
        lhs[t] = torch.einsum("k,ad->akd", N[t], P @ Wp).reshape(D, -1)
        rhs[t] = P @ (base[t] - off[int(position[t])])
    F = lstsq(lhs.reshape(n * D, -1), rhs.reshape(-1, 1)).reshape(N.shape[1], D)
    return eq.outputs + N @ F


def outputs_from_roots(attn: nn.Module, C: torch.Tensor, nh: torch.Tensor) -> torch.Tensor:
    """Design A: step 2's attention outputs C [n, D] read again through the roots themselves.

    Without the residual around attention, block 0's norm2 input is h_t = W_proj c_t + b_proj, and
    a root (fc1 input) gives h_t up to its LayerNorm's scale and shift: h_t = sigma_t nh_t + mu_t 1
    (``nh`` = (u - beta) / gamma). So c_t lies on a plane of two unknowns, W_proj^-1 (sigma_t nh_t +
    mu_t 1 - b_proj); the point of that plane nearest step 2's c_t is a second reading of it that
    rests on the root alone. Its disagreement with step 2's c is the attacker's own measure of c's
    noise, which :func:`attacks.structure.design_a.structured_tokens` is judged against
    (tests/test_block0_roots.py, test_outputs_from_roots_read_c_again_and_measure_its_noise)."""
    Wp, bp = attn.proj.weight.to(torch.float64), attn.proj.bias.to(torch.float64)
    ones = torch.ones(Wp.shape[0], 1, dtype=torch.float64)
    a = torch.linalg.solve(Wp, nh.T).T  # [n, D]: W_proj^-1 nh_t
    o = torch.linalg.solve(Wp, ones)[:, 0]
    c0 = -torch.linalg.solve(Wp, bp[:, None])[:, 0]
    out = torch.empty_like(C)
    for t in range(C.shape[0]):
        plane = torch.stack([a[t], o], 1)
        out[t] = c0 + plane @ lstsq(plane, (C[t] - c0)[:, None])[:, 0]
    return out

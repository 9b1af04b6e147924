"""Block 0's attention on one image's tokens in closed form, for the design-A attention solve
(:mod:`attacks.structure.design_a`): its output, its mixes A^h Z, their Jacobians, and the mixes
the value update gives linearly.

Every token attends to every other (one image, no mask); timm's Attention with its q/k norms.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .linear import lstsq


def attention_output(attn: nn.Module, Z: torch.Tensor) -> torch.Tensor:
    """timm Attention's proj input for tokens Z [n, D] that all attend to each other."""
    n, D = Z.shape
    heads = int(attn.num_heads)
    qkv = attn.qkv(Z).reshape(n, 3, heads, D // heads).permute(1, 2, 0, 3)
    q, k, v = attn.q_norm(qkv[0]), attn.k_norm(qkv[1]), qkv[2]
    weights = ((q * float(attn.scale)) @ k.transpose(-2, -1)).softmax(-1)
    return (weights @ v).transpose(0, 1).reshape(n, D)


def attention_jacobian(attn: nn.Module, Z: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """d Attention(Z) / d beta for Z = beta basis^T, [n D, n k], in closed form.

    Written out rather than by forward mode: a change of beta's row r moves token r's query, key and
    value only, so each column block is three outer products (values: A_tr W_v; keys: s A_tr
    (v_r - c_t) (q_t . W_k); the query: token r's own row), far cheaper than n k tangents through the
    layer (tests/test_block0_roots.py: test_the_attention_jacobian_is_forward_mode_s checks it
    against forward mode)."""
    n, D = Z.shape
    heads = int(attn.num_heads)
    d, k = D // heads, basis.shape[1]
    W = attn.qkv.weight.to(torch.float64).reshape(3, heads, d, D) @ basis  # [3, h, d, k]
    qkv = attn.qkv(Z).reshape(n, 3, heads, d).permute(1, 2, 0, 3)
    q, kk, v = qkv[0], qkv[1], qkv[2]  # [h, n, d]
    sc = float(attn.scale)
    A = ((q * sc) @ kk.transpose(-2, -1)).softmax(-1)  # [h, t, r]
    c = A @ v
    J = torch.einsum("htr,hei->theri", A, W[2])
    J += sc * torch.einsum("htr,htre,hti->theri", A, v[:, None, :, :] - c[:, :, None, :], q @ W[1])
    M = sc * (torch.einsum("hrj,hje,hjf->href", A, v, kk) - c[..., None] * (A @ kk)[:, :, None, :])
    own = torch.einsum("href,hfi->rhei", M, W[0])  # the query of token r moves its own row only
    idx = torch.arange(n)
    J[idx, :, :, idx, :] += own
    return J.reshape(n * D, n * k)


def value_mixes(attn: nn.Module, C: torch.Tensor, dC: torch.Tensor, qkv_grad: torch.Tensor,
                basis: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Design A: each head's Y^h = A^h Z (every token's attention-weighted mix of all embeddings, in
    ``basis`` coordinates [n, k]) from the update, linearly, up to a few directions.

    Head h's value weights' gradient is dL/dW_v^h = sum_s dv_s z_s^T with dv_s = sum_t A_ts dc_t, that
    is dC^h^T Y^h; and its attention outputs are C^h = Y^h W_v^h^T + b_v^h (A's rows sum to 1). With
    every token's c_t and dL/dc_t known (step 2) both are linear in Y^h: the first fixes it up to
    N_h W^T (N_h [n, n - d]: the null space of dC^h^T; W free), the second fixes W but its part that
    W_v^h on the basis does not see (M_h [k, k - d]). Returns (Y0 [h, n, k], N_h, M_h) with
    Y^h = Y0^h + N_h L_h M_h^T, L_h free [(n - d), (k - d)]: 1 x 1 on the CIFAR geometry (n = k = 65
    tokens, head width d = 64; tests/test_block0_roots.py:
    test_the_value_update_gives_each_heads_mixes_up_to_its_free_directions)."""
    n, D = C.shape
    heads = int(attn.num_heads)
    d = D // heads
    W = attn.qkv.weight.to(torch.float64)
    b = attn.qkv.bias.to(torch.float64)
    Y0, Ns, Ms = [], [], []
    for h in range(heads):
        rows = slice(2 * D + h * d, 2 * D + (h + 1) * d)
        Wb, Gb = W[rows] @ basis, qkv_grad[rows] @ basis  # [d, k]
        dCh, Ch = dC[:, h * d:(h + 1) * d], C[:, h * d:(h + 1) * d] - b[rows]  # [n, d]
        U = torch.linalg.svd(dCh, full_matrices=True)[0]
        N = U[:, min(n, d):]  # [n, n - d]: dC^h^T N = 0
        base = lstsq(dCh.T, Gb)  # [n, k]
        Vh = torch.linalg.svd(Wb, full_matrices=True)[2]
        M = Vh[min(d, Wb.shape[1]):].T  # [k, k - d]: W_v^h on the basis kills it
        if N.shape[1]:  # C^h fixes the part of N L that W_v^h sees
            base = base + N @ lstsq(Wb, (Ch - base @ Wb.T).T @ N).T
        Y0.append(base)
        Ns.append(N)
        Ms.append(M)
    return torch.stack(Y0), Ns, Ms


def mixes(attn: nn.Module, beta: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Y^h = A^h(Z) beta for Z = beta basis^T, [h, n, k] (:func:`value_mixes`)."""
    n, k = beta.shape
    heads = int(attn.num_heads)
    D = basis.shape[0]
    d = D // heads
    qkv = attn.qkv(beta @ basis.T).reshape(n, 3, heads, d).permute(1, 2, 0, 3)
    A = ((qkv[0] * float(attn.scale)) @ qkv[1].transpose(-2, -1)).softmax(-1)
    return A @ beta


def mix_jacobian(attn: nn.Module, beta: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """d Y / d beta [h n k, n k] for the mixes Y^h = A^h(Z) beta (:func:`mixes`): the closed form of
    :func:`attention_jacobian` with each token's coordinates as its value."""
    n, k = beta.shape
    heads = int(attn.num_heads)
    D = basis.shape[0]
    d = D // heads
    W = attn.qkv.weight.to(torch.float64)
    b = attn.qkv.bias.to(torch.float64)
    sc = float(attn.scale)
    eye = torch.eye(k, dtype=torch.float64)
    idx = torch.arange(n)
    Js = []
    for h in range(heads):
        Wq, Wk = W[h * d:(h + 1) * d] @ basis, W[D + h * d:D + (h + 1) * d] @ basis
        q = beta @ Wq.T + b[h * d:(h + 1) * d]
        kk = beta @ Wk.T + b[D + h * d:D + (h + 1) * d]
        A = ((q * sc) @ kk.T).softmax(-1)
        Y = A @ beta
        diff = beta[None, :, :] - Y[:, None, :]  # [t, s, k]
        J = torch.einsum("tr,ij->tirj", A, eye)
        J += sc * torch.einsum("tr,tri,tj->tirj", A, diff, q @ Wk)
        J[idx, :, idx, :] += sc * torch.einsum("rs,rsi,sj->rij", A, diff, kk @ Wq)
        Js.append(J.reshape(n * k, n * k))
    return torch.cat(Js)

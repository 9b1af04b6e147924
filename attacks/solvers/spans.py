"""What the deeper layers of a ViT tell about its input: every linear layer's weight gradient spans
that layer's inputs (dL/dW = sum_t g_t a_t^T), a constraint that needs neither the label nor the loss.

:func:`input_spans` reads the spans off one update, :class:`SpanResidual` measures how far a
candidate input's layer inputs lie from them (zero at the client's input), and :func:`forward_cost`
prices one forward. Used by :class:`attacks.optimization.mjp_adaptive.MJPAdaptive`'s ``span`` refinement and
:mod:`attacks.solvers.lm` (docs/design.md, "Attacking MJP with knowledge of MJP", step 3).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn


# ------------------------------------------------------------------------------------ deeper layers
@dataclass
class InputSpan:
    """The span of one linear layer's inputs, read off its weight gradient.

    Attributes:
        name: the layer's module name (``blocks.1.attn.qkv``, ``head``, ...).
        basis: [fan_in, r] orthonormal basis of the row space of dL/dW.
        rows: None: every token's input lies in the span; an int n: only the first n (prefix) rows.
    """

    name: str
    basis: torch.Tensor
    rows: Optional[int]


def complement(basis: torch.Tensor) -> torch.Tensor:
    """[n, n - r] orthonormal basis of the complement of the span of ``basis`` [n, r] (orthonormal)."""
    U = torch.linalg.svd(basis, full_matrices=True)[0]
    return U[:, basis.shape[1]:].contiguous()


def span_rank(G: torch.Tensor, num_tokens: int, noise_factor: float = 10.0) -> tuple[int, torch.Tensor]:
    """(r, Vh) of a weight gradient G (float64): r counts the singular values above ``noise_factor``
    times the (num_tokens+1)-th, the gradient's own noise floor (above 64 eps s_0 where G has no
    such value); Vh holds the right singular vectors. A perturbed update (quantised, noised) raises
    the floor, and the tokens whose singular values sink below it leave r < num_tokens."""
    _, sv, Vh = torch.linalg.svd(G, full_matrices=False)
    floor = float(sv[num_tokens]) if len(sv) > num_tokens else 64 * torch.finfo(G.dtype).eps * float(sv[0])
    return int((sv > noise_factor * max(floor, torch.finfo(G.dtype).tiny)).sum()), Vh


def truncated_span(G: torch.Tensor, rank: int) -> torch.Tensor:
    """[fan-in, rank] orthonormal basis of the row space of a weight gradient ``G`` truncated to ``rank``
    (its top right singular vectors): the total-least-squares span of a perturbed update, whose
    smaller singular values the perturbation lifts off zero so that :func:`span_rank` sees no gap."""
    return torch.linalg.svd(G, full_matrices=False)[2][:rank].T.contiguous()


def input_spans(vit: nn.Module, grads: dict, num_tokens: int, noise_factor: float = 10.0) -> list[InputSpan]:
    """Known input spans of the linear layers of every block and of the classifier head.

    For y = a W^T + c over the T tokens of one image, dL/dW = sum_t g_t a_t^T, so the row space of
    dL/dW is span{a_t} wherever the output gradients g_t have rank T (T <= fan-in): an exact
    constraint on the layer's inputs that needs neither the label nor the loss. The rank is read
    against the gradient's own rounding noise: dL/dW has rank <= T, so its (T+1)-th singular value
    is noise, and r counts the singular values above ``noise_factor`` times it (above 64 eps s_0
    where the matrix has no (T+1)-th). Where r = T every token is constrained. Where r < T the span
    holds only some combinations of the tokens; in the last block and the head of a class-token
    model only the class token reaches the loss (its query, the attention's keys and values), and
    its own input is in the span, so the prefix rows are constrained there; elsewhere the layer is
    left out. Block 0's qkv is left out: its input span is what the reduction already satisfies.
    """
    prefix = int(getattr(vit, "num_prefix_tokens", 1))
    last = f"blocks.{len(vit.blocks) - 1}."
    token_pool = getattr(vit, "global_pool", "token") == "token" and prefix > 0
    out = []
    for name, module in vit.named_modules():
        if not isinstance(module, nn.Linear) or name + ".weight" not in grads or name == "blocks.0.attn.qkv":
            continue
        if not (name.startswith("blocks.") or name == "head"):
            continue
        G = grads[name + ".weight"].to("cpu", torch.float64)
        if G.shape[1] <= num_tokens or float(G.abs().max()) == 0:
            continue  # fan-in <= T: the span is the whole input space (or nothing is known)
        r, Vh = span_rank(G, num_tokens, noise_factor)
        if r >= num_tokens:
            rows = None
        elif token_pool and (name.startswith(last) or name == "head") and r > 0:
            rows = prefix
        else:
            continue
        out.append(InputSpan(name, Vh[:r].T.contiguous(), rows))
    return out


class SpanResidual:
    """Distance of candidate tokens' layer inputs from the spans the update gives (float64).

    ``value(x)`` runs the attacker's copy of the model on candidate inputs x [B, C, H, W] with E_unk
    at the detected positions and returns, per candidate, the mean over layers of
    ||A_l - A_l V_l V_l^T||^2 / ||A_l||^2 (A_l the layer's inputs, V_l the basis of its span): zero at
    the client's input, and a function of the orbit the first layer cannot resolve.
    """

    def __init__(self, vit: nn.Module, spans: list[InputSpan], shuffled: torch.Tensor,
                 device: torch.device | str = "cpu") -> None:
        self.work = copy.deepcopy(vit).to(device, torch.float64).eval().requires_grad_(False)
        for blk in self.work.blocks:
            if hasattr(blk.attn, "fused_attn"):
                blk.attn.fused_attn = False
        self.spans = [InputSpan(sp.name, sp.basis.to(device), sp.rows) for sp in spans]
        self.shuffled = shuffled.to(device)
        self._inputs: dict[str, torch.Tensor] = {}
        modules = dict(self.work.named_modules())
        for span in spans:
            modules[span.name].register_forward_hook(self._keep(span.name))

    def _keep(self, name: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            self._inputs[name] = args[0]
        return hook

    def layer_inputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every span layer's inputs for candidates x [B, C, H, W]: name -> [B, T, fan_in] ([B, fan_in]
        for the head)."""
        self._inputs.clear()
        self.work(x, unk_mask=self.shuffled[None].expand(x.shape[0], -1))
        inputs, self._inputs = self._inputs, {}
        return inputs

    def per_layer(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L] relative squared residual of each candidate at each layer."""
        inputs = self.layer_inputs(x)
        out = []
        for span in self.spans:
            A = inputs[span.name]
            A = A[:, None] if A.dim() == 2 else A  # the head sees the pooled token only
            if span.rows is not None:
                A = A[:, :span.rows]
            R = A - (A @ span.basis) @ span.basis.T
            out.append(R.pow(2).sum(dim=(1, 2)) / A.pow(2).sum(dim=(1, 2)).clamp_min(1e-300))
        return torch.stack(out, dim=1)

    def value(self, x: torch.Tensor) -> torch.Tensor:
        """[B] mean over layers of :meth:`per_layer`."""
        return self.per_layer(x).mean(dim=1)


def forward_cost(vit: nn.Module, num_tokens: int) -> float:
    """Multiply-adds of one forward of ``vit`` over ``num_tokens`` tokens: its blocks' linear layers
    and attention products (the patch embedding and head are negligible)."""
    total = 0.0
    for blk in vit.blocks:
        total += sum(m.in_features * m.out_features for m in blk.modules() if isinstance(m, nn.Linear)) * num_tokens
        total += 2.0 * num_tokens ** 2 * int(vit.embed_dim)
    return total

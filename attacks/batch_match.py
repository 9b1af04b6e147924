"""``batch_match``: gradient matching over a whole batch update, in float64 with L-BFGS.

At batch size B > 1 the first layer's closed forms have nothing per image to invert: the update
sums the B images' token gradients (docs/design.md, "What survives batching"). What is left to an
honest-but-curious server is the whole update as a function of all B images together. This attack
fits B candidates jointly to it:

    min_X ||dL/dtheta(X, y) - u||^2 / ||u||^2 + tv * TV(X)

over every parameter the forward pass uses, with the client's mean cross-entropy over the batch, in
float64 with L-BFGS (strong Wolfe line search). Against ``ig_closed_start``'s signed Adam in
float32 the second-order steps keep converging where Adam stalls: on the shipped CIFAR DeiT at
B = 2 (two ImageNet-sample photographs at 32 px, labels known) 200 L-BFGS iterations reach
14.4 dB mean PSNR after assignment, 400 reach 14.7 dB (docs/attacks.md, "batch_match"), below the
15.2 dB of a flat image of the normalisation mean colour; ``tv: 1`` reaches 17.5 dB on that pair at the same cost.

- **Labels:** given (``labels: known``) or recovered as counts from the head's update
  (:func:`attacks.labels.recover_label_counts`); the recovered multiset is in ``result.labels`` and
  the method in the stats.
- **Order:** the B candidates come back in no particular order; the benchmark pairs them with the
  client's images by an optimal assignment (``benchmark.scoring.pair_reconstructions``).
- **FedAvg (``update_type: delta``, E local steps):** the client ran E plain SGD steps at the
  protocol's learning rate on the same batch (``clients.update.fedavg_update``). With ``unroll`` (the
  default) the candidates go through the same E steps, differentiably, and the simulated weight
  delta is matched to the received one (the FedAvg attack of Dimitrov et al., 2022, for a client
  that reuses its batch); without it, -delta / (lr E) is matched as one mean gradient, which is
  exact only at E = 1.
- **MJP:** the summed dL/dP is zero only where every image of the batch was shuffled, so the
  per-image masks cannot be read off a batch update; the candidates use the plain forward (noted).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedmjp.config import Float, Int, option
from fedmjp.devices import resolve_device

from .base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, Update, register_attack, update_to_gradients
from .breaching_adapter import attack_copy, matched_names
from .labels import recover_label_counts

_logger = logging.getLogger(__name__)


def tv_l2(x: torch.Tensor) -> torch.Tensor:
    """Mean squared neighbour difference of x [B, C, H, W] (smooth, for L-BFGS)."""
    return (x[..., 1:, :] - x[..., :-1, :]).pow(2).mean() + (x[..., :, 1:] - x[..., :, :-1]).pow(2).mean()


def head_names(model: nn.Module) -> tuple[Optional[str], Optional[str]]:
    """(weight name, bias name) of the classifier, or None where absent."""
    head = getattr(model, "get_classifier", lambda: None)()
    if not isinstance(head, nn.Linear):
        return None, None
    ids = {id(head.weight): "w", id(head.bias) if head.bias is not None else -1: "b"}
    found: dict[str, str] = {}
    for name, p in model.named_parameters():
        if id(p) in ids:
            found[ids[id(p)]] = name
    return found.get("w"), found.get("b")


def head_norm(model: nn.Module) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(gamma, beta) of the affine LayerNorm whose output the head reads, or (None, None).

    timm ViTs: ``fc_norm`` where it is a LayerNorm (pooled heads), else ``norm`` (token pooling:
    the final norm, then the [CLS] token). The label recovery uses its structure (zero-mean,
    unit-variance normalised features) as two more equations per image."""
    for name in ("fc_norm", "norm"):
        layer = getattr(model, name, None)
        if name == "norm" and getattr(model, "global_pool", "token") != "token":
            return None, None  # pooled after the norm: the head reads a mean of normalised tokens
        if isinstance(layer, nn.LayerNorm) and layer.weight is not None and layer.bias is not None:
            return layer.weight, layer.bias
        if layer is not None and not isinstance(layer, nn.Identity):
            return None, None  # another norm feeds the head: its structure is not this one
    return None, None


def norm_input_grad_name(model: nn.Module) -> Optional[str]:
    """The parameter whose weight gradient spans the gradients at the head's LayerNorm input, or None.

    In a token-pooled timm ViT only the [CLS] token of the last block's output reaches the head,
    and that block's MLP acts token by token: its ``fc2`` weight gradient is sum_b g_b m_b^T with
    g_b the gradient at image b's [CLS] input of the final ``norm``, so its column space is theirs."""
    if getattr(model, "global_pool", None) != "token" or not isinstance(getattr(model, "norm", None), nn.LayerNorm):
        return None
    blocks = getattr(model, "blocks", None)
    fc2 = getattr(getattr(blocks[-1], "mlp", None), "fc2", None) if blocks is not None and len(blocks) else None
    if not isinstance(fc2, nn.Linear):
        return None
    return next((name for name, p in model.named_parameters() if p is fc2.weight), None)


def batch_labels(model: nn.Module, grads: Mapping[str, torch.Tensor], meta: AttackMetadata, seed: int = 0
                 ) -> tuple[torch.Tensor, dict]:
    """The labels an attack at batch size n uses: given, else recovered counts; (labels [n], stats).

    Raises:
        AttackFailure: labels not given and the model has no linear head gradient to read them off.
    """
    if meta.labels is not None:
        return meta.labels.clone(), {"labels_source": "known"}
    wname, bname = head_names(model)
    if bname is None or bname not in grads:
        raise AttackFailure("labels are not given and the update has no classifier bias gradient to count them from")
    head = getattr(model, "get_classifier")()
    assert isinstance(head, nn.Linear)  # head_names found its bias
    weight_grad = grads[wname] if wname is not None and wname in grads else None
    gamma, beta = head_norm(model)
    pre = norm_input_grad_name(model)
    got = recover_label_counts(grads[bname], weight_grad, head.weight, head.bias, meta.num_images, seed=seed,
                               norm_weight=gamma, norm_bias=beta, norm_input_grad=grads.get(pre) if pre else None)
    return got.labels, {"labels_source": "recovered", "label_method": got.method, "label_fit": got.residual,
                        "label_notes": got.notes}


def tnorm_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of a list of tensors."""
    return torch.stack([t.pow(2).sum() for t in tensors]).sum()


def gradient_distance(work: nn.Module, chosen: list[torch.Tensor], target: list[torch.Tensor], y: torch.Tensor
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The data term of ``batch_match`` on a gradient update: x -> ||dL/dtheta(x, y) - u||^2 / ||u||^2
    over the parameters ``chosen`` of ``work`` (their target gradients ``target``), with the mean
    cross-entropy over the batch; differentiable in x (double backward). Module-level so that the
    basin measurements (bench/batch_match_basin.py) run the attack's own objective."""
    tnorm = tnorm_of(target)

    def data_term(x: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(work(x), y)
        g = torch.autograd.grad(loss, chosen, create_graph=True)
        return torch.stack([(a - b).pow(2).sum() for a, b in zip(g, target)]).sum() / tnorm

    return data_term


def simulate_delta(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
                   names: list[str]) -> list[torch.Tensor]:
    """The weight delta (after - before) of ``names`` after ``steps`` plain SGD steps at ``lr`` on the
    batch (x, y) with the mean cross-entropy, every step on the same batch as
    ``clients.update.fedavg_update`` takes them; differentiable in x (each step's gradient is taken
    with ``create_graph``). Every trainable parameter moves, as on the client; the model's own
    parameters are left untouched (``torch.func.functional_call``)."""
    from torch.func import functional_call

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: params[n] for n in names}
    for _ in range(int(steps)):
        loss = F.cross_entropy(functional_call(model, params, (x,)), y)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True, allow_unused=True)
        params = {n: p if g is None else p - lr * g for (n, p), g in zip(params.items(), grads)}
    return [params[n] - start[n] for n in names]


@register_attack("batch_match")
class BatchMatch(Attack):
    """Gradient matching of a whole batch in float64 with L-BFGS (see the module docstring).

    Args:
        iterations: L-BFGS iterations per restart (each is one double backward of the batch,
            plus line-search evaluations).
        restarts: random starts; the one with the smallest data term is returned.
        tv: weight of the squared total variation (0: none).
        init_scale: standard deviation of the random start in model-input units.
        seed: seed of the starts.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``; the benchmark passes the run's ``--device``.
        unroll: on a FedAvg delta of E > 1 local steps, simulate the E SGD steps and match the
            delta (E double backwards per evaluation); False matches the mean-gradient
            approximation.
    """

    name = "batch_match"

    class Options(AttackOptions):
        iterations: Int = option(200, ge=1)
        restarts: Int = option(1, ge=1)
        tv: Float = option(0.0, ge=0.0)
        init_scale: Float = option(0.5, gt=0.0)
        seed: Int = 0
        device: str = "cpu"
        unroll: bool = True

    def __init__(self, **options: Any) -> None:
        o = self._parse_options(options)
        self.iterations, self.restarts, self.tv = o.iterations, o.restarts, o.tv
        self.init_scale, self.seed, self.device = o.init_scale, o.seed, resolve_device(o.device)
        self.unroll = o.unroll

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        t0 = time.perf_counter()
        n = meta.num_images
        grads, notes = update_to_gradients(update, meta)
        work = attack_copy(model, torch.float64, self.device)
        names = matched_names(work, grads, meta.image_size)
        if "pos_embed" in grads and getattr(work, "unk_embed", None) is not None and n > 1:
            notes.append("MJP: per-image shuffle masks are not readable from a batch update; plain forward")
        y, label_stats = batch_labels(model, grads, meta, self.seed)
        y = y.to(self.device)
        params = dict(work.named_parameters())
        chosen = [params[nm] for nm in names]
        target = [grads[nm].to(self.device, torch.float64) for nm in names]
        tnorm = tnorm_of(target)
        if not float(tnorm) > 0:
            raise AttackFailure("the update is zero on every parameter the forward pass uses")

        steps = int(meta.local_steps) if meta.update_type == "delta" else 1
        if steps > 1 and self.unroll:
            # the received delta itself (update_to_gradients brought it to gradient units)
            lr = float(meta.lr)
            target = [t / meta.gradient_scale for t in target]
            tnorm = tnorm_of(target)
            notes[:] = [note for note in notes if not note.startswith("approximate:")]
            notes.append(f"FedAvg: {steps} local SGD steps at lr {lr:g} simulated and the delta matched")

            def data_term(x: torch.Tensor) -> torch.Tensor:
                delta = simulate_delta(work, x, y, steps, lr, names)
                return torch.stack([(a - b).pow(2).sum() for a, b in zip(delta, target)]).sum() / tnorm
        else:
            data_term = gradient_distance(work, chosen, target, y)

        gen = torch.Generator().manual_seed(self.seed)
        best_x, best_val, runs = None, float("inf"), []
        for trial in range(self.restarts):
            x = (torch.randn(n, *meta.image_size, generator=gen, dtype=torch.float64) * self.init_scale)
            x = x.to(self.device).requires_grad_(True)
            start = float(data_term(x).detach())
            opt = torch.optim.LBFGS([x], lr=1, max_iter=self.iterations, history_size=50,
                                    line_search_fn="strong_wolfe", tolerance_grad=1e-20, tolerance_change=1e-30)

            def closure() -> torch.Tensor:
                opt.zero_grad()
                val = data_term(x) + (self.tv * tv_l2(x) if self.tv > 0 else 0.0)
                val.backward()
                return val

            opt.step(closure)
            val = float(data_term(x.detach()).detach())
            runs.append({"objective_start": start, "objective": val, "iterations": int(opt.state[opt._params[0]].get("n_iter", 0))})
            if val < best_val:  # NaN never wins
                best_x, best_val = x.detach().clone(), val
        if best_x is None:
            raise AttackFailure("every restart ended with a non-finite objective")
        elapsed = time.perf_counter() - t0
        stats = dict(objective=best_val, restarts=runs, time_s=elapsed / n, attack=self.name,
                     matched_parameters=len(names), notes=notes, labels_used=[int(v) for v in y.cpu()],
                     **label_stats)
        return AttackResult(meta.denormalize(best_x), [dict(stats) for _ in range(n)], labels=y.cpu())

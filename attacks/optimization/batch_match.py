"""``batch_match``: gradient matching over a whole batch update, in float64 with L-BFGS.

At batch size B > 1 the first layer's closed forms have nothing per image to invert: the update
sums the B images' token gradients (docs/design.md, "What survives batching"). What is left to an
honest-but-curious server is the whole update as a function of all B images together. This attack
fits B candidates jointly to it:

    min_X ||dL/dtheta(X, y) - u||^2 / ||u||^2 + tv * TV(X)

over every parameter the forward pass uses, with the client's mean cross-entropy over the batch, in
float64 with L-BFGS (strong Wolfe line search). Against ``ig_closed_start``'s signed Adam in
float32 the second-order steps keep converging where Adam stalls. Without a prior the fit stays
below a flat image of the normalisation mean colour; ``tv: 1`` lifts it above at the same cost
(tests/test_batch_attacks.py::test_batch_match_tv_lifts_a_batch_of_two_above_the_mean_colour).

- **Labels:** given (``labels: known``) or recovered as counts from the head's update
  (:func:`attacks.closed_form.labels.recover_label_counts`); the recovered multiset is in ``result.labels`` and
  the method in the stats.
- **Order:** the B candidates come back in no particular order; the benchmark pairs them with the
  client's images by an optimal assignment (``benchmark.scoring.pair_reconstructions``).
- **FedAvg (``update_type: delta``, E local steps):** the client ran E plain SGD steps at the
  protocol's learning rate on the same batch (``clients.update.fedavg_update``). With ``unroll`` (the
  default) the candidates go through the same E steps, differentiably, and the simulated weight
  delta is matched to the received one (the FedAvg attack of Dimitrov et al., 2022, for a client
  that reuses its batch); without it, -delta / (lr E) is matched as one mean gradient, which is
  exact only at E = 1.
- **MJP** (``mjp_mask``, the default): a client that draws one shuffle for its whole batch (the
  default, ``per_sample: false``, as the official code does) puts E_unk at the same positions S in
  every image, so the rows of the batch's dL/dP at S are exactly zero and S is read off the update
  as at B = 1 (:func:`attacks.closed_form.mjp_update.read_mjp_update`, which also removes the client's DAL
  term). The candidates then go through the client's forward, E_unk at S in every image: they
  estimate the shuffled images x~, and the jigsaw of each is solved
  (:func:`attacks.solvers.jigsaw.unshuffle_image`) into ``result.unshuffled``, which setting (c)
  scores. A client with one shuffle per image (``per_sample: true``) leaves zero rows only where
  every image was shuffled (the intersection of the masks): then fewer rows than the model's
  training gamma implies are zero; the candidates get E_unk at that intersection only (the part of
  the client's forward the update reveals), the other shuffled positions keep their position
  embedding, no jigsaw is solved, and the notes say so. The client's forward changes setting (c)
  little at B > 1, the candidates being near the flat image either way (docs/results/batches.md);
  tests/test_batch_attacks.py::test_batch_match_with_the_read_mask_beats_the_plain_forward pins
  that it beats the plain forward.
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

from ..api.base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, Update, update_to_gradients
from ..api.progress import report
from ..api.registry import Threat, register_attack
from .breaching_adapter import attack_copy, matched_names
from ..closed_form.first_layer import unwrap_vit
from ..solvers.jigsaw import unshuffle_image
from ..closed_form.labels import recover_label_counts
from ..closed_form.mjp_update import read_mjp_update

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


def forward_kwargs(unk_mask: Optional[torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The keyword arguments of an MJP model's forward that put E_unk at ``unk_mask`` ([N] bool,
    shared by the batch) in each of the ``n`` images; {} for the plain forward (None)."""
    return {} if unk_mask is None else {"unk_mask": unk_mask.reshape(1, -1).expand(n, -1)}


def gradient_distance(work: nn.Module, chosen: list[torch.Tensor], target: list[torch.Tensor], y: torch.Tensor,
                      unk_mask: Optional[torch.Tensor] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The data term of ``batch_match`` on a gradient update: x -> ||dL/dtheta(x, y) - u||^2 / ||u||^2
    over the parameters ``chosen`` of ``work`` (their target gradients ``target``), with the mean
    cross-entropy over the batch; differentiable in x (double backward). ``unk_mask`` ([N] bool):
    the positions that get E_unk in every image (an MJP client's shared shuffle), None: the plain
    forward. Module-level so that measurements of the objective's basin run the attack's own
    objective."""
    tnorm = tnorm_of(target)

    def data_term(x: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(work(x, **forward_kwargs(unk_mask, x.shape[0])), y)
        g = torch.autograd.grad(loss, chosen, create_graph=True)
        return torch.stack([(a - b).pow(2).sum() for a, b in zip(g, target)]).sum() / tnorm

    return data_term


def simulate_delta(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
                   names: list[str], unk_mask: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """The weight delta (after - before) of ``names`` after ``steps`` plain SGD steps at ``lr`` on the
    batch (x, y) with the mean cross-entropy, every step on the same batch as
    ``clients.update.fedavg_update`` takes them; differentiable in x (each step's gradient is taken
    with ``create_graph``). Every trainable parameter moves, as on the client; the model's own
    parameters are left untouched (``torch.func.functional_call``). ``unk_mask`` as in
    :func:`gradient_distance` (an MJP client keeps its batch's shuffle over its local steps)."""
    from torch.func import functional_call

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: params[n] for n in names}
    kwargs = forward_kwargs(unk_mask, x.shape[0])
    for _ in range(int(steps)):
        loss = F.cross_entropy(functional_call(model, params, (x,), kwargs), y)
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
        mjp_mask: on an MJP model, read the shuffled positions off the zero rows of dL/dP and put
            E_unk there in every candidate's forward (False: the plain forward).
        unshuffle: with a mask read from a batch-wide shuffle, solve each candidate's jigsaw and
            return it in ``result.unshuffled`` (what setting c scores).
    """

    threat = Threat(batch="any", labels="given, or counted from the head's gradient", architecture="any ViT", precision="any (never exact: local optimisation)")

    name = "batch_match"

    class Options(AttackOptions):
        iterations: Int = option(200, ge=1)
        restarts: Int = option(1, ge=1)
        tv: Float = option(0.0, ge=0.0)
        init_scale: Float = option(0.5, gt=0.0)
        seed: Int = 0
        device: str = "cpu"
        unroll: bool = True
        mjp_mask: bool = True
        unshuffle: bool = True

    def __init__(self, **options: Any) -> None:
        o = self._parse_options(options)
        self.iterations, self.restarts, self.tv = o.iterations, o.restarts, o.tv
        self.init_scale, self.seed, self.device = o.init_scale, o.seed, resolve_device(o.device)
        self.unroll, self.mjp_mask, self.unshuffle = o.unroll, o.mjp_mask, o.unshuffle
        # its fitted batch goes into the update's estimate store (ig_closed_start starts from it at B > 1)
        self.shares_estimates = True

    def _estimate_options(self) -> dict[str, Any]:
        """The options the fitted batch depends on (not ``unshuffle``: the jigsaw comes after it)."""
        return dict(iterations=self.iterations, restarts=self.restarts, tv=self.tv, init_scale=self.init_scale,
                    seed=self.seed, device=str(self.device), unroll=self.unroll, mjp_mask=self.mjp_mask)

    def _read_mask(self, model: nn.Module, grads: Mapping[str, torch.Tensor], n: int, notes: list[str]
                   ) -> tuple[Optional[torch.Tensor], Mapping[str, torch.Tensor], bool, dict]:
        """(E_unk positions [N] bool or None for the plain forward, gradients with any DAL term
        removed, whether the mask is a whole-batch shuffle whose jigsaw can be solved, stats).

        The zero rows of the batch's dL/dP are the positions shuffled in every image: the whole
        shuffle of a client that draws one for its batch, the intersection of the per-image masks
        of one that draws one per image. Fewer zero rows than half the model's training gamma
        implies are taken for the latter (or a client at a smaller gamma): E_unk still goes where
        the update proves it was, but no jigsaw is solved."""
        vit = unwrap_vit(model)
        if not self.mjp_mask:
            notes.append("MJP: mjp_mask off; plain forward")
            return None, grads, False, {}
        S, grads, stats = read_mjp_update(vit, grads)
        found = int(S.sum())
        expected = int(S.numel() * float(getattr(vit, "gamma", 0.0) or 0.0))
        stats = {"shuffled_count": found, "shuffled_expected": expected, **stats}
        if found == 0:
            notes.append("MJP: no zero row in dL/dP (no shuffle, or per-image shuffles with no position "
                         "shuffled in every image); plain forward")
            return None, grads, False, stats
        shared = n == 1 or 2 * found >= expected
        if shared:
            notes.append(f"MJP: shuffled positions read off the zero rows of dL/dP (|S| = {found}); "
                         f"E_unk there in every image")
        else:
            notes.append(f"MJP: only {found} zero rows of dL/dP where the model's gamma implies about {expected}: "
                         "per-image shuffles (per_sample) leave zero rows only where every image was shuffled "
                         "(their intersection); E_unk there, the other shuffled positions are not readable "
                         "and keep their position embedding; no jigsaw solved")
        return S, grads, shared, stats

    def _fit(self, model: nn.Module, update: Update, meta: AttackMetadata
             ) -> tuple[torch.Tensor, dict, list[str], torch.Tensor, Optional[torch.Tensor], bool]:
        """(the fitted batch [n, C, H, W] in model-input units on the CPU, stats, notes, labels used,
        the E_unk mask or None, whether it is a whole-batch shuffle)."""
        t0 = time.process_time()
        n = meta.num_images
        grads, notes = update_to_gradients(update, meta)
        work = attack_copy(model, torch.float64, self.device)
        mask, shared, mjp_stats = None, False, {}
        if "pos_embed" in grads and getattr(unwrap_vit(work), "unk_embed", None) is not None:
            mask, grads, shared, mjp_stats = self._read_mask(model, grads, n, notes)
        names = matched_names(work, grads, meta.image_size)
        if mask is not None and "unk_embed" in grads and "unk_embed" not in names:
            names.insert(0, "unk_embed")  # used by the masked forward, not by the plain one
        dev_mask = None if mask is None else mask.to(self.device)
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
                delta = simulate_delta(work, x, y, steps, lr, names, dev_mask)
                return torch.stack([(a - b).pow(2).sum() for a, b in zip(delta, target)]).sum() / tnorm
        else:
            data_term = gradient_distance(work, chosen, target, y, dev_mask)

        gen = torch.Generator().manual_seed(self.seed)
        best_x, best_val, runs = None, float("inf"), []
        for trial in range(self.restarts):
            x = (torch.randn(n, *meta.image_size, generator=gen, dtype=torch.float64) * self.init_scale)
            x = x.to(self.device).requires_grad_(True)
            start = float(data_term(x).detach())
            opt = torch.optim.LBFGS([x], lr=1, max_iter=self.iterations, history_size=50,
                                    line_search_fn="strong_wolfe", tolerance_grad=1e-20, tolerance_change=1e-30)

            def closure() -> torch.Tensor:
                report(self.name, opt.state[x].get("n_iter", 0), self.iterations,
                       f"L-BFGS, restart {trial + 1} of {self.restarts}")
                opt.zero_grad()
                val = data_term(x) + (self.tv * tv_l2(x) if self.tv > 0 else 0.0)
                val.backward()
                return val

            opt.step(closure)
            val = float(data_term(x.detach()).detach())
            runs.append({"objective_start": start, "objective": val, "iterations": int(opt.state[opt.param_groups[0]["params"][0]].get("n_iter", 0))})
            if val < best_val:  # NaN never wins
                best_x, best_val = x.detach().clone(), val
        if best_x is None:
            raise AttackFailure("every restart ended with a non-finite objective")
        stats = dict(objective=best_val, restarts=runs, matched_parameters=len(names),
                     labels_used=[int(v) for v in y.cpu()], estimate_cpu_s=time.process_time() - t0,
                     **label_stats, **mjp_stats)
        return best_x.cpu(), stats, notes, y.cpu(), mask, shared

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        t0 = time.perf_counter()
        n = meta.num_images
        store, key = meta.estimates, self._estimate_options()
        cached = store.get(self.name, key) if store is not None else None  # a copy
        if cached is not None:
            best_x, fit_stats, notes, y, mask, shared = cached
            notes.append("fitted batch reused: computed before for the same model, update and options")
        else:
            best_x, fit_stats, notes, y, mask, shared = self._fit(model, update, meta)
            if store is not None:
                store.put(self.name, key, (best_x, fit_stats, notes, y, mask, shared))  # kept as a copy
        images = meta.denormalize(best_x)
        unshuffled, jigsaw = None, [{} for _ in range(n)]
        if mask is not None and shared and self.unshuffle:
            p = int(unwrap_vit(model).patch_embed.patch_size[0])
            solved = [unshuffle_image(images[i:i + 1].cpu(), mask, p) for i in range(n)]
            unshuffled = torch.cat([u for u, _ in solved]).float()
            jigsaw = [dict(jigsaw_cost=info["cost_final"], jigsaw_swaps=info["swaps"]) for _, info in solved]
        elapsed = time.perf_counter() - t0
        stats = dict(fit_stats, time_s=elapsed / n, attack=self.name, notes=notes)
        return AttackResult(images, [dict(stats, **jigsaw[i]) for i in range(n)], labels=y, unshuffled=unshuffled)

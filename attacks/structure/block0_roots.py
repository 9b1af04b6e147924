"""``block0_roots``: a batch read off block 0 exactly, through its MLP's per-token roots.

On a ViT whose block 0 is the standard pre-norm block (``norm1`` and a residual around attention,
the model as trained; not APRIL's design A), a FedSGD update of B images with B T <= D - 1 tokens
(T per image, D the width: B <= 2 on the CIFAR geometry, T = 65, D = 192; :func:`max_tokens`)
determines the batch.
No closed form of the first layer sees it (docs/design.md, "What survives batching"); block 0's MLP
and attention projection do, in four steps, each in its own module:

1. **Roots** (:mod:`attacks.structure.roots`). Every token's fc1 input u = norm2(h) is a root of a
   small problem of its own (:mod:`attacks.structure.token_roots`); the search (:func:`find_roots`)
   steers its starts into the part of fc2's span the found tokens leave empty while that pays, then
   adds equations only the tokens not yet found satisfy.
2. **Per-token backward quantities, linear** (:mod:`attacks.structure.linear`): each token's output
   gradient, its LayerNorm scale and its attention output c_t, from fc2's, proj's bias and proj's
   weight updates in turn.
3. **Tokens, positions and patches** (:mod:`attacks.structure.placement`): h_t = sigma_t n_t + mu_t
   and h_t = z_t + W_proj c_t + b_proj give z_t = W_e x_t + b_e + P_p up to mu_t; least squares in
   (mu_t, x_t) per position leaves a residual at the rounding floor at the token's own position only.
4. **Which image** (:mod:`attacks.structure.placement`): a token's attention output is its image's
   values averaged by its softmax weights, linear in the indicators of the tokens that share its
   image; solved for each class token and assigned per position.

Every step after the roots is linear algebra in float64, to the rounding floor
(tests/test_block0_roots.py: test_the_batch_follows_exactly_from_the_true_roots_in_any_order; from
scratch at B = 2: test_a_b2_update_of_the_model_as_trained_is_read_from_scratch). Labels are not needed
(the labels row is the update's own, as ``batch_match`` reads it). On MJP (E_unk in place of the
position embedding at the shuffled positions), E_unk is one more candidate in step 3: the tokens that
fit it give each image's shuffled set and its patches exactly, and the update does not fix their order
(attention without a position embedding does not see it): ``images`` places them in the free positions
in root order, ``unshuffled`` is the jigsaw solver's arrangement (setting c, :mod:`attacks.solvers.jigsaw`).

**Past B T = D - 1** (B = 3 on the CIFAR geometry; :func:`max_tokens`) no layer's span holds a
token: fc2's is completed first (:mod:`attacks.structure.completion`) and fc1's is the whole input
space, so step 1 finds the roots again; in step 2 proj's weight update gives the scales
(:func:`attacks.structure.linear.scales_past_floor`) and, from every token's position equation, the
attention outputs but for a small part all tokens share
(:func:`attacks.structure.linear.outputs_past_floor`); steps 3 and 4 hold as they are, and leave the
images close, not at the rounding floor, and on MJP some tokens in the wrong image; the membership
is repaired on the roots (:func:`attacks.structure.polish.refit_membership`), and with every
token's image and position known each image's patches are then refit to its own roots (:func:`attacks.structure.polish.root_polish`), which takes
them to the rounding floor (tests/test_block0_completion.py). Refused past the completion's memory
bound (:func:`max_completed`: B >= 4 on the CIFAR geometry).

**Design A** (APRIL's block 0: no norm1, no residual around attention) at B = 1: steps 1 and 2 hold as
they are, the embeddings then come from the attention solve, or where c is too noisy for it, from the
position-structured solve (:mod:`attacks.structure.design_a`), whose answer is polished on every
layer's input span (:mod:`attacks.structure.polish`); step 3 then places them and checks every token.
Refused, with the reason: design A at B > 1 (the solve needs each token's image), B T past the
completion's bound, a FedAvg delta of several local steps.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any, Mapping, cast

import torch
import torch.nn as nn

from fedmjp.config import Int, option

from ..api.base import Attack, AttackFailure, AttackMetadata, AttackOptions, AttackResult, Update, update_to_gradients
from ..api.progress import report
from ..api.registry import Threat, register_attack
from ..closed_form.first_layer import is_design_a, unwrap_vit
from ..optimization.batch_match import batch_labels
from ..solvers.jigsaw import unshuffle_image
from ..solvers.spans import input_spans, span_rank
from .design_a import DESIGN_A_MAX_UNKNOWNS, STRUCTURED_ROUNDS, design_a_embeddings
from .completion import (COMPLETED_TOL, COMPLETION_MEMORY, POINTS_PER_DIMENSION, complete_span, completion_bytes,
                         least_points, near_roots)
from .linear import embeddings_less_shift, outputs_past_floor, token_equations
from .placement import (DESIGN_A_POSITION_TOL, POSITION_TOL, assemble_images, assign_images, image_indicators,
                        needs_gradient_placement, place_by_gradients, place_tokens, position_residuals,
                        token_offsets)
from .polish import (ROOT_POLISH_FIT, ROOT_POLISH_JACOBIANS, SPAN_POLISH_JACOBIANS, RootPolish, SpanPolish,
                     refit_membership, root_polish, span_polish)
from .noisy import NOISY_TOL, read_defended_update
from .roots import RootSearch, find_roots
from .token_roots import MLPSpans
from .warm import closed_form_tokens, warm_roots


@dataclass
class BatchFromRoots:
    """Outcome of :func:`batch_from_roots`.

    Attributes:
        images: [B, C, H, W] model inputs.
        position: [B T] each root's position (0: the class token).
        image: [B T] each root's image.
        position_residual: [B T] relative residual of each root at its position.
        runner_up: [B T] its smallest residual at any other position.
        membership_margin: the smallest |m - 0.5| of the indicators the assignment used.
        shuffled: [B, T - 1] bool, the patch positions whose token carried MJP's E_unk (position T
            in ``position``): their patches are placed in them in an order the update does not fix.
        attention_residual: design A only: the squared relative residual the attention solve
            (:func:`attacks.structure.design_a.attention_tokens`, or
            :func:`attacks.structure.design_a.structured_tokens` where its starts failed) ended at
            (None on the standard block).
        attention_floor: design A, where the structured solve ran: the noise in c it was held to
            (:func:`attacks.structure.linear.outputs_from_roots`); None elsewhere.
        structured_rounds: design A: the structured solve's rounds (0: the free solve's start kept).
        root_polish: past B T = D - 1, the refit of every image's patches to its roots (None elsewhere).
        membership_repairs: past B T = D - 1, the changes the membership repair made to step 4's
            assignment (:func:`attacks.structure.polish.refit_membership`).
    """

    images: torch.Tensor
    position: torch.Tensor
    image: torch.Tensor
    position_residual: torch.Tensor
    runner_up: torch.Tensor
    membership_margin: float
    shuffled: torch.Tensor
    attention_residual: float | None = None
    attention_floor: float | None = None
    structured_rounds: int = 0
    root_polish: RootPolish | None = None
    membership_repairs: int = 0


def batch_from_roots(vit: nn.Module, grads: Mapping[str, torch.Tensor], roots: torch.Tensor, batch: int,
                     attention_iterations: int = 40, attention_starts: int = 2,
                     generator: torch.Generator | None = None,
                     structured_rounds: int = STRUCTURED_ROUNDS,
                     polish_jacobians: int = ROOT_POLISH_JACOBIANS) -> BatchFromRoots:
    """The batch, from all B T roots (fc1 inputs) of block 0's MLP and the update (module doc, steps 2-4).

    On design A (B = 1) the tokens' embeddings come from the attention solve
    (:func:`attacks.structure.design_a.design_a_embeddings`: ``attention_iterations``,
    ``attention_starts``, ``generator`` and ``structured_rounds``) instead of the residual around attention.
    Past B T = D - 1 the membership is repaired on the roots
    (:func:`attacks.structure.polish.refit_membership`) and every image's patches are then refit to its own roots
    (:func:`attacks.structure.polish.root_polish`, at most ``polish_jacobians`` Jacobians per image; 0: off).

    Raises:
        AttackFailure: the attention solve fails (design A), a token fits no position, a position
            gets a wrong number of tokens, the class tokens are not B, or past B T = D - 1 the
            images do not refit their roots (:data:`attacks.structure.polish.ROOT_POLISH_FIT`).
    """
    blk = cast(nn.Module, vit.blocks[0])
    attn = cast(nn.Module, blk.attn)
    eq = token_equations(vit, grads, roots)
    with torch.no_grad():
        design_a = is_design_a(blk)
        emb = None
        if design_a:  # no residual around attention: the embeddings from the attention solve
            emb = design_a_embeddings(vit, grads, eq, batch, attention_iterations, attention_starts, generator,
                                      structured_rounds)
            base = emb.tokens
        else:
            base = embeddings_less_shift(attn, eq)
            if roots.shape[0] > max_tokens(int(roots.shape[1])):  # past the floor: C up to N F (outputs_past_floor)
                _, off, _, Qm = token_offsets(vit)
                eq = replace(eq, outputs=outputs_past_floor(vit, eq, position_residuals(base, off, Qm).argmin(1)))
                base = embeddings_less_shift(attn, eq)
        if not design_a and batch == 1 and needs_gradient_placement(vit):  # 1 + C p^2 >= D: 224 px, patch 16
            placed = place_by_gradients(vit, grads, base, eq.h_grads)
        else:
            placed = place_tokens(vit, base, batch, DESIGN_A_POSITION_TOL if design_a else POSITION_TOL)
        m = image_indicators(blk, placed.tokens, eq.outputs, placed.position, batch)
        image, margin, free = assign_images(m, placed.position, int(vit.pos_embed.shape[1]))
        patches, polish, repaired = placed.patches, None, 0
        if not design_a and polish_jacobians and roots.shape[0] > max_tokens(int(roots.shape[1])):
            image, repaired = refit_membership(vit, roots, placed.position, image, patches)
            if repaired:  # the shuffled positions follow the repaired membership
                T = int(vit.pos_embed.shape[1])
                held = (placed.position >= 1) & (placed.position < T)
                free = torch.ones_like(free)
                free[image[held], placed.position[held] - 1] = False
            polish = root_polish(vit, roots, placed.position, image, patches, polish_jacobians)
            patches = polish.patches
            if polish.relative > ROOT_POLISH_FIT:
                raise AttackFailure(f"past B T = D - 1 the images do not refit their roots (relative squared "
                                    f"residual {polish.relative:.1e} > {ROOT_POLISH_FIT:g}): the membership solve "
                                    f"(smallest margin {margin:.2f}) put tokens in the wrong images")
        images = assemble_images(vit, patches, placed.position, image, free)
    return BatchFromRoots(images, placed.position, image, placed.residual, placed.runner_up, margin, free,
                          None if emb is None else emb.residual, None if emb is None else emb.floor,
                          0 if emb is None else emb.structured_rounds, polish, repaired)


def delta_refusal(steps: int, batch: int, tokens: int | None) -> str:
    """Why a FedAvg delta of ``steps`` local steps on one batch is not read (docs/design.md, "Several
    local steps"): every step sends its own tokens through block 0's MLP, so fc2's update holds
    E B T of them; the patch embedding's input alone is the same at every step."""
    held = f"E B T = {steps * batch * tokens} tokens" if tokens else "E B T tokens"
    where = ("pe_closed_form reads one image's delta exactly (the patch embedding sees the same patches at every "
             "step)" if batch == 1 else "batch_match's unroll simulates the steps")
    return (f"block0_roots reads one gradient; a FedAvg delta of {steps} local steps holds every step's tokens in "
            f"block 0's MLP updates ({held}, each step's own fc1 inputs), not the first step's alone; {where}")


def max_tokens(width: int) -> int:
    """The most tokens B T whose inputs block 0's per-token span test still sees: D - 1.

    A weight gradient sum_t g_t a_t^T has rank at most min(fan-in, fan-out); fc2 and proj write the
    residual stream, whose gradients on a pre-norm ViT reach it through LayerNorms alone (the next
    block's norms, the final norm) and so are orthogonal to the ones vector: rank <= D - 1. With more
    tokens the row space is a proper subspace of span{a_t} and a true token's input lies off it
    (tests/test_block0_roots.py: test_past_d_minus_1_tokens_no_true_token_is_in_fc2s_span)."""
    return width - 1


def max_completed(width: int) -> int:
    """The most dimensions k past :func:`max_tokens` whose completion fits in :data:`COMPLETION_MEMORY`."""
    k = 0
    while completion_bytes(k + 1, width) <= COMPLETION_MEMORY:
        k += 1
    return k


def check_model(vit: nn.Module, grads: Mapping[str, torch.Tensor], batch: int) -> None:
    """Raise AttackFailure naming the first condition the model or update does not meet."""
    blocks = getattr(vit, "blocks", None)
    if blocks is None or len(blocks) == 0 or not hasattr(getattr(blocks[0], "attn", None), "proj"):
        raise AttackFailure("block0_roots needs a timm-style ViT (blocks[0].attn.proj, blocks[0].mlp)")
    blk = blocks[0]
    if is_design_a(blk):
        if batch != 1:
            raise AttackFailure(f"block0_roots reads APRIL's design-A block 0 at B = 1 only (its attention solve "
                                f"needs each token's image); got B = {batch}")
    elif not isinstance(getattr(blk, "norm1", None), nn.LayerNorm):
        raise AttackFailure("block0_roots needs a standard pre-norm block 0 (norm1 and the residual around "
                            "attention) or APRIL's design A")
    if not isinstance(getattr(blk, "norm2", None), nn.LayerNorm) or blk.norm2.weight is None:
        raise AttackFailure("block0_roots needs block 0's norm2 to be a LayerNorm with its affine weights")
    if int(getattr(vit, "num_prefix_tokens", 0)) != 1 or getattr(vit, "cls_token", None) is None \
            or getattr(vit, "pos_embed", None) is None:
        raise AttackFailure("block0_roots needs one class token and a learned position embedding "
                            "(the class tokens say which image each token belongs to)")
    D = int(vit.embed_dim)
    T = int(vit.pos_embed.shape[1])
    hidden = int(blk.mlp.fc1.out_features)
    if batch * T >= hidden:
        raise AttackFailure(f"B T = {batch} images x {T} tokens = {batch * T} >= {hidden}, fc2's input width: the "
                            "tokens' fc2 inputs fill that whole space, so even fc2's completed span separates no "
                            f"token and no read of block 0's MLP can start (B <= {(hidden - 1) // T} on this model; "
                            "docs/design.md, \"What survives batching\")")
    if batch * T > max_tokens(D):
        if is_design_a(blk):
            raise AttackFailure(f"block0_roots reads design A within B T <= D - 1 only; got {batch * T} tokens")
        k = batch * T - max_tokens(D)
        need = completion_bytes(k, D)
        if need > COMPLETION_MEMORY:
            raise AttackFailure(f"past B T = D - 1 ({batch} images x {T} tokens = {batch * T} > {max_tokens(D)}, "
                                f"width {D}) block0_roots completes fc2's span by k = {k} dimensions, whose fit "
                                f"takes {need / 1e9:.1f} GB > {COMPLETION_MEMORY / 1e9:.1f} GB "
                                f"(attacks/structure/completion.py); B <= {(max_tokens(D) + max_completed(D)) // T} "
                                f"on this model. The fit would also need at least "
                                f"{least_points(k, 4 * D, max_tokens(D), D)} near-roots at true tokens, more than "
                                "have a near-root there at all (docs/results/structure.md, \"At B = 4\")")
    if is_design_a(blk) and T * T > DESIGN_A_MAX_UNKNOWNS:
        raise AttackFailure(f"block0_roots reads design A through a dense solve in T^2 = {T * T} unknowns "
                            f"({T} tokens); it takes at most {DESIGN_A_MAX_UNKNOWNS} (T <= "
                            f"{int(DESIGN_A_MAX_UNKNOWNS ** 0.5)}: its Jacobian grows as 3 T^4 doubles, "
                            f"{3 * T ** 4 * 8 / 1e9:.1f} GB here against {3 * DESIGN_A_MAX_UNKNOWNS ** 2 * 8 / 1e9:.1f} GB "
                            "at the bound)")
    if blk.attn.qkv.bias is None or blk.mlp.fc1.bias is None or blk.attn.proj.bias is None:
        raise AttackFailure("block0_roots needs biases on block 0's qkv, proj and fc1 (dL/db_proj fixes the "
                            "LayerNorm scales)")


def _runs(modes: list[str]) -> str:
    """"steered x 8, missing x 3" for a list of round kinds."""
    return ", ".join(f"{m} x {len(list(g))}" for m, g in groupby(modes))


def _design_a_stats(out: BatchFromRoots, polish: SpanPolish | None,
                    polish_failed: str | None) -> tuple[dict[str, Any], list[str]]:
    """The design-A rows of the attack's stats and notes (none on the standard block)."""
    stats: dict[str, Any] = {}
    notes: list[str] = []
    if out.attention_residual is not None:
        stats["attention_residual"] = out.attention_residual
        stats["structured_rounds"] = out.structured_rounds
    if out.attention_floor is not None:
        stats["attention_floor"] = out.attention_floor
        notes.append(f"design A: no start of the attention solve reached the truth; the position-structured "
                     f"solve placed every token in {out.structured_rounds} rounds, c to "
                     f"{out.attention_residual:.1e} against step 2's noise {out.attention_floor:.1e}")
    if polish_failed is not None:
        notes.append(f"design A: the span polish failed ({polish_failed}); the structured solve's answer is kept")
    if polish is not None:
        stats.update(span_residual_before=polish.residual_before, span_residual=polish.residual_after,
                     span_polish_jacobians=polish.jacobians)
        notes.append(f"design A: the structured answer polished on every layer's input span (Levenberg-Marquardt, "
                     f"{polish.jacobians} Jacobians): span residual {polish.residual_before:.1e} -> "
                     f"{polish.residual_after:.1e}")
    return stats, notes


@register_attack("block0_roots")
class Block0Roots(Attack):
    """The batch read off block 0 of a standard pre-norm ViT (module doc).

    Args:
        starts: root-finding starts per round.
        rounds: rounds at most (stops when every token's root is found).
        iterations: Levenberg-Marquardt iterations per start.
        attention_iterations, attention_starts: design A (B = 1): the attention solve's
            Levenberg-Marquardt iterations per random start, and its starts.
        structured_rounds: design A: rounds of the position-structured solve where no start of the
            attention solve reaches the truth (0: fail instead; :func:`attacks.structure.design_a.structured_tokens`).
        span_polish: design A: Levenberg-Marquardt Jacobians of the span polish of the structured
            solve's answer (0: off; :func:`attacks.structure.polish.span_polish`).
        warm_start: at B = 1, start the search from the roots the patch-embedding closed form's read
            leads to (:mod:`attacks.structure.warm`); False: random and steered starts alone.
        noise_aware: where the metadata names a defence that perturbs the update (quantisation,
            pruning, local DP, DP-SGD), read it to the defence's noise (:mod:`attacks.structure.noisy`:
            B T <= D - 1 on the standard block, B = 1 on an MJP client); False: the exact read, which
            refuses a perturbed update.
        seed: seed of the starts.
    """

    threat = Threat(batch="B T <= width - 1 exactly (B <= 2 on the CIFAR models, B = 1 at 224 px); B = 3 on the CIFAR models too, through fc2's completed span and the root polish; one local step", labels="not needed (read off the head)", architecture="standard pre-norm block 0 (the model as trained); design A at B = 1, T <= 100", precision="float64 clients for an exact copy; under a defence named in the metadata (B = 1; plain clients to B T <= width - 1), to the defence's noise")

    name = "block0_roots"

    class Options(AttackOptions):
        starts: Int = option(32, ge=1, le=4096)
        rounds: Int = option(40, ge=1, le=1000)
        iterations: Int = option(60, ge=1, le=10_000)
        attention_iterations: Int = option(40, ge=1, le=1000)
        attention_starts: Int = option(2, ge=1, le=64)
        structured_rounds: Int = option(STRUCTURED_ROUNDS, ge=0, le=50)
        span_polish: Int = option(SPAN_POLISH_JACOBIANS, ge=0, le=100)
        warm_start: bool = True
        noise_aware: bool = True
        seed: Int = 0

    def __init__(self, **options: Any) -> None:
        o = self._parse_options(options)
        self.starts, self.rounds = o.starts, o.rounds
        self.iterations, self.seed = o.iterations, o.seed
        self.attention_iterations, self.attention_starts = o.attention_iterations, o.attention_starts
        self.structured_rounds = o.structured_rounds
        self.span_polish = o.span_polish
        self.warm_start = o.warm_start
        self.noise_aware = o.noise_aware

    def _search(self, work: nn.Module, grads: Mapping[str, torch.Tensor], B: int,
                gen: torch.Generator) -> RootSearch:
        """Step 1 on the float64 copy ``work``: all B T roots, or AttackFailure saying why not."""
        T = int(work.pos_embed.shape[1])
        D = int(work.embed_dim)
        fc1, fc2 = "blocks.0.mlp.fc1", "blocks.0.mlp.fc2"
        if B * T > max_tokens(D):
            spans = self._completed(work, grads, B * T, gen)
        else:
            spans = {sp.name: sp.basis for sp in input_spans(work, grads, B * T)}
        if fc1 not in spans or fc2 not in spans or spans[fc1].shape[1] != min(B * T, D) \
                or spans[fc2].shape[1] != B * T:
            got = {k: (spans[k].shape[1] if k in spans
                       else span_rank(grads[k + ".weight"].to("cpu", torch.float64), B * T)[0]
                       if k + ".weight" in grads else 0) for k in (fc1, fc2)}
            raise AttackFailure(f"block 0's fc1/fc2 updates do not have rank B T = {B * T} (numerical ranks "
                                f"{got}): tokens coincide, the update is not one plain gradient, or it is "
                                "perturbed (quantised, e.g. by SecAgg+, clipped or noised) so that its smaller "
                                "singular values sink into the perturbation's floor")
        found = None
        if self.warm_start and B == 1:  # the roots the closed form's read leads to (attacks.structure.warm)
            near = closed_form_tokens(work, grads)
            if near is not None:
                report(self.name, 0, self.rounds, "warm roots from the closed form's read")
                found = warm_roots(MLPSpans(work.blocks[0], spans[fc1], spans[fc2]), spans[fc1], near,
                                   self.iterations)
        search = find_roots(work.blocks[0], spans[fc1], spans[fc2], grads[fc1 + ".weight"].to(torch.float64),
                            grads[fc2 + ".weight"].to(torch.float64), B * T, self.starts, self.rounds,
                            self.iterations, gen, found=found)
        if search.roots.shape[0] != B * T:
            raise AttackFailure(f"found {search.roots.shape[0]} of the {B * T} roots of block 0's MLP after "
                                f"{len(search.per_round)} rounds of {self.starts} starts (new per round: "
                                f"{search.per_round}, the rounds {_runs(search.modes)}); the batch is read off "
                                "all of them (raise rounds or starts)")
        return search

    def _completed(self, work: nn.Module, grads: Mapping[str, torch.Tensor], tokens: int,
                   gen: torch.Generator) -> dict[str, torch.Tensor]:
        """Past B T = D - 1: fc1's span the whole input space, fc2's completed from near-roots
        (:mod:`attacks.structure.completion`); AttackFailure where the update is perturbed or too
        few near-roots are found."""
        D = int(work.embed_dim)
        G2 = grads["blocks.0.mlp.fc2.weight"].to("cpu", torch.float64)
        r, Vh = span_rank(G2, tokens)
        if r != max_tokens(D):
            raise AttackFailure(f"block 0's fc2 update has numerical rank {r} where an unperturbed one past "
                                f"B T = D - 1 has {max_tokens(D)}: it is perturbed (quantised, clipped or noised)")
        full = torch.eye(D, dtype=torch.float64)
        fc2_part = Vh[:r].T.contiguous()
        report(self.name, 0, self.rounds, f"completing fc2's span by {tokens - r} dimensions")
        points = near_roots(MLPSpans(work.blocks[0], full, fc2_part), POINTS_PER_DIMENSION * (tokens - r),
                            2 * self.starts, self.iterations, gen)
        done = complete_span(work.blocks[0], fc2_part, tokens, points)
        if done.next_singular > COMPLETED_TOL:
            raise AttackFailure(f"fc2's span did not complete: the fit of {points.shape[0]} near-roots ended with "
                                f"a (k+1)-th singular value of {done.next_singular:.1e} > {COMPLETED_TOL:g} "
                                f"({done.dropped} points dropped as off the true tokens; raise starts)")
        return {"blocks.0.mlp.fc1": full, "blocks.0.mlp.fc2": done.basis}

    def _polish(self, work: nn.Module, grads: Mapping[str, torch.Tensor],
                out: BatchFromRoots) -> tuple[SpanPolish | None, str | None]:
        """Design A, the structured solve's answer: the span polish, which replaces ``out.images``;
        (the polish or None, why it failed or None). Where it fails the structured answer is kept."""
        if out.attention_floor is None or not self.span_polish:
            return None, None
        try:
            polish = span_polish(work, grads, out.images, out.shuffled[0], self.span_polish)
        except (AttackFailure, RuntimeError, ValueError) as e:  # keep the structured answer, say why
            return None, str(e)
        out.images = polish.image
        return polish, None

    def _defended(self, model: nn.Module, work: nn.Module, grads: Mapping[str, torch.Tensor], meta: AttackMetadata,
                  notes: list[str], gen: torch.Generator, t0: float, c0: float) -> AttackResult:
        """The read of an update under a known perturbing defence (:mod:`attacks.structure.noisy`)."""
        assert meta.defence is not None
        T = int(work.pos_embed.shape[1])
        out = read_defended_update(work, grads, meta, self.starts, self.rounds, self.iterations, gen,
                                   self.warm_start)
        search, read, roots = out.search, out.read, out.roots
        notes.extend(out.notes)
        y, label_stats = batch_labels(model, grads, meta, self.seed)
        images = meta.denormalize(read.images)
        n = meta.num_images * T
        notes.append(f"defended update ({meta.defence.label}): {roots.shape[0]} of block 0's {n} MLP roots found "
                     f"to the noise (spans truncated to rank {n}, squared residual < {NOISY_TOL:g}; {search.given} "
                     f"from the closed form's read, {search.roots.shape[0] - search.given} in {search.starts} starts, "
                     f"{roots.shape[0] - search.roots.shape[0]} from the image prior's); {out.placed} patches placed "
                     "by their best fit" + (", each root's image by the attention indicators and the "
                                            "root residuals" if meta.num_images > 1 else "") + ", then refit to their roots")
        if out.filled:
            notes.append(f"{out.filled} positions no root took filled from the image prior (biharmonic inpainting "
                         "of the placed patches), not read off the update")
        unshuffled = None
        if out.shuffled is not None:  # the E_unk tokens' order in the shuffled positions: a jigsaw (setting c)
            unshuffled = unshuffle_image(images, out.shuffled, int(work.patch_embed.patch_size[0]))[0]
        stats = dict(roots_per_round=search.per_round, root_round_modes=search.modes, root_starts=search.starts,
                     warm_roots=search.given, prior_roots_per_round=out.prior_added,
                     roots_found=int(roots.shape[0]), placed_patches=out.placed, prior_filled=out.filled,
                     position_residual_max=float(read.residual[read.position >= 0].max()),
                     estimate_cpu_s=time.process_time() - c0, time_s=(time.perf_counter() - t0) / meta.num_images,
                     attack=self.name, notes=notes, shuffled_positions=int(read.shuffled.sum()), **label_stats)
        return AttackResult(images, [dict(stats) for _ in range(meta.num_images)], labels=y, unshuffled=unshuffled)

    def _reconstruct(self, model: nn.Module, update: Update, meta: AttackMetadata) -> AttackResult:
        t0, c0 = time.perf_counter(), time.process_time()
        B = meta.num_images
        vit = unwrap_vit(model)
        if meta.update_type == "delta" and meta.local_steps > 1:
            pos = getattr(vit, "pos_embed", None)
            raise AttackFailure(delta_refusal(meta.local_steps, B, None if pos is None else int(pos.shape[1])))
        grads, notes = update_to_gradients(update, meta)
        check_model(vit, grads, B)
        work = cast(nn.Module, copy.deepcopy(vit)).to("cpu", torch.float64).eval().requires_grad_(False)
        gen = torch.Generator().manual_seed(self.seed)
        obs = meta.defence.observation() if meta.defence is not None else None
        if self.noise_aware and obs is not None and obs.perturbs:
            return self._defended(model, work, grads, meta, notes, gen, t0, c0)
        report(self.name, 0, self.rounds, "root search")
        search = self._search(work, grads, B, gen)
        report(self.name, 0, None, "positions, images and patches solved from the roots")
        out = batch_from_roots(work, grads, search.roots, B, self.attention_iterations, self.attention_starts, gen,
                               self.structured_rounds)
        report(self.name, 0, self.span_polish, "span polish (Levenberg-Marquardt Jacobians)")
        polish, polish_failed = self._polish(work, grads, out)
        y, label_stats = batch_labels(model, grads, meta, self.seed)
        notes.append(f"block 0's {search.roots.shape[0]} MLP roots found ({search.given} from the closed form's "
                     f"read, the rest in {search.starts} starts); positions, images and patches solved linearly")
        images = meta.denormalize(out.images)
        unshuffled = None
        shuffled = int(out.shuffled.sum())
        if shuffled:  # MJP: the E_unk tokens' patches are exact, their places a jigsaw (setting c)
            ps = int(work.patch_embed.patch_size[0])
            unshuffled = torch.cat([unshuffle_image(images[b:b + 1], out.shuffled[b], ps)[0] for b in range(B)])
            notes.append(f"{shuffled} tokens carried E_unk: their patches are exact, their order in the "
                         "shuffled positions is the jigsaw solver's (the update does not fix it)")
        stats = dict(warm_roots=search.given, roots_per_round=search.per_round, root_round_modes=search.modes, root_starts=search.starts,
                     position_residual_max=float(out.position_residual.max()),
                     position_runner_up_min=float(out.runner_up.min()), membership_margin=out.membership_margin,
                     estimate_cpu_s=time.process_time() - c0, time_s=(time.perf_counter() - t0) / B,
                     attack=self.name, notes=notes, **label_stats)
        if out.root_polish is not None:  # past B T = D - 1: the patches refit to their roots
            rp = out.root_polish
            stats.update(root_polish_jacobians=list(rp.jacobians), root_polish_residual=rp.relative,
                         membership_repairs=out.membership_repairs)
            notes.append(f"past B T = D - 1 the membership repaired on the roots ({out.membership_repairs} changes) "
                         f"and every image's patches refit to its roots ({max(rp.jacobians)} Jacobians at most): "
                         f"squared root residual {float(rp.residual_before.max()):.1e} -> "
                         f"{float(rp.residual_after.max()):.1e}")
        design_a_stats, design_a_notes = _design_a_stats(out, polish, polish_failed)
        stats.update(design_a_stats)
        notes.extend(design_a_notes)
        return AttackResult(images, [dict(stats, shuffled_positions=int(out.shuffled[b].sum())) for b in range(B)],
                            labels=y, unshuffled=unshuffled)

"""The span residual's vector form and Levenberg-Marquardt on it (attacks.optimization.span_fit), on a held-out
ImageNet validation photograph and the shipped DeiT+MJP checkpoint's first two blocks (32 px,
design A, float64, gamma 0.27)."""
from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch

import attacks
import fedmjp  # noqa: F401  (registers the mjp_* models)
from attacks.closed_form.first_layer import check_conditions, gradient_of_Z
from attacks.closed_form.mjp_maths import mjp_reduction
from attacks.solvers.spans import SpanResidual, input_spans
from attacks.solvers.linalg import SketchPreconditioner, damped_cg, linearise, row_sketch
from attacks.optimization.span_fit import SpanVector, span_lm, truth_coordinates
from fedmjp.checkpoint import load_checkpoint
from helpers import MD, STD, folder_image, normalize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "cifar_deit_mjp.safetensors"


def _case(imagenet_sample, gamma: float):
    """(SpanVector, truth theta, the client's normalised x~, model, update) for a 2-block trained
    design-A model: the checkpoint's blocks 0-1 (two blocks keep every token's block-0 layers in the
    loss, at half the cost of four), |S| = gamma * 64 shuffled patches."""
    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="mjp", first_block="april", depth=4)
    load_checkpoint(model, CHECKPOINT)
    model.blocks = model.blocks[:2]
    model = model.eval().double()
    x = folder_image(imagenet_sample, 0, 32)
    plan = model.draw_plan(1, gamma=gamma, seed=100)
    xin = normalize(model.shuffle_images(x, plan))
    update = attacks.compute_update(model, xin, torch.tensor([0]), unk_mask=plan.mask)
    S, grads, _ = attacks.create_attack("mjp_adaptive").read_update(model, dict(update))
    assert torch.equal(S, plan.mask[0])
    red = mjp_reduction(model, gradient_of_Z(model, grads, check_conditions(model)),
                        grads["blocks.0.attn.qkv.weight"], S)
    residual = SpanResidual(model, input_spans(model, grads, S.numel() + 1), S)
    vec = SpanVector(residual, red, (8, 8), 3, 4)
    b, a = truth_coordinates(red, xin, 4)
    return vec, vec.pack(b, a), xin, model, update


@pytest.fixture(scope="module")
def case(imagenet_sample):
    """The attack's default shuffle ratio: gamma 0.27, |S| = 17, 1,024 reduced unknowns."""
    return _case(imagenet_sample, 0.27)


@pytest.fixture(scope="module")
def small_case(imagenet_sample):
    """gamma 0.1, |S| = 6: a quarter of the unknowns, so a Jacobian (one forward-mode column per
    unknown) costs a quarter of the default case's."""
    return _case(imagenet_sample, 0.1)


def test_vector_norm_equals_the_span_residual_value(case):
    vec, theta, xin, _, _ = case
    assert torch.allclose(vec.image(theta), xin, atol=1e-9)  # the truth's coordinates rebuild x~
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in (theta, theta + 0.3 * float(theta.std()) * torch.randn(theta.shape, generator=gen, dtype=theta.dtype)):
            r = vec(t)
            value = float(vec.residual.value(vec.image(t))[0])
            assert float(r.pow(2).sum()) == pytest.approx(value, rel=1e-9, abs=1e-24)
        assert float(vec(theta).pow(2).sum()) < 1e-16  # zero at the client's input up to rounding
        assert float(vec(t).pow(2).sum()) > 1e-6


@pytest.mark.slow
def test_lm_from_truth_plus_noise_returns_the_truth(small_case):
    """From the truth's reduced parameters plus Gaussian noise of 0.05 times their spread (~40 dB
    from x~), four Gauss-Newton iterations reach the client's x~ to > 90 dB (pixel units)."""
    vec, theta, xin, _, _ = small_case
    gen = torch.Generator().manual_seed(0)
    b_t, a_t = vec.unpack(theta)
    b0 = b_t + 0.05 * float(b_t.std()) * torch.randn(b_t.shape, generator=gen, dtype=b_t.dtype)
    a0 = a_t + 0.05 * float(a_t.std()) * torch.randn(a_t.shape, generator=gen, dtype=a_t.dtype)

    def psnr(img: torch.Tensor) -> float:
        return float(-10 * torch.log10(((img - xin) * STD.double()[:, None, None]).pow(2).mean()))

    start = psnr(vec.image(vec.pack(b0, a0)))
    assert start < 50
    b1, a1, out = span_lm(vec.residual, vec.red, b0, a0, (8, 8), 3, 4, max_jacobians=4)
    assert out.value < 1e-14 and psnr(vec.image(vec.pack(b1, a1))) > 90


def test_attack_runs_the_lm_stage_where_asked_and_not_on_a_shortened_fit(case):
    """``lm_jacobians`` None with an explicit ``span_iterations`` keeps the stage off (a note says so),
    None with the default fit runs :data:`LM_JACOBIANS` on this 32 px model, an explicit number wins."""
    from attacks.optimization.mjp_adaptive import LM_JACOBIANS, MJPAdaptive

    vec, _, _, _, _ = case
    T = vec.red.shuffled.numel() + 1
    attack = MJPAdaptive(span_iterations=10)
    assert "off" in attack.planned_lm_jacobians(vec.residual.work, T, vec.red, vec.residual.spans)
    assert MJPAdaptive().planned_lm_jacobians(vec.residual.work, T, vec.red, vec.residual.spans) == LM_JACOBIANS
    assert MJPAdaptive(lm_jacobians=2).planned_lm_jacobians(vec.residual.work, T, vec.red, vec.residual.spans) == 2
    with pytest.raises(ValueError, match="lm_jacobians"):
        MJPAdaptive(lm_jacobians=-1)


@pytest.mark.slow
def test_attack_lm_stage_lowers_the_span_residual(small_case):
    """One Levenberg-Marquardt iteration after a short L-BFGS fit, inside the attack: recorded, and the
    span residual falls (the attack's estimate, no truth used)."""
    _, _, _, model, update = small_case
    res = attacks.create_attack("mjp_adaptive", span_iterations=20, starts=1, probe_iterations=0, lm_jacobians=1,
                                tv_prior=False, unshuffle=False).reconstruct(model, update, MD)
    assert not res.failed, res.reason
    st = res.stats[0]
    assert st["lm_jacobians"] == 1 and st["objective"] < 0.9 * st["lm_objective_first"]  # measured: -27 %


# ------------------------------------------------------------------------------- matrix-free route
@pytest.mark.slow
def test_matrix_free_step_equals_the_dense_step_and_the_sketch_pays(small_case):
    """On the trained checkpoint's span residual (320 unknowns, truth + 0.05 noise): J v through the
    pullback's pullback and J^T r equal the dense Jacobian's; sketch-preconditioned CG returns the
    dense Levenberg-Marquardt step (J^T J + mu I) h = -J^T r to 1e-5 in fewer than 200 iterations
    (measured 136 with m = n/2, mu 1e-6 of max diag), where plain CG is still far from it after 200
    (measured: 988 to converge)."""
    vec, theta, _, _, _ = small_case
    gen = torch.Generator().manual_seed(0)
    th0 = theta + 0.05 * float(theta.std()) * torch.randn(theta.shape, generator=gen, dtype=theta.dtype)
    r, J = vec.jacobian(th0)
    G, g = J.T @ J, J.T @ r
    r2, jv, jtu, pullback = linearise(vec, th0)
    v = torch.randn(theta.numel(), generator=gen, dtype=theta.dtype)
    assert torch.allclose(jtu(r2), g, rtol=0, atol=1e-12 * float(g.norm()))
    assert torch.allclose(jv(v), J @ v, rtol=0, atol=1e-12 * float((J @ v).norm()))
    mu = 1e-6 * float(G.diagonal().max())
    h_true = -torch.linalg.solve(G + mu * torch.eye(G.shape[0], dtype=G.dtype), g)
    pre = SketchPreconditioner(row_sketch(pullback, r.numel(), theta.numel() // 2, torch.Generator().manual_seed(1),
                                          64, r.dtype, r.device))

    with_sketch = damped_cg(jv, jtu, g, mu, lambda x: pre.apply(x, mu), 200, 1e-10)
    plain = damped_cg(jv, jtu, g, mu, None, 200, 1e-10)
    err = float((with_sketch.h - h_true).norm() / h_true.norm())
    assert with_sketch.iterations < 200 and err < 1e-5
    assert plain.iterations == 200 and float((plain.h - h_true).norm() / h_true.norm()) > 10 * err
    assert torch.allclose(with_sketch.Jh, J @ with_sketch.h, rtol=0, atol=1e-9 * float(r.norm()))


def test_attack_picks_the_matrix_free_solver_where_the_dense_jacobian_does_not_fit(case, monkeypatch):
    """``lm_solver: auto`` is dense on the 32 px model and matrix-free once the dense Jacobian exceeds
    LM_MEMORY; an explicit solver wins; an unknown one is refused by name."""
    import attacks.optimization.mjp_adaptive as ma

    vec, _, _, _, _ = case
    T = vec.red.shuffled.numel() + 1
    assert ma.MJPAdaptive().planned_lm_solver(T, vec.red, vec.residual.spans) == "dense"
    monkeypatch.setattr(ma, "LM_MEMORY", 1e6)
    assert ma.MJPAdaptive().planned_lm_solver(T, vec.red, vec.residual.spans) == "matrix_free"
    assert ma.MJPAdaptive(lm_solver="dense").planned_lm_solver(T, vec.red, vec.residual.spans) == "dense"
    with pytest.raises(ValueError, match="lm_solver"):
        ma.MJPAdaptive(lm_solver="cholesky")


@pytest.mark.slow
def test_attack_runs_the_matrix_free_stage(small_case):
    """``lm_solver: matrix_free`` inside the attack: one iteration after a short L-BFGS fit lowers the
    span residual as the dense stage does, and the stats say which solver ran and its CG work."""
    _, _, _, model, update = small_case
    res = attacks.create_attack("mjp_adaptive", span_iterations=20, starts=1, probe_iterations=0, lm_jacobians=1,
                                lm_solver="matrix_free", tv_prior=False, unshuffle=False).reconstruct(model, update, MD)
    assert not res.failed, res.reason
    st = res.stats[0]
    assert st["lm_solver"] == "matrix_free" and st["lm_cg_iterations"] > 0 and st["lm_sketch_rows"] == 160
    assert st["objective"] < 0.9 * st["lm_objective_first"]

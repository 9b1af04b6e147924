"""The span residual's vector form and Levenberg-Marquardt on it (attacks.span_lm), on a held-out
ImageNet validation photograph and the shipped DeiT+MJP checkpoint's first two blocks (32 px,
design A, float64, gamma 0.27)."""
from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch

import attacks
import fedmjp  # noqa: F401  (registers the mjp_* models)
from attacks.first_layer import check_conditions, gradient_of_Z
from attacks.mjp_maths import mjp_reduction
from attacks.spans import SpanResidual, input_spans
from attacks.span_lm import SpanVector, levenberg_marquardt, span_lm, truth_coordinates
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


def test_levenberg_marquardt_solves_rosenbrock():
    """Rosenbrock as residuals (10 (y - x^2), 1 - x): minimum 0 at (1, 1), a curved valley."""
    def fun(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([10 * (t[1] - t[0] ** 2), 1 - t[0]])

    def jac(t: torch.Tensor):
        return fun(t), torch.tensor([[-20 * t[0], 10.0], [-1.0, 0.0]], dtype=t.dtype)

    out = levenberg_marquardt(fun, jac, torch.tensor([-1.2, 1.0], dtype=torch.float64), max_jacobians=100,
                              floor=1e-28, stall=0.0)
    assert torch.allclose(out.theta, torch.ones(2, dtype=torch.float64), atol=1e-10)
    assert out.value < 1e-20 and out.history == sorted(out.history, reverse=True)


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
    from attacks.mjp_adaptive import LM_JACOBIANS, MJPAdaptive

    vec, _, _, _, _ = case
    T = vec.red.shuffled.numel() + 1
    attack = MJPAdaptive(span_iterations=10)
    assert "off" in attack._lm_jacobians(vec.residual.work, T, vec.red, vec.residual.spans)
    assert MJPAdaptive()._lm_jacobians(vec.residual.work, T, vec.red, vec.residual.spans) == LM_JACOBIANS
    assert MJPAdaptive(lm_jacobians=2)._lm_jacobians(vec.residual.work, T, vec.red, vec.residual.spans) == 2
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

"""The Levenberg-Marquardt family (attacks.solvers.lm) and its Krylov parts (attacks.solvers.linalg):
every entry point under every damping schedule on the same problems, with known minima."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attacks.solvers.linalg import SketchPreconditioner
from attacks.solvers.lm import MARQUARDT, NIELSEN, ROOTS, Damping, batched_lm, dense_lm, matrix_free_lm

SCHEDULES = {"nielsen": NIELSEN, "roots": ROOTS, "marquardt": MARQUARDT}
F64 = torch.float64


def rosenbrock(t: torch.Tensor, a: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Rosenbrock as residuals (10 (y - x^2), a - x) [..., 2]: minimum 0 at (a, a^2), a curved valley."""
    return torch.stack([10 * (t[..., 1] - t[..., 0] ** 2), a - t[..., 0]], -1)


def rosenbrock_jacobian(t: torch.Tensor) -> torch.Tensor:
    """d rosenbrock / d t [..., 2, 2]."""
    one = torch.ones_like(t[..., 0])
    return torch.stack([torch.stack([-20 * t[..., 0], 10 * one], -1), torch.stack([-one, 0 * one], -1)], -2)


def ill_conditioned(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A [300, 40] of condition 1e3, y [300], the least-squares solution [40])."""
    gen = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(300, 40, generator=gen, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen, dtype=F64))
    A = U @ torch.diag(torch.logspace(0, -3, 40, dtype=F64)) @ V.T
    y = torch.randn(300, generator=gen, dtype=F64)
    return A, y, torch.linalg.lstsq(A, y[:, None]).solution[:, 0]


@pytest.mark.parametrize("name", SCHEDULES)
def test_dense_lm_solves_rosenbrock_under_every_schedule(name: str) -> None:
    out = dense_lm(rosenbrock, rosenbrock_jacobian, torch.tensor([-1.2, 1.0], dtype=F64), max_jacobians=200,
                   damping=SCHEDULES[name], floor=1e-28, stall=0.0)
    assert torch.allclose(out.theta, torch.ones(2, dtype=F64), atol=1e-10)
    assert out.value < 1e-20 and out.history == sorted(out.history, reverse=True)
    assert out.history[0] == out.value_first == pytest.approx(24.2)  # (10 (1 - 1.44))^2 + 2.2^2


@pytest.mark.parametrize("name", SCHEDULES)
def test_dense_lm_lands_on_the_least_squares_solution(name: str) -> None:
    A, y, best = ill_conditioned()
    out = dense_lm(lambda t: A @ t - y, lambda t: A, torch.zeros(40, dtype=F64), max_jacobians=50,
                   damping=SCHEDULES[name], stall=1e-12)
    assert torch.allclose(out.theta, best, rtol=0, atol=1e-6 * float(best.norm()))
    assert out.value == pytest.approx(float((A @ best - y).pow(2).sum()), rel=1e-9)


def test_dense_lm_keeps_the_shape_of_its_start() -> None:
    """A start of any shape: the residual sees it as given, the Jacobian's columns are its entries."""
    target = torch.arange(6, dtype=F64).reshape(2, 3)
    out = dense_lm(lambda t: (t - target).flatten(), lambda t: torch.eye(6, dtype=F64),
                   torch.zeros(2, 3, dtype=F64), damping=ROOTS, floor=1e-30)
    assert out.theta.shape == (2, 3) and torch.allclose(out.theta, target, atol=1e-12)


def test_a_converging_run_gets_as_many_jacobians_again_and_a_stalled_one_stops() -> None:
    """``extend_below``: a run below it when its Jacobians run out doubles them; ``stall_below``: below
    it an iteration gaining less than ``stall`` ends the run."""
    start = torch.tensor([-1.2, 1.0], dtype=F64)
    base = dense_lm(rosenbrock, rosenbrock_jacobian, start, max_jacobians=8, damping=ROOTS, stall=0.0)
    assert base.jacobians == 8
    longer = dense_lm(rosenbrock, rosenbrock_jacobian, start, max_jacobians=8, damping=ROOTS, stall=0.0,
                      extend_below=base.value * 2)
    assert longer.jacobians > 8 and longer.value < base.value
    stopped = dense_lm(rosenbrock, rosenbrock_jacobian, start, max_jacobians=200, damping=ROOTS, stall=1.0,
                       stall_below=float("inf"))
    assert stopped.jacobians == 1  # every iteration gains less than all of the residual


@pytest.mark.parametrize("name", ["roots", "marquardt"])
def test_batched_lm_solves_each_row_as_dense_lm_solves_it_alone(name: str) -> None:
    """K shifted Rosenbrocks (minimum (a_k, a_k^2)) from K starts, one mu per row: every row reaches its
    own minimum, where dense_lm on the row alone reaches it too."""
    damping = SCHEDULES[name]
    a = torch.linspace(-1.5, 2.0, 6, dtype=F64)
    starts = torch.stack([-a + 0.3, a.abs() + 1], 1)

    def system(t: torch.Tensor, shift: torch.Tensor):
        r, J = rosenbrock(t, shift), rosenbrock_jacobian(t)
        return r.pow(2).sum(-1), J.mT @ J, (J.mT @ r[..., None])[..., 0]

    def value_of(t: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return rosenbrock(t, shift).pow(2).sum(-1)

    theta, value = batched_lm(system, value_of, starts, 300, damping, settled=1e-28, rows=(a,))
    truth = torch.stack([a, a * a], 1)
    assert torch.allclose(theta, truth, atol=1e-9) and bool((value < 1e-18).all())
    for k in (0, 5):
        alone = dense_lm(lambda t: rosenbrock(t, a[k]), rosenbrock_jacobian, starts[k], 300, damping, floor=1e-28,
                         stall=0.0)
        assert torch.allclose(alone.theta, theta[k], atol=1e-9)


def test_batched_lm_refuses_the_step_of_a_singular_row() -> None:
    """A row whose damped system J^T J + mu max(diag) I is exactly singular at the first mu (here J^T J
    = diag(-mu, 1), and no gradient) keeps its start and raises nothing, while the other row reaches
    its minimum; a single singular system is a refused step (None)."""
    from attacks.solvers.lm import _step

    a = torch.tensor([1.0, 0.5], dtype=F64)
    starts = torch.tensor([[-0.7, 1.2], [0.3, 0.3]], dtype=F64)
    flat = torch.diag(torch.tensor([-ROOTS.first, 1.0], dtype=F64))

    def system(t: torch.Tensor, shift: torch.Tensor):
        r, J = rosenbrock(t, shift), rosenbrock_jacobian(t)
        G, g = J.mT @ J, (J.mT @ r[..., None])[..., 0]
        odd = shift == 0.5  # the second row: the singular system
        return r.pow(2).sum(-1), torch.where(odd[:, None, None], flat, G), torch.where(odd[:, None], 0.0, g)

    def value_of(t: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return rosenbrock(t, shift).pow(2).sum(-1)

    theta, value = batched_lm(system, value_of, starts, 300, ROOTS, settled=1e-28, rows=(a,))
    assert torch.allclose(theta[0], torch.tensor([1.0, 1.0], dtype=F64), atol=1e-9)
    assert torch.equal(theta[1], starts[1])
    assert _step(torch.zeros(2, 2, dtype=F64), torch.ones(2, dtype=F64), ROOTS) is None


def test_batched_lm_leaves_settled_rows_alone() -> None:
    """A row at or below ``settled`` takes no step: its system is never asked for."""
    asked: list[int] = []

    def system(t: torch.Tensor):
        asked.append(t.shape[0])
        r, J = rosenbrock(t), rosenbrock_jacobian(t)
        return r.pow(2).sum(-1), J.mT @ J, (J.mT @ r[..., None])[..., 0]

    starts = torch.tensor([[1.0, 1.0], [-1.2, 1.0]], dtype=F64)  # the first sits at its minimum
    theta, _ = batched_lm(system, lambda t: rosenbrock(t).pow(2).sum(-1), starts, 3, ROOTS, settled=0.0)
    assert asked == [1, 1, 1] and torch.equal(theta[0], starts[0])


def test_matrix_free_lm_solves_a_linear_least_squares_problem_in_one_iteration() -> None:
    """fun(theta) = A theta - y with A [300, 40] of condition 1e3: one Gauss-Newton iteration lands on
    the least-squares solution; with an oversampled sketch (m = 4n, preconditioned condition number
    ~9) its CG takes under n iterations to 1e-12 where plain CG (condition 1e6) takes several times n."""
    A, y, best = ill_conditioned()
    floor = float((A @ best - y).pow(2).sum())
    undamped = replace(NIELSEN, first=0.0)
    full = matrix_free_lm(lambda t: A @ t - y, torch.zeros(40, dtype=F64), max_iterations=1,
                          sketch_rows=160, cg_tol=1e-12, damping=undamped)
    plain = matrix_free_lm(lambda t: A @ t - y, torch.zeros(40, dtype=F64), max_iterations=1,
                           sketch_rows=0, cg_tol=1e-12, damping=undamped)
    assert torch.allclose(full.theta, best, rtol=0, atol=1e-7 * float(best.norm()))
    assert full.value == pytest.approx(floor, rel=1e-9)
    assert full.cg_iterations[0] <= 40 and plain.cg_iterations[0] >= 4 * full.cg_iterations[0]
    with pytest.raises(ValueError, match="sketch_rows"):
        matrix_free_lm(lambda t: A @ t - y, torch.zeros(40, dtype=F64), sketch_rows=161)


@pytest.mark.parametrize("damping", [NIELSEN, Damping("geometric", first=1e-3)], ids=["nielsen", "geometric"])
def test_matrix_free_lm_solves_rosenbrock_as_the_dense_solver_does(damping: Damping) -> None:
    start = torch.tensor([-1.2, 1.0], dtype=F64)
    free = matrix_free_lm(rosenbrock, start, max_iterations=200, sketch_rows=2, cg_tol=1e-14, damping=damping,
                          stall=0.0, xtol=0.0, relative_floor=0.0, floor=1e-28)
    assert torch.allclose(free.theta, torch.ones(2, dtype=F64), atol=1e-10) and free.value < 1e-20


def test_a_damping_already_at_its_ceiling_leaves_the_start() -> None:
    """mu starts at or above ``high``: no trial is made, in either solver, and the start comes back."""
    capped = Damping("geometric", first=1e9, high=1e8)
    start = torch.tensor([-1.2, 1.0], dtype=F64)
    free = matrix_free_lm(rosenbrock, start, sketch_rows=2, damping=capped)
    dense = dense_lm(rosenbrock, rosenbrock_jacobian, start, damping=capped)
    for out in (free, dense):
        assert torch.equal(out.theta, start) and out.evaluations == 1 and out.jacobians == 1


def test_a_schedule_an_entry_point_cannot_apply_is_refused_by_name() -> None:
    A, y, _ = ill_conditioned()
    with pytest.raises(ValueError, match="scale 'identity'"):
        matrix_free_lm(lambda t: A @ t - y, torch.zeros(40, dtype=F64), damping=ROOTS)
    with pytest.raises(ValueError, match="geometric"):
        batched_lm(lambda t: None, lambda t: t.sum(-1), torch.zeros(2, 2, dtype=F64), 1, NIELSEN)


def test_a_failed_cholesky_factorisation_is_a_refused_step() -> None:
    """A Jacobian with a NaN: every factorisation fails, each counts as a refused trial, and after
    max_trials the run ends where it started without evaluating a trial. A singular J^T J (the residual
    sees only t0 + t1) is solved under ROOTS' relative damping and LU solve."""
    def fun(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t[0] + t[1] - 3.0, t[0] + t[1] - 3.0])

    start = torch.zeros(2, dtype=F64)
    broken = torch.tensor([[1.0, float("nan")], [1.0, 1.0]], dtype=F64)
    out = dense_lm(fun, lambda t: broken, start, damping=NIELSEN)
    assert torch.equal(out.theta, start) and out.jacobians == 1 and out.evaluations == 1
    solved = dense_lm(fun, lambda t: torch.ones(2, 2, dtype=F64), start, damping=ROOTS, floor=1e-24)
    assert float(solved.theta.sum()) == pytest.approx(3.0, abs=1e-9)


def test_sketch_preconditioner_inverts_what_it_resolved() -> None:
    """A sketch that sees only J's first 6 of 12 columns: a direction outside what it resolved is left
    as it is, its top direction is divided by its curvature (times the floor's, the scaling)."""
    gen = torch.Generator().manual_seed(1)
    J = torch.randn(500, 12, generator=gen, dtype=F64) @ torch.diag(torch.logspace(0, -2, 12, dtype=F64))
    Y = torch.randn(6, 500, generator=gen, dtype=F64) @ J[:, :6]
    Y = torch.cat([Y, torch.zeros(6, 6, dtype=F64)], dim=1)  # [6, 12]: no component on 6-11
    pre = SketchPreconditioner(Y)
    e = torch.zeros(12, dtype=F64)
    e[-1] = 1.0
    assert torch.allclose(pre.apply(e, 0.1), e, atol=1e-12)  # outside the sketch: untouched
    v = pre.Vh[0].clone()  # the top sketched direction: scaled by (floor + mu) / (lambda_0 + mu)
    assert torch.allclose(pre.apply(v, 0.1), v * (pre.floor + 0.1) / (float(pre.lam[0]) + 0.1), atol=1e-12)

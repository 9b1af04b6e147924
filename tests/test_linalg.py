"""attacks/solvers/linalg.py: the torch conjugate gradients against scipy's ``cg`` on the same system."""
from __future__ import annotations

import numpy as np
import scipy.sparse.linalg as spla
import torch

from attacks.solvers.linalg import conjugate_gradient


def _system(n: int = 60, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, n, generator=gen, dtype=torch.float64)
    a = q @ q.T + torch.diag(torch.logspace(-2, 2, n, dtype=torch.float64))  # SPD, condition ~1e4 and up
    return a, torch.randn(n, generator=gen, dtype=torch.float64)


def test_matches_scipy_cg_step_for_step() -> None:
    a, b = _system()
    x0 = torch.full_like(b, 0.1)
    diag = a.diagonal()
    for rtol, maxiter in ((1e-10, 500), (1e-3, 500), (1e-12, 7)):
        count = [0]
        ref, info = spla.cg(a.numpy(), b.numpy(), x0=x0.numpy(), rtol=rtol, maxiter=maxiter,
                            M=spla.LinearOperator(a.shape, matvec=lambda v: v / diag.numpy(), dtype=np.float64),
                            callback=lambda _: count.__setitem__(0, count[0] + 1))
        x, its, converged = conjugate_gradient(lambda v: a @ v, b, x0=x0, precond=lambda v: v / diag,
                                               rtol=rtol, maxiter=maxiter)
        assert its == count[0] and converged == (info == 0)
        err = float((x - torch.from_numpy(ref)).norm() / torch.from_numpy(ref).norm())
        assert err < 1e-8  # the same iterates up to the BLAS's summation order
    x, _, converged = conjugate_gradient(lambda v: a @ v, b, rtol=1e-12, maxiter=1000)
    assert converged and torch.allclose(a @ x, b, atol=1e-8)


def test_zero_right_hand_side_is_zero_at_once() -> None:
    a, b = _system(10)
    x, its, converged = conjugate_gradient(lambda v: a @ v, torch.zeros_like(b), x0=b)
    assert its == 0 and converged and not x.any()

"""Linear algebra the attacks share that torch and scipy do not provide on every device.

:func:`conjugate_gradient` is hand-written: ``scipy.sparse.linalg.cg`` needs its operator's
vectors as numpy arrays on the host, so an operator built from CUDA tensors would copy every
vector to the CPU and back at every iteration, and torch has no conjugate-gradient solver. It
follows scipy's ``cg`` step for step (same stopping rule and iteration count), so on the CPU it
gives scipy's answer to rounding.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

Operator = Callable[[torch.Tensor], torch.Tensor]


def conjugate_gradient(matvec: Operator, b: torch.Tensor, x0: Optional[torch.Tensor] = None,
                       precond: Optional[Operator] = None, rtol: float = 1e-5, maxiter: Optional[int] = None,
                       ) -> tuple[torch.Tensor, int, bool]:
    """Preconditioned conjugate gradients for ``A x = b``, A symmetric positive definite.

    Runs on the device and dtype of ``b``. Stops once ``||b - A x|| < rtol ||b||`` (checked before
    each iteration, as scipy's ``cg`` with ``atol=0``) or after ``maxiter`` iterations.

    Args:
        matvec: x -> A x, for vectors shaped like ``b``.
        b: the right-hand side [n] (any shape: the inner products run over all entries).
        x0: the start (None: zeros).
        precond: x -> M x, M approximating A^-1 (None: the identity).
        rtol: relative tolerance on the residual norm.
        maxiter: iteration cap (None: 10 n, scipy's default).

    Returns:
        (x, iterations done, converged).
    """
    x = torch.zeros_like(b) if x0 is None else x0.clone()
    bnorm = torch.linalg.vector_norm(b)
    if float(bnorm) == 0:
        return torch.zeros_like(b), 0, True
    atol = rtol * bnorm
    maxiter = 10 * b.numel() if maxiter is None else maxiter
    r = b - matvec(x) if x0 is not None and bool(x.any()) else b.clone()
    p = rho_prev = None
    for it in range(maxiter):
        # one host sync per iteration, for the stopping rule (as scipy): the matvecs dominate
        if bool(torch.linalg.vector_norm(r) < atol):
            return x, it, True
        z = r if precond is None else precond(r)
        rho = torch.vdot(r.flatten(), z.flatten())
        p = z.clone() if p is None else z + (rho / rho_prev) * p
        q = matvec(p)
        alpha = rho / torch.vdot(p.flatten(), q.flatten())
        x = x + alpha * p
        r = r - alpha * q
        rho_prev = rho
    return x, maxiter, False

"""``april_robust``'s block-diagonal preconditioner, applied two ways side by side.

Each conjugate-gradient step of ``april_robust``'s image step (``attacks.closed_form.robust_steps.x_step``)
solves one N x N system per patch entry j against its Cholesky factor: [J, N, N] factors, J = 3 p^2
patch entries, N = (size / p)^2 patches (224 px, p = 16: 768 blocks of 196). This script times
``torch.cholesky_solve`` against the two triangular solves the attack uses
(``robust_steps.block_cholesky_solve``) on factors of that shape, built as the attack builds them
(w G G^T plus a diagonal per block, G the patches' gradients [N, D]), and prints seconds per call,
the ratio and the largest difference of the two answers.

    python bench/block_solve.py                 # 224 px, D = 384 (DeiT-S/16), 20 calls each
    python bench/block_solve.py --size 32 --patch 4 --width 192
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attacks.closed_form.robust_steps import block_cholesky_solve  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_throughput import alternate  # noqa: E402  (the bench scripts' side-by-side order)


def factors(size: int, patch: int, width: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(L [J, N, N] lower Cholesky factors of w_j G G^T + diag, a right-hand side [N, J])."""
    N, J = (size // patch) ** 2, 3 * patch * patch
    G = torch.randn(N, width, generator=generator, dtype=torch.float64)
    w = torch.rand(J, generator=generator, dtype=torch.float64) + 0.5
    d = torch.rand(J, N, generator=generator, dtype=torch.float64) + 1e-3
    A = w[:, None, None] * (G @ G.T) + torch.diag_embed(d)
    return torch.linalg.cholesky(A), torch.randn(N, J, generator=generator, dtype=torch.float64)


def cholesky_solve_route(L: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """The same solve with ``torch.cholesky_solve`` (the route the attack does not take)."""
    return torch.cholesky_solve(X.T[:, :, None], L)[:, :, 0].T


def timed(fn, L: torch.Tensor, X: torch.Tensor, calls: int) -> tuple[float, torch.Tensor]:
    out = fn(L, X)  # warm-up
    t = time.perf_counter()
    for _ in range(calls):
        out = fn(L, X)
    return (time.perf_counter() - t) / calls, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=224, help="image size in pixels")
    p.add_argument("--patch", type=int, default=16, help="patch size")
    p.add_argument("--width", type=int, default=384, help="embedding width D (columns of G)")
    p.add_argument("--calls", type=int, default=20, help="timed calls of each route per run (two runs, order alternated)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args(argv)
    if min(args.patch, args.width, args.calls, args.threads) < 1 or args.size < args.patch or args.size % args.patch:
        p.error("need size a positive multiple of patch, and patch, width, calls and threads >= 1")
    torch.set_num_threads(args.threads)
    L, X = factors(args.size, args.patch, args.width, torch.Generator().manual_seed(0))
    routes = {"cholesky_solve": cholesky_solve_route, "two triangular solves": block_cholesky_solve}
    runs = alternate({name: (lambda fn=fn: timed(fn, L, X, args.calls)) for name, fn in routes.items()}, 2)
    per_call = {name: sum(dt for dt, _ in got) / len(got) for name, got in runs.items()}
    a, b = (got[-1][1] for got in runs.values())
    diff = float((a - b).abs().max() / a.abs().max())
    J, N = L.shape[0], L.shape[1]
    print(f"[block solve] {args.size} px, patch {args.patch}: [{J}, {N}, {N}] factors, {args.threads} thread(s)")
    for name, dt in per_call.items():
        print(f"  {name:22s} {dt * 1e3:9.2f} ms per call")
    print(f"  ratio cholesky_solve / triangular {per_call['cholesky_solve'] / per_call['two triangular solves']:.2f}x;"
          f" largest relative difference {diff:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

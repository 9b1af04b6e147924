"""One converging gradient-matching step recorded as a CUDA graph and replayed
(:class:`GraphedStep`, the ``cuda_graph`` option of :class:`attacks.optimization.matching.GradientMatching`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from .match_terms import MatchTerms


class GraphedStep:
    """One converging step's objective, data term and gradient in the candidates, recorded as a CUDA
    graph per set of running updates and replayed.

    Written by hand: ``torch.cuda.make_graphed_callables`` records a module's forward and backward
    but not a double backward taken inside the forward, which the gradient-matching objective is.
    One step launches thousands of small kernels: replaying them as one graph removes the launches,
    not the arithmetic. Where recording fails (an operation a graph cannot hold), the steps run eagerly
    and :meth:`status` says why. Returned tensors are copies: the next replay overwrites the graph's.
    """

    def __init__(self, attack: Any, per_group, match: MatchTerms, y: torch.Tensor) -> None:
        self.attack, self.per_group, self.match, self.y = attack, per_group, match, y
        self.graphs: dict[tuple, tuple] = {}
        self.recorded, self.replays, self.failure = 0, 0, None

    def status(self) -> str:
        if self.failure is not None:
            return f"eager steps: recording a CUDA graph failed ({self.failure})"
        return f"CUDA graph: {self.recorded} recorded, {self.replays} replays"

    def _run(self, key: tuple, x: torch.Tensor, match: MatchTerms, y: torch.Tensor):
        obj, data = self.attack._terms(lambda xs, ys: self.per_group(xs, ys, list(key)), match, y, x)
        (gx,) = torch.autograd.grad(torch.where(torch.isfinite(obj.detach()), obj, torch.zeros_like(obj)).sum(), x)
        return obj.detach(), data.detach(), gx

    def _eager(self, key: tuple, x: torch.Tensor):
        x = x.detach().clone().requires_grad_(True)
        return self._run(key, x, self.match.select(list(key)), self.y[list(key)])

    def __call__(self, active: Sequence[int], x: torch.Tensor):
        key = tuple(int(k) for k in active)
        if self.failure is not None:
            return self._eager(key, x)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._record(key, x)
            except Exception as err:  # noqa: BLE001 - any failure to record: eager steps, with the reason
                self.failure = f"{type(err).__name__}: {err}"[:200]
                self.graphs.clear()
                return self._eager(key, x)
            self.graphs = {key: entry}  # the running set changes rarely; one graph is kept
        static_x, graph, out, _inputs = entry
        static_x.detach().copy_(x)
        graph.replay()
        self.replays += 1
        return tuple(t.clone() for t in out)

    def _record(self, key: tuple, x: torch.Tensor):
        # selections made before recording: indexing with host lists copies to the device, which a
        # graph cannot hold (the per-group masks of an MJP-aware forward are picked and kept too)
        match, y = self.match.select(list(key)), self.y[list(key)]
        static_x = x.detach().clone().requires_grad_(True)
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: lazy initialisations and cached selections outside the graph
                self._run(key, static_x, match, y)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: attackers of other groups may run on the same device in other threads
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self._run(key, static_x, match, y)
        self.recorded += 1
        # the graph reads these tensors at their recorded addresses on every replay: the entry keeps
        # them alive. Dropped with _record's frame, their memory would go back to the allocator and
        # be reused, and a replay would read other data as the labels
        return static_x, graph, out, (match, y)

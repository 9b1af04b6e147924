"""Flower ServerApp: FedSGD/FedAvg over MJP ViTs with an honest-but-curious tap.

``app`` is what ``flwr run`` and the deployment engine load (``server.server_app:app``); it reads
its configuration from ``context.run_config`` and, with ``out-dir`` set, stores every tapped update
and the outcome there. :func:`make_server_app` builds the same app with a Python tap and config
overrides for :func:`server.federation.run_federation`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from clients.runconfig import resolve_config

from .rounds import ServerOutcome, run_rounds
from .tap import Tap


def make_server_app(run_config: Optional[Mapping[str, Any]] = None, tap: Optional[Tap] = None,
                    on_finish: Optional[Callable[[ServerOutcome], None]] = None) -> ServerApp:
    """A ServerApp whose config is ``context.run_config`` overlaid with ``run_config`` (flat
    run-config keys, as Flower carries them), read into a :class:`clients.runconfig.RunConfig` once per run.

    Args:
        tap: called with every client update before aggregation (in the ServerApp's process).
        on_finish: called with the :class:`ServerOutcome` when the rounds are done.
    """
    overrides = dict(run_config or {})
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        outcome = run_rounds(grid, resolve_config({**dict(context.run_config), **overrides}), tap)
        if on_finish is not None:
            on_finish(outcome)

    return app


app = make_server_app()

"""Flower's local runtime must stay offline (docs/design.md, "Federation with Flower, offline"):
no telemetry, no update check, no
runtime dependency installation. The one definition of those variables; importing this module does
not import Flower, so callers can apply it before Flower reads its environment."""
from __future__ import annotations

import os

OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


def keep_flower_offline() -> None:
    """Set :data:`OFFLINE_ENV` in ``os.environ`` where the caller has not set a value."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)

"""Strata: a local LLM inference server with a C core.

The public API: `Config`, `open_service` (embed the service in a trio program), `create_app` (the quart-trio app)
and `serve` (run the HTTP server). They load on first use, so that importing one submodule (the engine, the
model writer) does not import the whole server.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "strata.config",
    "open_service": "strata.service",
    "create_app": "strata.api.app",
    "serve": "strata.api.server",
}

__all__ = ["Config", "__version__", "create_app", "open_service", "serve"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'strata' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

"""Strata's HTTP API: `create_app()` builds the quart-trio app (`hypercorn 'strata.api:create_app()' -k trio`)."""

from strata.api.app import create_app

__all__ = ["create_app"]

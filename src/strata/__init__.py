"""Strata: a local LLM inference server with a C core."""

__version__ = "0.1.0"

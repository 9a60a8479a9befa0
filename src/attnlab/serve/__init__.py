"""``attnlab serve``: an OpenAI-compatible HTTP server with continuous batching for language models.

Needs the ``serve`` extra: ``pip install "attnlab[serve]"`` (FastAPI, uvicorn, prometheus_client).
"""

from __future__ import annotations


def create_app(models: dict, **kw):
    """The FastAPI app serving ``models`` (alias → ``attnlab.LoadedModel``); see :mod:`attnlab.serve.app`."""
    from .app import create_app as _create
    return _create(models, **kw)


__all__ = ["create_app"]

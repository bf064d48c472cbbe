"""Fixtures of the engine-API tests (relax/engine_api: the SGLang-compatible `/generate` protocol and the
OpenAI-compatible `/v1` routes, checked over HTTP against the embedded engine's server): the same shared
engine server on 127.0.0.1, its tokenizer and the trainer's view of its weights as the engine tests use
(tests/backends/conftest.py). Importing them here registers them for this folder; the tiny model folder is
the session's (tests/conftest.py).
"""

from __future__ import annotations

from tests.backends.conftest import client, engine_server, reference_model, tokenizer

__all__ = ["client", "engine_server", "reference_model", "tokenizer"]

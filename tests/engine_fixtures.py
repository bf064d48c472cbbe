"""Fixtures of the inference-engine and engine-API tests (registered for the whole suite by
tests/conftest.py): one shared engine server on 127.0.0.1 over the session's tiny model, a client for it,
its tokenizer, and the trainer's view of the same weights (`reference_model`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.backends.inference.embedded.http.server import EngineServer
from relax.engine_api.client import EngineClient


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir):
    """The trainer's forward over the same weights, float32."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def engine_server(tiny_model_dir):
    server = EngineServer(str(tiny_model_dir), port=0, seed=0, max_running=16, dtype="float32")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def client(engine_server) -> EngineClient:
    return EngineClient(engine_server.url, timeout_s=60)


@pytest.fixture(scope="session")
def tokenizer(engine_server):
    return engine_server.engine.tokenizer

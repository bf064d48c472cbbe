"""Fixtures of the agentic tests: one embedded engine over the session's tiny Qwen2, and a helper that
builds the rollout pieces (config, router, weight-update gate) around it."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.backends.inference.embedded.http.server import EngineServer


@pytest.fixture(scope="session")
def engine_server(tiny_model_dir):
    server = EngineServer(str(tiny_model_dir), port=0, seed=0, max_running=64, dtype="float32")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir):
    import torch

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

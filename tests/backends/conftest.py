"""Fixtures of the inference-engine tests: a tiny Qwen2 checkpoint (with and without a tokenizer), one
shared engine server on 127.0.0.1, and the trainer's view of the same weights (`reference_model`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.backends.inference.embedded.http.server import EngineServer
from relax.engine_api.client import EngineClient


def _write_tiny(out: Path) -> Path:
    try:
        from relax.models.tiny import write_tiny_model
    except ImportError:  # the kit is not there yet: a bare Qwen2 without tokenizer
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        cfg = Qwen2Config(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        Qwen2ForCausalLM(cfg).save_pretrained(out)
        return out
    return write_tiny_model(out, family="qwen2")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return _write_tiny(tmp_path_factory.mktemp("tiny_qwen2"))


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
    tok = engine_server.engine.tokenizer
    if tok is None:
        pytest.skip("the tiny model has no tokenizer yet")
    return tok

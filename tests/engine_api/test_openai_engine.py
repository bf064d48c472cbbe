"""The embedded engine's OpenAI-compatible routes, driven by the official `openai` client: every check of
tests/openai_checks.py (models, chat with tools and tool_choice, stop, n, seed, logprobs, streaming with
usage, response_format, legacy completions, errors) against `relax engine serve`'s server."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests import openai_checks as checks


@pytest.fixture
def oai(engine_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def model(engine_server) -> str:
    return Path(engine_server.engine.runner.model_path).name


@pytest.mark.parametrize(
    "check",
    ["check_models", "check_chat_and_usage", "check_stop", "check_seed", "check_logprobs", "check_streaming",
     "check_tools", "check_stream_tool_calls", "check_response_format", "check_completions", "check_errors"],
)  # fmt: skip
def test_openai_client(oai, model, check):
    getattr(checks, check)(oai, model)


def test_n_samples(oai, model):
    checks.check_n(oai, model, max_n=None)


def test_errors_have_openai_shape(engine_server):
    resp = httpx.post(
        engine_server.url + "/v1/chat/completions", json={"messages": [], "model": "x"}, timeout=30
    )
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["type"] == "invalid_request_error" and "messages" in err["message"]
    resp = httpx.post(engine_server.url + "/v1/completions", content=b"{nope", timeout=30)
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]

"""A bounded fuzz of Relax's HTTP servers from their own OpenAPI documents (schemathesis, loopback only):
the embedded engine, the agent endpoint (`relax agent serve`'s server over that engine) and the elastic
API. Every generated request, valid or not, must get an answer below 500, and each server must still
answer `/health` afterwards.

Left out: the routes that contact other hosts or change what the whole server does for everyone
(joining a weight-sync group, pausing, slowing down, aborting, scaling out); each has its own test.
The example count is small (`EXAMPLES` per operation) so the whole file runs in about a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import httpx
import pytest
from pydantic import BaseModel

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from hypothesis import strategies as st  # noqa: E402

from relax.utils.auth import auth_headers  # noqa: E402

TOKEN = "fuzz-token-0123456789"
EXAMPLES = 12
ENGINE_SKIP = {
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_ipc",
    "/pause_generation",
    "/continue_generation",
    "/slow_down",
    "/abort_request",
}
ELASTIC_SKIP = {"/v1/engines/scale_out"}


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)


def _send(http: httpx.Client, sent: Counter, label: str, method: str, path: str, **kwargs) -> None:
    r = http.request(method, path, **kwargs)
    sent[f"{label} {r.status_code}"] += 1
    assert r.status_code < 500, f"{method} {path} {kwargs!r}: {r.status_code} {r.text[:300]}"


def fuzz(url: str, app, skip: set[str]) -> Counter:
    """Send generated requests for every operation of `app` not in `skip`; returns how many of each
    (method path, status) were sent."""
    schema = schemathesis.openapi.from_dict(app.openapi())
    sent: Counter = Counter()
    with httpx.Client(base_url=url, timeout=60, headers=auth_headers(TOKEN)) as http:
        for result in schema.get_all_operations():
            op = result.ok()
            if op.path not in skip:
                _fuzz_operation(http, sent, op)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    return sent


def _fuzz_operation(http: httpx.Client, sent: Counter, op) -> None:
    @FUZZ_SETTINGS
    @given(case=op.as_strategy())
    def one(case) -> None:
        body = None if type(case.body).__name__ == "NotSet" else case.body
        label = f"{case.method} {op.path}"
        _send(http, sent, label, case.method, case.formatted_path, params=case.query or None, json=body)

    one()


# Bodies for the routes whose OpenAPI entry says little (the OpenAI routes parse their body themselves)
# or whose interesting inputs are values, not shapes: sampling parameters at and past their ranges.
_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=6)
)
_stop = st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), _scalar)
_SAMPLING = {
    # boundary values first: the smallest positive floats, huge and infinite ones
    "temperature": st.one_of(
        st.sampled_from([5e-324, 1e-45, 1e-40, 1e-8, 1e38, 1e308]),
        st.floats(0, 3),
        st.floats(allow_nan=False),
        _scalar,
    ),
    "top_p": st.one_of(st.floats(-1, 2), _scalar),
    "top_k": st.one_of(st.integers(-5, 10**6), _scalar),
    "min_p": st.floats(-1, 2),
    "max_new_tokens": st.integers(-1, 24),
    "n": st.one_of(st.integers(-1, 12), _scalar),
    "stop": _stop,
    "stop_token_ids": st.lists(st.integers(-5, 10**6), max_size=3),
    "ignore_eos": st.booleans(),
    "regex": st.sampled_from(["[0-9]+", "(", "", "a|b"]),
    "json_schema": st.sampled_from(['{"type": "object"}', "{", '{"type": "integer"}']),
    "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(allow_nan=False), max_size=3),
    "repetition_penalty": st.floats(-1, 10),
    "frequency_penalty": st.floats(-3, 3),
    "presence_penalty": st.floats(-3, 3),
    "sampling_seed": st.integers(-1, 2**70),
}
# A valid request with one sampling parameter drawn from its whole range: a bad value of one field (a
# tiny temperature, say) must be caught even when every other field is fine.
_ONE_FIELD = st.sampled_from(sorted(_SAMPLING)).flatmap(lambda k: _SAMPLING[k].map(lambda v: {k: v}))
_VALID_GENERATE = st.builds(
    lambda ids, params: {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, **params}},
    st.lists(st.integers(0, 200), min_size=1, max_size=12),
    _ONE_FIELD,
)
_RANDOM_GENERATE = st.fixed_dictionaries(
    {},
    optional={
        "input_ids": st.one_of(
            st.lists(st.integers(-5, 5000), max_size=40),
            st.lists(st.lists(st.integers(0, 300), max_size=8), max_size=3),
        ),
        "text": st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3)),
        "sampling_params": st.fixed_dictionaries({}, optional=_SAMPLING),
        "return_logprob": st.booleans(),
        "top_logprobs_num": st.integers(-1, 50),
        "logprob_start_len": st.integers(-2, 50),
        "return_text_in_logprobs": st.booleans(),
        "stream": st.booleans(),
        "rid": _scalar,
    },
)
GENERATE_BODY = st.one_of(_VALID_GENERATE, _RANDOM_GENERATE)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"])},
    optional={
        "content": st.one_of(
            st.text(max_size=30),
            st.none(),
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}
                )
            ),
        ),
        "tool_calls": st.lists(
            st.fixed_dictionaries({"id": st.text(max_size=4), "type": st.just("function")}), max_size=2
        ),
    },
)
_OPENAI = {
    "model": st.text(max_size=6),
    "max_tokens": st.one_of(st.integers(-1, 16), _scalar),
    "max_completion_tokens": st.integers(-1, 16),
    "n": st.integers(-1, 4),
    "temperature": st.one_of(st.floats(-1, 3), _scalar),
    "top_p": st.floats(-1, 2),
    "stop": _stop,
    "seed": st.integers(-1, 2**70),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 30)),
    "top_logprobs": st.integers(-1, 30),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "bogus"},
            "x",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        ]
    ),
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries({"name": st.text(min_size=1, max_size=4)}),
            }
        ),
        max_size=2,
    ),
    "tool_choice": st.sampled_from(
        ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}, 5]
    ),
}
_OPENAI_ONE_FIELD = st.sampled_from(sorted(_OPENAI)).flatmap(lambda k: _OPENAI[k].map(lambda v: {k: v}))
CHAT_BODY = st.one_of(
    st.builds(
        lambda text, field: {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **field},
        st.text(min_size=1, max_size=20),
        _OPENAI_ONE_FIELD,
    ),
    st.fixed_dictionaries({"messages": st.lists(_MESSAGE, max_size=3)}, optional=_OPENAI),
)
COMPLETION_BODY = st.one_of(
    st.builds(
        lambda text, field: {"prompt": text, "max_tokens": 4, **field},
        st.text(max_size=20),
        _OPENAI_ONE_FIELD,
    ),
    st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 500), max_size=10), _scalar)},
        optional=_OPENAI,
    ),
)


def fuzz_bodies(url: str, routes: dict[str, object]) -> Counter:
    """POST bodies drawn from `routes[path]` (a strategy) to each path; every answer must be below 500."""
    sent: Counter = Counter()
    with httpx.Client(base_url=url, timeout=60, headers=auth_headers(TOKEN)) as http:
        for path, strategy in routes.items():
            _fuzz_route(http, sent, path, strategy)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    return sent


def _fuzz_route(http: httpx.Client, sent: Counter, path: str, strategy) -> None:
    @settings(FUZZ_SETTINGS, max_examples=3 * EXAMPLES)
    @given(body=strategy)
    def one(body) -> None:
        # json.dumps writes inf as `Infinity`, which is not JSON: the server must refuse it with a 4xx
        content = json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        _send(http, sent, f"POST {path}", "POST", path, content=content, headers=headers)

    one()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from relax.backends.inference.embedded.http.server import EngineServer

    server = EngineServer(
        str(tiny_model_dir),
        port=0,
        device="cpu",
        threads=1,
        max_running=8,
        max_total_tokens=2048,
        max_context_len=256,
        api_key=TOKEN,
    )
    server.start()
    yield server
    server.stop()


def test_engine_answers_every_generated_request_below_500(engine):
    sent = fuzz(engine.url, engine.app, ENGINE_SKIP)
    assert sum(sent.values()) > 100, sent
    sent += fuzz_bodies(
        engine.url,
        {"/generate": GENERATE_BODY, "/v1/chat/completions": CHAT_BODY, "/v1/completions": COMPLETION_BODY},
    )
    for route in ("/generate", "/v1/chat/completions", "/v1/completions"):  # some were valid and served
        assert any(k.startswith(f"POST {route} 200") for k in sent), sent


def test_agent_endpoint_answers_every_generated_request_below_500(engine, tiny_model_dir, tmp_path):
    from relax.agentic.dev_server import AgentDevServer

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    dev = AgentDevServer(
        str(tiny_model_dir), [engine.url], tmp_path, port=0, max_tokens=8, api_key=TOKEN, engine_api_key=TOKEN
    )
    url = asyncio.run_coroutine_threadsafe(dev.server.start(), loop).result(60)
    try:
        sent = fuzz(url, dev.server.app, set())
        sent += fuzz_bodies(url, {"/s/fz/v1/chat/completions": CHAT_BODY, "/v1/completions": COMPLETION_BODY})
        assert sum(sent.values()) > 50, sent
        assert any(k.startswith("POST /s/fz/v1/chat/completions 200") for k in sent), sent
    finally:
        asyncio.run_coroutine_threadsafe(dev.server.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)


def test_elastic_api_answers_every_generated_request_below_500(engine):
    from relax.fleet.elastic_api import ElasticServer
    from relax.fleet.elastic_manager import ElasticManager
    from relax.rollout.router import Router

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def make() -> ElasticManager:
        router = Router([engine.url], timeout_s=60, api_key=TOKEN)
        return ElasticManager(router, [engine.url], provider=None, drain_timeout_s=5)

    manager = asyncio.run_coroutine_threadsafe(make(), loop).result(60)
    server = ElasticServer(manager, loop, api_key=TOKEN)
    url = server.start()
    try:
        sent = fuzz(url, server.app, ELASTIC_SKIP)
        assert sum(sent.values()) > 20, sent
    finally:
        server.stop()
        loop.call_soon_threadsafe(loop.stop)


class PlantedBody(BaseModel):
    k: int = 0


def test_the_fuzzer_finds_a_planted_server_error():
    """The harness itself: a route that fails on one value among many is found."""
    from fastapi import FastAPI

    from relax.utils.net import tcp_listener

    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {}

    @app.post("/planted")
    def planted(body: PlantedBody) -> dict:
        if body.k < 0:
            raise RuntimeError("planted")  # a 500
        return {}

    import uvicorn

    sock = tcp_listener("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.02)
    try:
        with pytest.raises(AssertionError, match="planted.*500"):
            fuzz(f"http://127.0.0.1:{sock.getsockname()[1]}", app, set())
    finally:
        server.should_exit = True
        thread.join(10)

"""Every HTTP server Relax starts asks for the bearer token on every route but `/health`
(relax/utils/auth.py): the embedded engine, the weight receiver, the elastic API and the agent endpoint.

Each server is started for real on 127.0.0.1 with a token; every route its app declares (read from the
app, so a route added later is covered too) answers 401 without a token and with a wrong one, while
`/health` answers without. Requests with the right token get past the check.
"""

from __future__ import annotations

import asyncio
import re
import threading

import httpx
import pytest

from relax.utils.auth import auth_headers, is_loopback, server_key

TOKEN = "relax-test-token-0123456789"
WRONG = {"Authorization": "Bearer not-the-token"}


def _routes(app) -> list[tuple[str, str]]:
    """Every (method, path) the app's OpenAPI document declares, path parameters filled in."""
    out = []
    for path, ops in app.openapi()["paths"].items():
        out += [(method.upper(), re.sub(r"\{[^}]+\}", "x", path)) for method in sorted(ops)]
    return out + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no-such-route")]


def _check_refused(url: str, app) -> int:
    routes = _routes(app)
    with httpx.Client(base_url=url, timeout=30) as http:
        for method, path in routes:
            if path == "/health":
                assert http.request(method, path).status_code == 200, path
                continue
            for headers in ({}, WRONG, {"Authorization": TOKEN}):  # none, wrong, not a bearer
                r = http.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
    return len(routes)


def test_engine_routes_ask_for_the_token(tiny_model_dir):
    from relax.backends.inference.embedded.http.server import EngineServer

    server = EngineServer(str(tiny_model_dir), port=0, device="cpu", threads=1, api_key=TOKEN)
    server.start()
    try:
        assert _check_refused(server.url, server.app) > 20  # SGLang's routes and OpenAI's /v1
        with httpx.Client(base_url=server.url, timeout=30, headers=auth_headers(TOKEN)) as http:
            assert http.get("/get_model_info").status_code == 200
            assert http.get("/v1/models").status_code == 200
            r = http.post(
                "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
            )
            assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_engine_client_sends_the_token(tiny_model_dir):
    from relax.backends.inference.embedded.http.server import EngineServer
    from relax.engine_api.client import EngineClient, EngineRequestError

    server = EngineServer(str(tiny_model_dir), port=0, device="cpu", threads=1, api_key=TOKEN)
    server.start()

    async def info(key):
        async with EngineClient(server.url, timeout_s=30, api_key=key) as client:
            return await client.model_info()

    try:
        assert "model_path" in asyncio.run(info(TOKEN))
        with pytest.raises(EngineRequestError, match="401"):
            asyncio.run(info("wrong-token"))
    finally:
        server.stop()


def test_an_external_engine_is_attached_only_with_its_token(tiny_model_dir):
    """`rollout.engine=external`: attaching checks the engine answers the key the run derives for it
    (relax/utils/auth.py: `engine_key`); an engine started for another run refuses it before any
    rollout."""
    from relax.backends.inference.embedded.http.server import EngineServer
    from relax.backends.inference.sglang import attach_external
    from relax.engine_api.client import EngineRequestError
    from relax.utils.auth import set_process_token

    server = EngineServer(str(tiny_model_dir), port=0, device="cpu", threads=1, api_key=TOKEN)
    server.start()
    try:
        set_process_token("another-run-token")
        with pytest.raises(EngineRequestError, match="401.*wrong bearer token"):
            asyncio.run(attach_external(server.url))
        set_process_token(TOKEN)
        assert "model_path" in asyncio.run(attach_external(server.url))
    finally:
        set_process_token(None)
        server.stop()


def test_weight_receiver_routes_ask_for_the_token(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from relax.weights.receiver import ModelWeightReceiver, ReceiverServer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    server = ReceiverServer(ModelWeightReceiver(model), api_key=TOKEN)
    url = server.start()
    try:
        assert _check_refused(url, server.server.config.app) >= 5
        r = httpx.get(f"{url}/get_model_info", headers=auth_headers(TOKEN), timeout=30)
        assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_elastic_api_routes_ask_for_the_token():
    from relax.fleet.elastic_api import ElasticServer

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ElasticServer(None, loop, api_key=TOKEN)  # a refused request never reaches the manager
    url = server.start()
    try:
        assert _check_refused(url, server.app) >= 6
    finally:
        server.stop()
        loop.call_soon_threadsafe(loop.stop)


def test_agent_endpoint_takes_the_run_token_or_the_session_token():
    from relax.agentic.openai_server import OpenAIServer

    async def main() -> None:
        server = OpenAIServer(api_key=TOKEN, default_session=None)
        url = await server.start()
        mine, other = server.issue_token("s1"), server.issue_token("s2")
        try:
            await asyncio.to_thread(_check_refused, url, server.app)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:

                async def status(path: str, token: str, **headers: str) -> int:
                    r = await http.get(path, headers={**auth_headers(token), **headers})
                    return r.status_code

                assert await status("/s/s1/v1/models", mine) == 200
                assert await status("/v1/models", mine, **{"x-relax-session": "s1"}) == 200
                assert await status("/s/s1/v1/models", other) == 401  # another session's token
                assert await status("/s/s1/v1/models", TOKEN) == 200  # the run's own
                server.close_session("s1")
                assert await status("/s/s1/v1/models", mine) == 401  # gone with its session
        finally:
            await server.stop()

    asyncio.run(main())


def test_standalone_servers_refuse_an_open_bind_without_a_key(monkeypatch):
    monkeypatch.delenv("RELAX_API_KEY", raising=False)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("198.18.0.2")
    assert server_key(None, "127.0.0.1", False, "x") is None
    with pytest.raises(SystemExit, match="--api-key"):
        server_key(None, "0.0.0.0", False, "relax engine serve")
    assert server_key(None, "0.0.0.0", True, "x") is None  # --insecure-no-auth
    monkeypatch.setenv("RELAX_API_KEY", TOKEN)
    assert server_key(None, "0.0.0.0", False, "x") == TOKEN

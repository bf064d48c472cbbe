"""Engines get keys of their own, never the run's token (relax/utils/auth.py: `engine_key`).

An external engine is a real HTTP server on 127.0.0.1 that records every request it gets; it is
attached the ways a run attaches one (`rollout.engine=external`, an elastic `external` scale-out) and
gets the run's calls (health, generation check, a weight push by files). The run's token appears in
none of them; each carries the engine's own key. The servers Relax starts accept their own key, and the
key of another engine opens nothing.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from relax.utils.auth import auth_headers, engine_key, set_process_token

RUN_TOKEN = "relax-run-token-5b1d0c7e9a"
REPLIES = {
    "/get_model_info": {"model_path": "recorder", "weight_version": "0"},
    "/update_weights_from_disk": {"success": True, "message": "ok"},
}


class Recorder(ThreadingHTTPServer):
    """A third party's engine: answers the engine routes a run calls and keeps what it was sent."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []  # (path, headers, body) of every request

        class Handler(BaseHTTPRequestHandler):
            def _answer(handler) -> None:  # noqa: N805 - the handler, beside the server's `self`
                body = handler.rfile.read(int(handler.headers.get("content-length") or 0))
                self.seen.append((handler.path, json.dumps(dict(handler.headers)), body.decode()))
                data = json.dumps(REPLIES.get(handler.path, {"success": True})).encode()
                handler.send_response(200)
                handler.send_header("content-type", "application/json")
                handler.send_header("content-length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def run_token():
    set_process_token(RUN_TOKEN)
    yield RUN_TOKEN
    set_process_token(None)


async def _attach_the_ways_a_run_does(url: str, tmp_path) -> None:
    import torch

    from relax.backends.inference.sglang import attach_external
    from relax.fleet.elastic_manager import ElasticManager
    from relax.rollout.router import Router
    from relax.weights.disk import DiskPublisher
    from relax.weights.sender import send_weights

    await attach_external(url)  # rollout.engine=external
    router = Router([], timeout_s=30)
    manager = ElasticManager(router, [], provider=None)
    op, _ = await manager.scale_out({"mode": "external", "engine_urls": [url]})
    while op.state.value != "weight_syncing":  # health checked; it would now wait for a push
        assert not op.done, op.error
        await asyncio.sleep(0.05)
    publisher = DiskPublisher(tmp_path / "weights")
    await publisher.connect([url])
    await send_weights(publisher, [("w", torch.zeros(2))], version=1)
    await publisher.close()
    await manager.close()
    await router.close()


def test_an_external_engine_never_receives_the_run_token(run_token, tmp_path):
    engine = Recorder()
    try:
        asyncio.run(_attach_the_ways_a_run_does(engine.url, tmp_path))
    finally:
        engine.shutdown()
    paths = {path for path, _, _ in engine.seen}
    assert {"/health", "/get_model_info", "/health_generate", "/update_weights_from_disk"} <= paths, paths
    own = f"Bearer {engine_key(run_token, engine.url)}"
    for path, headers, body in engine.seen:
        assert run_token not in headers and run_token not in body, path
        assert json.loads(headers).get("Authorization") == own, (path, headers)


def test_engine_keys_are_per_engine_and_open_the_servers_relax_starts(tiny_model_dir, run_token):
    from relax.backends.inference.embedded.http.server import EngineServer
    from relax.engine_api.client import EngineClient, EngineRequestError

    assert engine_key(run_token, "http://h:1") == engine_key(run_token, "http://h:1/")
    assert len({engine_key(run_token, "http://h:1"), engine_key(run_token, "http://h:2")}) == 2
    assert engine_key("another-run", "http://h:1") != engine_key(run_token, "http://h:1")

    server = EngineServer(str(tiny_model_dir), port=0, device="cpu", threads=1, api_key=run_token)
    server.start()

    async def info(**kw):
        async with EngineClient(server.url, timeout_s=30, **kw) as client:
            return await client.model_info()

    try:
        assert "model_path" in asyncio.run(info())  # the key derived from the run's token
        assert "model_path" in asyncio.run(info(api_key=run_token))  # an operator with the run's token
        with pytest.raises(EngineRequestError, match="401"):  # another engine's key
            asyncio.run(info(api_key=engine_key(run_token, "http://127.0.0.1:1")))
        r = httpx.get(f"{server.url}/get_model_info", headers=auth_headers("wrong"), timeout=30)
        assert r.status_code == 401
    finally:
        server.stop()


def test_a_server_relax_launches_holds_its_own_key_only(tiny_model_dir, run_token):
    """`rollout.backend=sglang` (`relax engine serve` in SGLang's place): the server process is given its
    own key, so neither its command line nor its environment holds the run's token; the run's clients
    reach it."""
    from pathlib import Path

    from relax.backends.inference.sglang import SGLangServer, SGLangServerConfig, embedded_launch_command
    from relax.engine_api.client import EngineClient

    cfg = SGLangServerConfig(model_path=str(tiny_model_dir), dtype="float32", extra_args=["--threads", "1"])
    server = SGLangServer(cfg, embedded_launch_command, api_key=run_token)
    url = server.start()
    try:
        proc = Path(f"/proc/{server.process.pid}")
        for what in ("cmdline", "environ"):
            assert run_token.encode() not in (proc / what).read_bytes(), what

        async def info():
            async with EngineClient(url, timeout_s=30) as client:
                return await client.model_info()

        assert "model_path" in asyncio.run(info())
        assert (
            httpx.get(f"{url}/get_model_info", headers=auth_headers("wrong"), timeout=30).status_code == 401
        )
    finally:
        server.stop()

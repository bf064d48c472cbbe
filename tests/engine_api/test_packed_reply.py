"""`relax engine serve` answers `/generate` packed (`relax.engine_api.packed`) to a client that accepts
it, and SGLang's JSON to any other; `EngineClient` asks for it and reads either, and a reply it cannot
read (a broken engine, a proxy's page) is the engine's failure, named with its URL."""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web

from relax.engine_api import client as client_module
from relax.engine_api import packed
from relax.engine_api.client import EngineClient, EngineUnavailableError, Reply, read_outputs
from tests.engine_helpers import run

BODY = {
    "input_ids": [[1, 2, 3], [4, 5]],
    "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2, "ignore_eos": True},
    "return_logprob": True,
}


def generate(url: str, body: dict, accept: str | None = None) -> httpx.Response:
    headers = {} if accept is None else {"Accept": accept}
    resp = httpx.post(url + "/generate", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def test_the_engine_packs_a_reply_only_for_a_client_that_accepts_it(engine_server):
    plain = generate(engine_server.url, BODY)
    assert plain.headers["content-type"] == "application/json"
    body = generate(engine_server.url, BODY, packed.ACCEPT)
    assert body.headers["content-type"] == packed.MEDIA_TYPE
    outs = read_outputs(Reply(200, body.content, "OK", packed.MEDIA_TYPE))
    ref = read_outputs(Reply(200, plain.content, "OK"))
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref]  # greedy: the same tokens
    assert all(len(o.output_ids) == len(o.output_log_probs) == 6 for o in outs)
    for a, b in zip(outs, ref, strict=True):
        assert max(abs(x - y) for x, y in zip(a.output_log_probs, b.output_log_probs, strict=True)) < 1e-4
        assert a.finish_reason == b.finish_reason == "length" and a.text == b.text
    # token text in the log-probs: JSON, whatever the client accepts
    texts = generate(engine_server.url, {**BODY, "return_text_in_logprobs": True}, packed.ACCEPT)
    assert texts.headers["content-type"] == "application/json"
    assert isinstance(texts.json()[0]["meta_info"]["output_token_logprobs"][0][2], str)


def test_the_client_asks_for_the_packed_reply(engine_server, client, monkeypatch):
    seen = []

    def spy(reply: Reply):
        seen.append(reply.content_type)
        return read_outputs(reply)

    monkeypatch.setattr(client_module, "read_outputs", spy)
    outs = run(client.generate([[1, 2, 3], [4, 5]], BODY["sampling_params"]))
    assert seen == [packed.MEDIA_TYPE]
    assert [len(o.output_ids) for o in outs] == [6] * 4
    assert all(len(o.output_log_probs) == 6 and o.weight_version is not None for o in outs)


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        (packed.MEDIA_TYPE, b"\xc1 not msgpack"),
        (packed.MEDIA_TYPE, packed.encode({"output_ids": b"\x01\x02\x03", "meta_info": {}})),  # not int32s
        ("application/json", b"<html>a proxy's page</html>"),
        ("application/json", b'{"meta_info": {"output_token_logprobs": [[0.5]]}}'),
    ],
)
def test_a_reply_that_cannot_be_read_names_the_engine(content_type, body):
    async def main() -> None:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=body, content_type=content_type)

        app = web.Application()
        app.router.add_post("/generate", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the port the OS picked
        url = f"http://127.0.0.1:{port}"
        try:
            with pytest.raises(EngineUnavailableError, match=f"{url}/generate sent a reply"):
                await EngineClient(url, timeout_s=10).generate([1, 2], {"max_new_tokens": 2})
        finally:
            await runner.cleanup()

    run(main())

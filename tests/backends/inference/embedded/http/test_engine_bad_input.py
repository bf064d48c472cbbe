"""Bad input on the engine's HTTP server is refused at once with a 4xx naming the field, while a normal
request in flight at the same time still gets its 200 and `/health` keeps answering: unbounded or
non-finite `logit_bias`, a stop regex that backtracks exponentially, lone UTF-16 surrogates, a text far
longer than the context, `stop_token_ids` outside the vocabulary. A real `EngineServer` over the tiny
model on 127.0.0.1 (the session's shared one)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

from relax.utils import http_limits

TIMEOUT_S = 120  # generous: a request the server never answers fails the test instead of stalling it
NORMAL = {
    "input_ids": [5, 6, 7],
    "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0.8},
}


def post(url: str, path: str, body: Any) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        url + path, content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT_S
    )


def error_of(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


def refused_alongside_a_normal_request(url: str, path: str, body: Any) -> httpx.Response:
    """Send `body` while a normal generation runs; returns the bad request's answer after checking that
    it is a 4xx, that the normal one got 200 and that `/health` still answers."""
    with ThreadPoolExecutor(2) as pool:
        normal = pool.submit(post, url, "/generate", NORMAL)
        bad = post(url, path, body)
        assert httpx.get(url + "/health", timeout=TIMEOUT_S).status_code == 200
        normal_resp = normal.result()
    assert 400 <= bad.status_code < 500, (bad.status_code, bad.text[:300])
    assert normal_resp.status_code == 200, normal_resp.text[:300]
    assert normal_resp.json()["meta_info"]["completion_tokens"] == 16
    return bad


@pytest.mark.parametrize(
    "raw_bias, temperature",
    [(b"1e300", 1.0), (b"NaN", 1.0), (b"-Infinity", 1.0), (b"3e38", 1e-5), (b"101", 1.0)],
)
def test_logit_bias_out_of_range_is_a_400_naming_the_field(engine_server, raw_bias, temperature):
    body = (
        b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "temperature": '
        + str(temperature).encode()
        + b', "logit_bias": {"5": '
        + raw_bias
        + b"}}}"
    )
    resp = refused_alongside_a_normal_request(engine_server.url, "/generate", body)
    assert "logit_bias" in error_of(resp) and "[-100, 100]" in error_of(resp)


def test_logit_bias_out_of_range_via_chat_completions(engine_server, tokenizer):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logit_bias": {"5": 1e300}}
    resp = refused_alongside_a_normal_request(engine_server.url, "/v1/chat/completions", body)
    assert resp.json()["error"]["param"] == "logit_bias"
    assert "[-100, 100]" in resp.json()["error"]["message"]


def test_logit_bias_at_the_bound_still_forces_the_token(engine_server):
    params = {"max_new_tokens": 4, "temperature": 1e-5, "ignore_eos": True, "logit_bias": {"5": 100.0}}
    resp = post(engine_server.url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": params})
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == [5, 5, 5, 5]


def test_a_catastrophic_stop_regex_is_matched_in_linear_time(engine_server, tokenizer):
    """`(.*a){20}$` backtracks exponentially in Python's `re`; searched after every token it held the
    engine thread for minutes. Under RE2 the request runs its 200 tokens like any other."""
    body = {
        "text": "aaaa a aa",
        "sampling_params": {"stop_regex": "(.*a){20}$", "ignore_eos": True, "max_new_tokens": 200},
    }
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(post, engine_server.url, "/generate", body)
        assert httpx.get(engine_server.url + "/health", timeout=TIMEOUT_S).status_code == 200
        normal = post(engine_server.url, "/generate", NORMAL)
        resp = slow.result()
    assert normal.status_code == 200, normal.text
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_stop_regex_still_stops_generation(engine_server, tokenizer):
    body = {"text": "hello", "sampling_params": {"stop_regex": r"[\s\S]", "ignore_eos": True}}
    resp = post(engine_server.url, "/generate", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("pattern", [r"(?<=a)b", r"(a)\1"])
def test_a_stop_regex_re2_cannot_compile_is_a_400(engine_server, tokenizer, pattern):
    body = {"text": "hello", "sampling_params": {"stop_regex": pattern, "max_new_tokens": 4}}
    resp = refused_alongside_a_normal_request(engine_server.url, "/generate", body)
    assert "stop_regex" in error_of(resp) and "RE2" in error_of(resp)


SURROGATE = '"a\\ud800b"'  # a JSON escape of a lone surrogate: valid JSON, no valid UTF-8 form


@pytest.mark.parametrize(
    "path, raw, field",
    [
        ("/generate", '{"text": %s, "sampling_params": {"max_new_tokens": 2}}', "text"),
        ("/generate", '{"text": ["ok", %s], "sampling_params": {"max_new_tokens": 2}}', "text[1]"),
        ("/tokenize", '{"prompt": %s}', "prompt"),
        ("/v1/tokenize", '{"prompt": %s}', "prompt"),
        ("/v1/completions", '{"prompt": %s, "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}',
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(engine_server, tokenizer, path, raw, field):
    resp = refused_alongside_a_normal_request(engine_server.url, path, (raw % SURROGATE).encode())
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert field in message and "surrogate" in message, message


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", lambda text: {"text": text}),
        ("/tokenize", lambda text: {"prompt": text}),
        ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 2}),
        ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}),
    ],
)
def test_a_text_far_over_the_context_is_refused_before_it_is_tokenized(
    engine_server, tokenizer, monkeypatch, path, body
):
    """12 MB of text: refused after tokenizing about two contexts' worth of it, never the whole; the
    memory its body took is handed back to the OS afterwards."""
    trims: list[int] = []
    monkeypatch.setattr(http_limits, "release_freed_memory", lambda: trims.append(1))
    tokenized: list[int] = []
    encode = tokenizer.encode

    def spy(text: str, *args: Any, **kwargs: Any) -> Any:
        tokenized.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    text = "hello world " * 1_000_000
    resp = refused_alongside_a_normal_request(engine_server.url, path, body(text))
    assert resp.status_code == 400
    assert "context" in resp.json()["error"]["message"]
    limit = engine_server.engine.max_context_len
    assert tokenized and max(tokenized) < 100 * limit, tokenized[-3:]  # pieces, not the 12M characters
    assert sum(tokenized) < len(text) // 10
    for _ in range(200):  # the trim is asked for once the response has gone out
        if trims:
            break
        time.sleep(0.05)
    assert trims  # the body was over http_limits.TRIM_AFTER_BYTES


def test_a_long_text_that_fits_is_still_served(engine_server, tokenizer):
    """A text past the direct-tokenizing length (many characters per token) that fits the context."""
    text = " " * (9 * engine_server.engine.max_context_len) + "hello"
    if len(tokenizer.encode(text)) >= engine_server.engine.max_context_len:
        pytest.skip("this tokenizer does not pack runs of spaces")
    resp = post(engine_server.url, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 200, resp.text


def test_stop_token_ids_outside_the_vocabulary_are_a_400(engine_server):
    vocab = engine_server.engine.runner.vocab_size
    body = {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [3, vocab + 7], "max_new_tokens": 2}}
    resp = refused_alongside_a_normal_request(engine_server.url, "/generate", body)
    assert str(vocab + 7) in error_of(resp) and str(vocab) in error_of(resp)
    body["sampling_params"]["stop_token_ids"] = [-1]
    resp = refused_alongside_a_normal_request(engine_server.url, "/generate", body)
    assert "stop_token_ids" in error_of(resp)
    chat = {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [vocab]}
    resp = post(engine_server.url, "/v1/chat/completions", chat)
    assert resp.status_code == 400 and str(vocab) in resp.json()["error"]["message"]


def test_release_freed_memory_trims_once_per_burst():
    """Several large bodies in a row ask for one trim at a time (the heap walk is not free)."""
    for _ in range(3):
        http_limits.release_freed_memory()
    for _ in range(400):  # the pending trim waits at most TRIM_EVERY_S after the last one
        if not http_limits._trim_pending:
            break
        time.sleep(0.05)
    assert not http_limits._trim_pending


def test_submit_reads_ids_of_numpy_or_python_ints_and_refuses_those_outside_the_vocabulary(engine_server):
    """`submit` converts the prompt once (`_id_array`); numpy scalars give the same tokens as Python ints,
    and an id below 0, at the vocabulary's size or past int64 is refused by name."""
    engine = engine_server.engine
    vocab = engine.runner.vocab_size
    params = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0.0}
    plain = engine.submit([5, 6, 7], params).result(timeout=TIMEOUT_S)[0]
    scalars = engine.submit([np.int64(5), np.int32(6), 7], params).result(timeout=TIMEOUT_S)[0]
    assert scalars.output_ids == plain.output_ids and len(plain.output_ids) == 3
    for bad in ([5, -1], [5, vocab], [5, 2**70]):
        with pytest.raises(ValueError, match="outside the vocabulary") as err:
            engine.submit(bad, params)
        assert str(bad[1]) in str(err.value)

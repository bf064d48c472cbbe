"""SGLang's own request and response shapes against `relax engine serve`'s server: what SGLang's Python
frontend (`RuntimeEndpoint` under `sgl.gen` / `sgl.select`) sends on every call, every
`GenerateReqInput` field at its neutral value, streaming, prompt and top log-probs, the info routes,
tokenize / detokenize and `PUT /generate`."""

from __future__ import annotations

import json

import httpx
import pytest

from relax.engine_api.protocol import UNSUPPORTED_GENERATE, UNSUPPORTED_SAMPLING
from tests.engine_helpers import trainer_logprobs


def post(url: str, body, path: str = "/generate") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def frontend_params(**kw) -> dict:
    """The sampling parameters `RuntimeEndpoint.generate` sends for `sgl.gen` (SglSamplingParams
    .to_srt_kwargs plus the two global flags), at their defaults."""
    return {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 8,
        "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 1.0,
        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "ignore_eos": False, "regex": None, "json_schema": None, **kw,
    }  # fmt: skip


def events(resp: httpx.Response) -> list:
    """The `data:` payloads of a server-sent event stream, `[DONE]` as a string."""
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_frontend_gen_request_is_served(engine_server, tokenizer):
    body = {"text": "Hello", "sampling_params": frontend_params(temperature=0), "return_logprob": True}
    resp = post(engine_server.url, body)
    assert resp.status_code == 200, resp.text
    item = resp.json()
    assert item["meta_info"]["completion_tokens"] == len(item["output_ids"]) > 0
    assert item["text"] == tokenizer.decode(item["output_ids"], skip_special_tokens=True)
    # return_logprob alone: output log-probs, and the last prompt token (no log-prob) as input
    assert len(item["meta_info"]["output_token_logprobs"]) == len(item["output_ids"])
    last = tokenizer.encode("Hello")[-1]
    assert item["meta_info"]["input_token_logprobs"] == [[None, last, None]]


def test_every_generate_field_at_its_neutral_value_is_accepted(engine_server):
    body = {"input_ids": [1, 2, 3], "sampling_params": {**UNSUPPORTED_SAMPLING, "max_new_tokens": 2}}
    body.update(UNSUPPORTED_GENERATE)
    body.update({"log_metrics": False, "session_id": "s", "routing_key": "k", "cache_salt": "x"})
    resp = post(engine_server.url, body)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    ("field", "value"),
    [("image_data", "img.png"), ("lora_path", "adapter"), ("return_hidden_states", True), ("priority", 3)],
)
def test_an_unsupported_generate_field_is_refused_by_name(engine_server, field, value):
    resp = post(engine_server.url, {"input_ids": [1, 2], field: value})
    assert resp.status_code == 400
    assert field in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"), [("repetition_penalty", 1.3), ("structural_tag", "{}"), ("beam_width", 4)]
)
def test_an_unsupported_sampling_field_is_refused_by_name(engine_server, field, value):
    resp = post(engine_server.url, {"input_ids": [1, 2], "sampling_params": {field: value}})
    assert resp.status_code == 400
    assert field in resp.json()["error"]["message"]


def test_select_scores_choices_with_prompt_logprobs(engine_server, tokenizer, reference_model):
    """`sgl.select`: a batch of texts, max_new_tokens 0, log-probs of the prompt from a start position,
    with token text; they equal the trainer's log-softmax of the same model."""
    choices = [" yes", " no"]
    prompts = ["Is 2+2 4?" + c for c in choices]
    start = 2
    body = {"text": prompts, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start}  # fmt: skip
    resp = post(engine_server.url, body)
    assert resp.status_code == 200, resp.text
    items = resp.json()
    assert len(items) == 2
    for text, item in zip(prompts, items, strict=True):
        ids = tokenizer.encode(text)
        lps = item["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in lps] == ids[start:]
        assert lps[0][0] is None and all(isinstance(s, str) for _, _, s in lps)
        expected = trainer_logprobs(reference_model, ids[: start + 1], ids[start + 1 :])
        got = [lp for lp, _, _ in lps[1:]]
        assert got == pytest.approx(expected.tolist(), abs=1e-4)
        assert item["meta_info"]["output_token_logprobs"] == [] and item["output_ids"] == []


def test_top_logprobs_hold_the_sampled_token_when_greedy(engine_server):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}  # fmt: skip
    meta = post(engine_server.url, body).json()["meta_info"]
    out, top = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(top) == len(out) == 5
    for (lp, tok, _), alts in zip(out, top, strict=True):
        assert len(alts) == 3 and [a[0] for a in alts] == sorted((a[0] for a in alts), reverse=True)
        assert alts[0][1] == tok and alts[0][0] == pytest.approx(lp, abs=1e-5)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 3
    assert all(len(a) == 3 for a in meta["input_top_logprobs"][1:])


def test_stream_sends_cumulative_chunks_then_done(engine_server, tokenizer):
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = post(engine_server.url, {"text": "Once upon", "sampling_params": params}).json()
    resp = post(
        engine_server.url,
        {"text": "Once upon", "sampling_params": params, "stream": True, "return_logprob": True},
    )
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    chunks = events(resp)
    assert chunks[-1] == "[DONE]"
    data = chunks[:-1]
    # One chunk per token, then the finished sample; a busy host may merge tokens that the stream's
    # writer had not yet sent into one chunk, so the check is that chunks grow and are cumulative.
    lengths = [len(c["output_ids"]) for c in data[:-1]]
    assert lengths and lengths == sorted(set(lengths)) and set(lengths) <= {1, 2, 3, 4, 5, 6}
    assert all(c["output_ids"] == data[-1]["output_ids"][: len(c["output_ids"])] for c in data)
    assert all(c["meta_info"]["finish_reason"] is None for c in data[:-1])
    texts = [c["text"] for c in data]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # a client's text[pos:] works
    last = data[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert len(last["meta_info"]["output_token_logprobs"]) == 6


def test_stream_of_several_samples_tells_them_apart_by_index(engine_server):
    params = {"max_new_tokens": 3, "n": 2, "ignore_eos": True, "stream_interval": 3}
    body = {"input_ids": [[1, 2], [3, 4]], "sampling_params": params, "stream": True}
    data = events(post(engine_server.url, body))[:-1]
    finals = [c for c in data if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1, 2, 3]
    partial = [c for c in data if c["meta_info"]["finish_reason"] is None]
    assert all(len(c["output_ids"]) == 3 for c in partial)  # stream_interval: one chunk per 3 tokens


def test_put_generate_and_server_info(engine_server):
    resp = httpx.put(
        engine_server.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    )
    assert resp.status_code == 200 and len(resp.json()["output_ids"]) <= 2
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(engine_server.url + path, timeout=10).json()
        assert info["model_path"] == engine_server.engine.runner.model_path
        assert info["version"] and info["max_total_num_tokens"] > 0 and "internal_states" in info


def test_tokenize_and_detokenize_round_trip(engine_server, tokenizer):
    got = post(engine_server.url, {"prompt": "hello world"}, "/tokenize").json()
    assert got["tokens"] == tokenizer.encode("hello world") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == engine_server.engine.max_context_len
    batch = post(engine_server.url, {"prompt": ["a", "bc"]}, "/tokenize").json()
    assert batch["count"] == [len(t) for t in batch["tokens"]]
    text = post(engine_server.url, {"tokens": got["tokens"]}, "/detokenize").json()["text"]
    assert text == "hello world"
    assert post(engine_server.url, {"tokens": [10**7]}, "/detokenize").status_code == 400


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_a_streaming_client_that_hangs_up_has_its_request_aborted(engine_server, route):
    import time

    engine = engine_server.engine
    if route == "/generate":
        body = {
            "input_ids": [1, 2, 3],
            "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
        }
    else:
        body = {"prompt": [1, 2, 3], "stream": True, "max_tokens": 1500, "ignore_eos": True}
    httpx.post(engine_server.url + "/slow_down", json={"forward_sleep_time": 0.01}, timeout=10)
    try:
        with httpx.stream("POST", engine_server.url + route, json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    break  # one chunk, then hang up
        deadline = time.monotonic() + 20
        while engine.metrics().num_running + engine.metrics().num_waiting > 0:
            assert time.monotonic() < deadline, "the request kept running after its client left"
            time.sleep(0.05)
    finally:
        httpx.post(engine_server.url + "/slow_down", json={"forward_sleep_time": None}, timeout=10)

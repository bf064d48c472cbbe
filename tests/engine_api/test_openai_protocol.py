"""Protocol details of the engine's `/v1` routes and `/generate` that clients rely on (issue 46):
`echo` with prompt log-probs (lm-eval's scoring request), penalties and `min_new_tokens`, a tool call cut
by `max_tokens`, a grammar the model cannot follow, ASCII `\\d` / `\\w` in `regex`, and unknown model
names. Each against the shared tiny-model engine server (tests/engine_fixtures.py)."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import torch


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


@pytest.fixture
def model(engine_server) -> str:
    return Path(engine_server.engine.runner.model_path).name


def test_echo_scores_the_prompt_as_lm_eval_reads_it(engine_server, model, reference_model):
    """lm-eval's request: prompts as token ids (a batch), max_tokens 1, logprobs 1, echo; each prompt
    token's log-prob is the trainer's log_softmax at the position before it."""
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 200]]
    body = {"model": model, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}  # fmt: skip
    resp = _post(engine_server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    tok = engine_server.engine.tokenizer
    for ids, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # prompt + the one generated token
        assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        with torch.no_grad():
            logp = torch.log_softmax(reference_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        for k in range(1, len(ids)):
            assert math.isclose(lp["token_logprobs"][k], logp[k - 1, ids[k]].item(), abs_tol=1e-4)
            (best,) = lp["top_logprobs"][k].values()
            assert math.isclose(best, logp[k - 1].max().item(), abs_tol=1e-4)
            greedy = ids[k] == int(logp[k - 1].argmax())
            assert (lp["token_logprobs"][k] == best) == greedy  # lm-eval's is_greedy test, exact
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and all(
            b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp["tokens"], strict=False)
        )
        assert choice["text"].startswith(tok.decode(ids))


def test_echo_without_logprobs_and_with_a_text_prompt(engine_server, model):
    body = {"model": model, "prompt": "hello there", "max_tokens": 0, "echo": True}
    resp = _post(engine_server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    assert choice["text"] == "hello there" and choice["logprobs"] is None
    resp = _post(engine_server, "/v1/completions", {**body, "stream": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"


PROMPT = [11, 22, 33, 44, 55]


def _generate(server, params: dict, prompt: list[int] = PROMPT) -> dict:
    body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
    resp = _post(server, "/generate", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_penalties_follow_openai_formula(engine_server, reference_model):
    """Greedy with presence 0.5 and frequency 0.7: each token is the argmax of the trainer's logits
    minus 0.5 * [generated before] + 0.7 * (times generated before), and its log-prob is of those."""
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "presence_penalty": 0.5,
              "frequency_penalty": 0.7}  # fmt: skip
    out = _generate(engine_server, params)
    ids = out["output_ids"]
    with torch.no_grad():
        logits_TV = reference_model(torch.tensor([PROMPT + ids])).logits[0].float()
    for k, t in enumerate(ids):
        counts_V = torch.bincount(
            torch.tensor(ids[:k], dtype=torch.long), minlength=logits_TV.shape[1]
        ).float()
        row_V = logits_TV[len(PROMPT) + k - 1] - 0.5 * (counts_V > 0).float() - 0.7 * counts_V
        assert int(row_V.argmax()) == t
        lp = out["meta_info"]["output_token_logprobs"][k][0]
        assert math.isclose(lp, torch.log_softmax(row_V, -1)[t].item(), abs_tol=1e-4)


def test_presence_penalty_stops_greedy_repeats(engine_server):
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    free = _generate(engine_server, params)["output_ids"]
    assert len(set(free)) < len(free)  # the tiny model repeats itself greedily
    penalized = _generate(engine_server, {**params, "presence_penalty": 2.0})["output_ids"]
    assert len(set(penalized)) > len(set(free))


def test_min_new_tokens_masks_eos(engine_server, model):
    eos = min(engine_server.engine.runner.eos_token_ids)
    params = {"max_new_tokens": 20, "temperature": 0, "logit_bias": {str(eos): 100.0}}
    assert _generate(engine_server, params)["output_ids"] == [eos]  # EOS forced at once
    out = _generate(engine_server, {**params, "min_new_tokens": 6})
    assert out["output_ids"][:6].count(eos) == 0 and out["output_ids"][6:] == [eos]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    bad = _post(
        engine_server,
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}},
    )
    assert bad.status_code == 400 and "min_new_tokens" in bad.text
    # /v1: OpenAI's penalties and vLLM's / SGLang's min_tokens
    body = {"model": model, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "min_tokens": 6,
            "logit_bias": {str(eos): 100.0}, "presence_penalty": 0.5, "frequency_penalty": 0.5}  # fmt: skip
    resp = _post(engine_server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 7


def test_a_tool_call_cut_by_max_tokens_is_length_with_the_text_as_generated(engine_server, model):
    from tests.openai_checks import TOOLS, USER

    body = {"model": model, "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 8,
            "temperature": 1.0, "seed": 3}  # fmt: skip
    resp = _post(engine_server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")
    content = choice["message"]["content"]
    assert content.startswith("<tool_call>") and "</tool_call>" not in content  # no tag the model never wrote
    with httpx.stream("POST", engine_server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    import json

    finishes = [
        c["finish_reason"] for line in lines for c in json.loads(line[6:])["choices"] if c["finish_reason"]
    ]
    assert finishes == ["length"]


def test_finish_reason_is_length_when_the_last_call_is_cut():
    from relax.engine_api.openai.backend import Choice
    from relax.engine_api.openai.replies import finish_reason

    done, cut = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "\n<tool_call>\n{"
    assert finish_reason(Choice([1], [0.0], "length", done + cut), [{"id": "call"}]) == "length"
    assert finish_reason(Choice([1], [0.0], "length", done), [{"id": "call"}]) == "tool_calls"
    assert finish_reason(Choice([1], [0.0], "stop", done), [{"id": "call"}]) == "tool_calls"
    assert finish_reason(Choice([1], [0.0], "abort", "x"), []) == "abort"


def test_a_grammar_the_model_cannot_follow_is_a_short_abort_and_a_v1_error(engine_server, model):
    params = {"regex": "<tool_call>[0-9]+", "max_new_tokens": 5, "temperature": 0}
    finish = _generate(engine_server, params)["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["message"].startswith("grammar: ")
    assert "<state>" not in finish["message"] and len(finish["message"]) < 400
    body = {"model": model, "prompt": PROMPT, "regex": "<tool_call>[0-9]+", "max_tokens": 5, "temperature": 0}
    resp = _post(engine_server, "/v1/completions", body)
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "regex" and err["message"].startswith("grammar: ")


def test_regex_digit_and_word_classes_are_ascii(engine_server):
    """As SGLang's default grammar backend reads them: `\\d` is [0-9] (llguidance alone would also allow
    every Unicode digit, which a random tiny model picks often)."""
    import re

    for seed in range(3):
        params = {
            "regex": r"\d{6} \w{3}",
            "max_new_tokens": 40,
            "temperature": 1.0,
            "n": 4,
            "sampling_seed": seed,
        }
        body = {"input_ids": PROMPT, "sampling_params": params}
        outs = _post(engine_server, "/generate", body).json()
        for out in outs:
            assert re.fullmatch(r"[0-9]{6} [0-9A-Za-z_]{3}", out["text"]), out["text"]


def test_an_unknown_model_is_404_model_not_found(engine_server, model):
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
    ]:
        resp = _post(engine_server, path, {**body, "model": "gpt-4o"})
        err = resp.json()["error"]
        assert resp.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
        assert "gpt-4o" in err["message"] and model in err["message"]
        # the name /v1/models lists, the model path as the server was given it, or no name at all
        listed = httpx.get(engine_server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for name in (listed, engine_server.engine.runner.model_path, None):
            resp = _post(engine_server, path, {**body, "model": name} if name else body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == (name or model)
    assert (
        httpx.get(engine_server.url + "/v1/models/gpt-4o", timeout=30).json()["error"]["code"]
        == "model_not_found"
    )

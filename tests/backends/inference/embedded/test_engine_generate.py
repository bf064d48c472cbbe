"""`/generate` against a real embedded engine server on 127.0.0.1: greedy decoding, seeds, n samples,
log-probs against a trainer forward, stop rules, length limits and batched input."""

from __future__ import annotations

import asyncio

import torch

from relax.engine_api.client import EngineClient, GenerateOutput
from tests.engine_helpers import greedy_reference, run, trainer_logprobs

PROMPT = [11, 22, 33, 44, 55]


def test_greedy_equals_argmax_of_a_manual_forward(client, reference_model):
    out = run(client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}))
    assert isinstance(out, GenerateOutput)
    assert out.output_ids == greedy_reference(reference_model, PROMPT, 12)
    assert out.finish_reason == "length" and out.prompt_tokens == len(PROMPT)
    assert out.weight_version == "0" and len(out.output_log_probs) == 12


def test_top_k_1_is_greedy(client, reference_model):
    out = run(
        client.generate(PROMPT, {"max_new_tokens": 6, "top_k": 1, "ignore_eos": True, "sampling_seed": 5})
    )
    assert out.output_ids == greedy_reference(reference_model, PROMPT, 6)


def test_logprobs_match_a_full_trainer_forward_at_temperature_1(client, reference_model):
    prompts = [[7, 8, 9], list(range(100, 117)), [300]]

    async def go():
        params = {"max_new_tokens": 24, "temperature": 1.0, "n": 2, "ignore_eos": True}
        return await asyncio.gather(*(client.generate(p, params) for p in prompts))

    for prompt, outs in zip(prompts, run(go()), strict=True):
        assert len(outs) == 2
        for out in outs:
            ref = trainer_logprobs(reference_model, prompt, out.output_ids)
            assert torch.allclose(torch.tensor(out.output_log_probs), ref, atol=1e-4), (
                ref,
                out.output_log_probs,
            )


def test_seeded_requests_are_deterministic_whatever_the_batch(client):
    params = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    alone = run(client.generate(PROMPT, params)).output_ids

    async def crowded():
        noise = [
            client.generate([i + 1] * (3 + i), {"max_new_tokens": 20 + i, "ignore_eos": True})
            for i in range(5)
        ]
        results = await asyncio.gather(*noise, client.generate(PROMPT, params))
        return results[-1]

    assert run(crowded()).output_ids == alone
    other = run(client.generate(PROMPT, {**params, "sampling_seed": 99})).output_ids
    assert other != alone


def test_n_samples_share_the_prompt_and_differ(client):
    outs = run(client.generate(PROMPT, {"max_new_tokens": 16, "n": 4, "ignore_eos": True}, rid="grp"))
    assert [o.rid for o in outs] == ["grp-0", "grp-1", "grp-2", "grp-3"]
    assert len({tuple(o.output_ids) for o in outs}) == 4


def test_batched_input_returns_a_list_grouped_by_prompt(client):
    outs = run(client.generate([[1, 2], [3, 4, 5]], {"max_new_tokens": 3, "n": 2, "ignore_eos": True}))
    assert [o.prompt_tokens for o in outs] == [2, 2, 3, 3]
    assert all(len(o.output_ids) == 3 for o in outs)


def test_max_new_tokens_and_zero(client):
    out = run(client.generate(PROMPT, {"max_new_tokens": 5, "ignore_eos": True}))
    assert len(out.output_ids) == 5 and out.finish_reason == "length"
    none = run(client.generate(PROMPT, {"max_new_tokens": 0}))
    assert none.output_ids == [] and none.finish_reason == "length"


def test_stop_token_ids_end_generation_and_are_kept(client, reference_model):
    greedy = greedy_reference(reference_model, PROMPT, 10)
    stop = greedy[4]
    first = greedy.index(stop)
    out = run(client.generate(PROMPT, {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop]}))
    assert out.output_ids == greedy[: first + 1]
    assert out.finish_reason == "stop" and out.matched == stop


def test_stop_strings_cut_the_text(client, tokenizer):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = run(client.generate(PROMPT, params))
    text = tokenizer.decode(full.output_ids, skip_special_tokens=False)
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip())
    out = run(client.generate(PROMPT, {**params, "stop": [stop]}))
    assert out.finish_reason == "stop" and out.matched == stop
    assert out.output_ids == full.output_ids[: len(out.output_ids)]
    assert stop in tokenizer.decode(out.output_ids, skip_special_tokens=False)
    assert stop not in out.text and full.text.startswith(out.text)


def test_text_input_and_text_output(client, tokenizer):
    raw = run(
        EngineClient(client.base_url)._request(
            "POST",
            "/generate",
            {
                "text": "hello world",
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            },
        )
    ).json()
    assert raw["meta_info"]["prompt_tokens"] == len(tokenizer.encode("hello world"))
    assert raw["text"] == tokenizer.decode(raw["output_ids"], skip_special_tokens=True)

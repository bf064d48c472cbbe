"""Multi-turn rollouts against a real embedded engine: response tokens are exactly the generated turns and
the appended observations, loss mask 1 and engine log-probs on model tokens only (the log-probs equal
the trainer's forward at those positions), and every way an episode ends."""

from __future__ import annotations

import pytest
import torch
from agentic_helpers import agent_config, run

from relax.agentic.rollout import agent_factory
from relax.data.dataset import PromptRow
from relax.rewards import build_scorer
from relax.rollout.loop import RolloutLoop
from relax.rollout.router import Router

ECHO = "tests.agentic.agent_envs:make_echo"
FORCED = "tests.agentic.agent_envs:make_forced"


async def _episodes(cfg, tokenizer, url, prompt="3+4=", n_rows=1):
    router = Router([url], timeout_s=120)
    loop = RolloutLoop(cfg, tokenizer, router, build_scorer(cfg.reward), agent_factory(cfg, tokenizer))
    try:
        groups = [
            await loop._generate_group(PromptRow(i, prompt), i, loop.sampling_params()) for i in range(n_rows)
        ]
    finally:
        await router.close()
    return [s for g in groups for s in g]


def _trainer_logprobs(model, prompt, response):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)


def test_masks_and_logprobs_line_up_with_the_turns(engine_server, tokenizer, reference_model, tiny_model_dir):
    cfg = agent_config(
        tiny_model_dir,
        kind="multi_turn",
        env=ECHO,
        max_turns=3,
        max_total_tokens=200,
        end_on_truncated_turn=False,
    )
    samples = run(_episodes(cfg, tokenizer, engine_server.url))
    assert len(samples) == 2
    for s in samples:
        assert s.termination == "max_turns" and len(s.turns) == 3
        assert len(s.response_ids) == len(s.loss_mask) == len(s.rollout_log_probs)
        expected_mask = [0] * s.response_length
        pos = 0
        for i, t in enumerate(s.turns):
            assert t["start"] == pos  # turns and observations tile the response
            expected_mask[t["start"] : t["end"]] = [1] * (t["end"] - t["start"])
            assert 1 <= t["end"] - t["start"] <= 6
            assert t["text"] == tokenizer.decode(
                s.response_ids[t["start"] : t["end"]], skip_special_tokens=False
            )
            pos = t["end"]
            if i < 2:  # an observation after every turn but the last
                obs = s.response_ids[t["obs_start"] : t["obs_end"]]
                ended = s.response_ids[t["end"] - 1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
                text = ("" if ended else "<|im_end|>") + (
                    f"\n<|im_start|>user\nturn {i} seen<|im_end|>\n<|im_start|>assistant\n"
                )
                assert obs == tokenizer.encode(text, add_special_tokens=False)
                assert t["obs_start"] == t["end"]
                pos = t["obs_end"]
            else:
                assert "obs_start" not in t  # nothing is appended after the last turn
        assert pos == s.response_length
        assert s.loss_mask == expected_mask
        assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m == 0)
        # behaviour log-probs are the model's own at the model tokens of the full multi-turn sequence
        ref = _trainer_logprobs(reference_model, s.prompt_ids, s.response_ids)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        engine = torch.tensor(s.rollout_log_probs)
        assert torch.allclose(engine[mask], ref[mask], atol=2e-3)
        assert s.weight_versions == [0]


def test_turn_limit_and_token_budget(engine_server, tokenizer, tiny_model_dir):
    one = agent_config(tiny_model_dir, kind="multi_turn", env=ECHO, max_turns=1, end_on_truncated_turn=False)
    for s in run(_episodes(one, tokenizer, engine_server.url)):
        assert s.termination == "max_turns" and len(s.turns) == 1
        assert s.loss_mask == [1] * s.response_length  # no observation after the last turn

    # 6 + ~20 observation tokens do not fit in 12: the episode ends before the observation
    tight = agent_config(
        tiny_model_dir,
        kind="multi_turn",
        env=ECHO,
        max_turns=5,
        max_total_tokens=12,
        end_on_truncated_turn=False,
    )
    for s in run(_episodes(tight, tokenizer, engine_server.url)):
        assert s.termination == "token_budget"
        assert s.response_length <= 12 and len(s.turns) == 1

    # budget 8 with turns of 6 and a short observation: the second turn gets only what is left
    cfg = agent_config(
        tiny_model_dir,
        kind="multi_turn",
        env=ECHO,
        env_kwargs={"reply": ""},
        max_turns=5,
        max_total_tokens=30,
        end_on_truncated_turn=False,
    )
    for s in run(_episodes(cfg, tokenizer, engine_server.url)):
        assert s.response_length <= 30
        assert s.termination in ("token_budget", "max_turns")

    ends = agent_config(tiny_model_dir, kind="multi_turn", env=ECHO, max_turns=3)
    # a turn that ends without an end-of-turn token ends the episode; the turns before it ended with one
    # (`<|im_end|>` or the other EOS, `<|endoftext|>`, whichever the sampler drew)
    end_ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    for s in run(_episodes(ends, tokenizer, engine_server.url)):
        if s.response_ids[-1] not in end_ids:
            assert s.termination == "turn_truncated"
            assert all(s.response_ids[t["end"] - 1] in end_ids for t in s.turns[:-1])


@pytest.mark.parametrize(
    ("tool", "error", "text"),
    [
        ("hang", "timeout", "Error: hang timed out after 0.3s"),  # async tool past its timeout
        ("slow", "timeout", "Error: slow timed out after 0.3s"),  # sync tool (thread) past its timeout
        ("boom", "exception", "Error: RuntimeError: the tool broke"),
    ],
)
def test_failing_and_hanging_tools_become_error_observations(
    engine_server, tokenizer, tiny_model_dir, tool, error, text
):
    cfg = agent_config(
        tiny_model_dir,
        kind="multi_turn",
        env=FORCED,
        env_kwargs={"tool": tool},
        tool_timeout_s=0.3,
        max_turns=2,
        end_on_truncated_turn=False,
    )
    samples = run(_episodes(cfg, tokenizer, engine_server.url))
    for s in samples:
        assert len(s.turns) == 2 and s.termination == "max_turns"  # the episode went on after the failure
        first = s.turns[0]
        assert first["results"] == [{"name": tool, "ok": False, "error": error, "text": text}]
        obs = tokenizer.decode(
            s.response_ids[first["obs_start"] : first["obs_end"]], skip_special_tokens=False
        )
        assert f"<tool_response>\n{text}\n</tool_response>" in obs
    from relax.rollout.metrics import agent_metrics

    m = agent_metrics(samples)
    assert m["agent/tool_error_rate"] == 1.0
    assert m["agent/tool_timeout_rate"] == (1.0 if error == "timeout" else 0.0)

"""GenRM without Ray: configuration, judge prompt, verdict parsing, request batching, and the role's
judging logic over a fake engine router."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from relax.config import load_config
from relax.orchestration.registry import roles_for
from relax.rewards import GenRMConfig, RewardConfig, build_scorer
from relax.rewards.genrm import DEFAULT_JUDGE_TEMPLATE, parse_verdict, question_text, render_judge_prompt
from relax.rewards.scorer import RewardScorer
from relax.roles.genrm import GenRMRole
from relax.utils.microbatch import MicroBatcher

SCORES = {"CORRECT": 1.0, "INCORRECT": 0.0}
PATTERN = GenRMConfig(model_path="m").verdict_pattern


# -- prompt ------------------------------------------------------------------------------------
def test_default_template_asks_for_a_strict_verdict() -> None:
    text = render_judge_prompt(DEFAULT_JUDGE_TEMPLATE, "3+4=", "It is {7}.", 7)
    assert "Question:\n3+4=" in text and "Response:\nIt is {7}." in text and "Reference answer:\n7" in text
    assert "Verdict: CORRECT" in text and "Verdict: INCORRECT" in text
    assert render_judge_prompt("{response}|{reference}", "q", "r", None) == "r|"


def test_template_fields_are_checked() -> None:
    GenRMConfig(model_path="m", prompt_template="Q {question} {{literal}} R {response}")
    with pytest.raises(ValidationError, match="unknown fields \\['answer'\\]"):
        GenRMConfig(model_path="m", prompt_template="{question} {answer}")
    with pytest.raises(ValidationError, match="not a valid format string"):
        GenRMConfig(model_path="m", prompt_template="{question")
    with pytest.raises(ValidationError, match="group capturing the verdict"):
        GenRMConfig(model_path="m", verdict_pattern="Verdict: CORRECT")


def test_question_of_chat_messages_is_the_last_user_turn() -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": [{"type": "text", "text": "and 2+2="}, {"type": "image"}]},
    ]
    assert question_text(msgs) == "and 2+2= " and question_text("plain") == "plain"


# -- verdicts ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "verdict"),
    [
        ("Verdict: CORRECT", "CORRECT"),
        ("  Verdict: INCORRECT\n", "INCORRECT"),
        ("Verdict:CORRECT.", "CORRECT"),
        ("Verdict: correct", None),  # strict case
        ("The response is right. Verdict: CORRECT", None),  # nothing but the verdict line
        ("Verdict: CORRECT because 7 = 7", None),
        ("Verdict: MAYBE", None),
        ("", None),
        ("Verdict: CORRECT Verdict: INCORRECT", None),
    ],
)
def test_parse_verdict_is_strict(answer: str, verdict: str | None) -> None:
    assert parse_verdict(answer, PATTERN, SCORES) == verdict


def test_parse_verdict_with_reasoning_pattern_and_unknown_verdicts() -> None:
    pattern = r"(?s).*?Verdict:\s*(CORRECT|INCORRECT|PARTIAL)"
    assert parse_verdict("7 equals 7.\nVerdict: CORRECT", pattern, SCORES) == "CORRECT"
    assert parse_verdict("Verdict: PARTIAL", pattern, SCORES) is None  # not a scored verdict
    assert parse_verdict("Verdict: PARTIAL", pattern, {**SCORES, "PARTIAL": 0.5}) == "PARTIAL"


# -- configuration and roles -------------------------------------------------------------------
def test_genrm_reward_needs_the_service_config() -> None:
    with pytest.raises(ValidationError, match="reward.genrm.model_path"):
        RewardConfig(name="genrm")
    cfg = RewardConfig(name="genrm", genrm={"model_path": "/judge", "max_batch_size": 8})
    assert cfg.genrm is not None and cfg.genrm.max_batch_size == 8
    assert isinstance(build_scorer(cfg), RewardScorer)


def test_genrm_role_is_deployed_only_when_configured(tiny_model_dir, arith_file) -> None:
    base = [f"model.path={tiny_model_dir}", f"data.train_files=[{arith_file}]"]
    plain = load_config(None, base)
    judged = load_config(None, [*base, "reward.name=genrm", f"reward.genrm.model_path={tiny_model_dir}"])
    assert [r.name for r in roles_for(plain)] == ["rollout", "actor"]
    roles = roles_for(judged)
    assert [r.name for r in roles] == ["rollout", "actor", "genrm"] and roles[-1].cls is GenRMRole


# -- batching ----------------------------------------------------------------------------------
def test_microbatcher_gathers_concurrent_requests() -> None:
    batches: list[list[int]] = []

    async def double(items: list[int]) -> list[int]:
        batches.append(items)
        await asyncio.sleep(0.01)
        return [2 * i for i in items]

    async def main() -> list[list[int]]:
        b = MicroBatcher(double, max_items=5, wait_s=0.05)
        return await asyncio.gather(b.submit([1, 2]), b.submit([3]), b.submit([4, 5]), b.submit([6]))

    assert asyncio.run(main()) == [[2, 4], [6], [8, 10], [12]]
    assert batches == [[1, 2, 3, 4, 5], [6]]  # the first batch filled up; the rest waited wait_s


def test_microbatcher_hands_errors_to_every_caller() -> None:
    async def broken(items: list[int]) -> list[int]:
        raise RuntimeError("engine down")

    async def main() -> list[object]:
        b = MicroBatcher(broken, max_items=10, wait_s=0.0)
        return await asyncio.gather(b.submit([1]), b.submit([2]), return_exceptions=True)

    assert [str(e) for e in asyncio.run(main())] == ["engine down", "engine down"]


# -- the role over a fake engine ---------------------------------------------------------------
class FakeOutput:
    def __init__(self, text: str) -> None:
        self.text, self.output_ids = text, []


class FakeRouter:
    """Answers by the reference in the prompt: 'even' -> CORRECT, 'odd' -> INCORRECT, else junk."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[int, dict]] = []

    async def generate(self, prompts: list[list[int]], params: dict, **kwargs) -> list[FakeOutput]:
        self.calls.append((len(prompts), params))
        texts = [self.tokenizer.decode(p) for p in prompts]
        answers = {"even": "Verdict: CORRECT", "odd": "Verdict: INCORRECT"}
        return [
            FakeOutput(next((a for k, a in answers.items() if f"Ref {k}" in t), "no idea")) for t in texts
        ]

    async def close(self) -> None:
        pass


def test_role_batches_judge_calls_and_parses_verdicts(tiny_model_dir) -> None:
    cfg = GenRMConfig(
        model_path=str(tiny_model_dir),
        engine_urls=["http://127.0.0.1:9"],  # attach: no engine is started (the router is replaced)
        prompt_template="Q {question} A {response} Ref {reference}",
        verdict_scores={"CORRECT": 1.0, "INCORRECT": -1.0},
        unparsed_score=-5.0,
        batch_wait_s=0.05,
    )
    role = GenRMRole(cfg)
    role.router = FakeRouter(role.tokenizer)
    prompt = role.tokenizer.decode(role.prompt_ids({"question": "q", "response": "r", "reference": "even"}))
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    assert "Q q A r Ref even" in prompt

    def items(*refs: str) -> list[dict]:
        return [{"question": "1+1=", "response": "2", "reference": r} for r in refs]

    async def main():
        return await asyncio.gather(role.judge(items("even", "odd")), role.judge(items("other", "even")))

    first, second = asyncio.run(main())
    assert first.scores == [1.0, -1.0] and first.verdicts == ["CORRECT", "INCORRECT"]
    assert second.scores == [-5.0, 1.0] and second.verdicts == [None, "CORRECT"]
    assert first.latency_s > 0 and second.texts[0] == "no idea"
    assert len(role.router.calls) == 1 and role.router.calls[0][0] == 4  # one batched /generate
    params = role.router.calls[0][1]
    assert params["temperature"] == 0.0 and params["n"] == 1 and params["stop_token_ids"]
    assert role.metrics() == {
        "genrm/calls": 4.0,
        "genrm/unparsed": 1.0,
        "genrm/batches": 1.0,
        "genrm/latency_mean_s": pytest.approx((first.latency_s + second.latency_s) / 2),
    }

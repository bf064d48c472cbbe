"""GenRM: an LLM judge as a reward. This module holds what the reward side and the judge service share —
the configuration, the judge prompt and the verdict parser — and the ``genrm`` reward itself, which asks
the GenRM service (the Serve application ``genrm``, ``relax.roles.genrm.GenRMRole``) by handle.

The judge is asked, per sample, whether the response's final answer matches the reference (the sample's
``label``) and must answer with a strict verdict line; the verdict maps to a score
(``GenRMConfig.verdict_scores``), and an answer without a verdict gets ``unparsed_score`` and is counted.

Metrics the ``genrm`` reward puts in ``sample.reward_info`` (averaged over samples by ``RewardStats``):
``genrm/latency_s`` (seconds of the judge batch that scored the sample), ``genrm/unparsed`` (1 when the
judge's answer had no verdict, so its mean is the unparsed fraction) and ``genrm/correct`` (1 for a
CORRECT verdict).
"""

from __future__ import annotations

import logging
import re
import string
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax.data.sample import Sample
from relax.rewards.extract import after_reasoning

logger = logging.getLogger(__name__)

GENRM_APP = "genrm"  # Serve application name of the judge service
TEMPLATE_FIELDS = ("question", "response", "reference")

DEFAULT_JUDGE_TEMPLATE = (
    "You are a strict grader. Decide whether the final answer of the response matches the reference "
    "answer. Ignore the reasoning and formatting; compare only the final answers.\n\n"
    "Question:\n{question}\n\n"
    "Response:\n{response}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Answer with exactly one line and nothing else: `Verdict: CORRECT` if the final answer matches the "
    "reference, or `Verdict: INCORRECT` if it does not."
)
DEFAULT_VERDICT_PATTERN = r"Verdict:\s*(CORRECT|INCORRECT)\.?"


class GenRMConfig(BaseModel):
    """The GenRM service: its judge model and engines, its prompt, and how a verdict becomes a score."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(
        ..., description="Judge checkpoint folder (Hugging Face layout); its tokenizer's chat template "
        "renders the judge prompt, and the embedded engines load it unless `engine_urls` is given."
    )  # fmt: skip
    engine_urls: list[str] = Field(
        default_factory=list,
        description="Attach to these running engines (embedded or SGLang) instead of starting engines.",
    )
    num_engines: int = Field(1, gt=0, description="Embedded judge engines to start.")
    engine_cpus: float = Field(1.0, gt=0, description="Logical Ray CPUs reserved per judge engine.")
    engine_threads: int = Field(1, gt=0, description="torch intra-op threads of each judge engine (CPU).")
    engine_max_running: int = Field(64, gt=0, description="Max concurrently decoded requests per engine.")
    dtype: str = Field("float32", description="Parameter dtype of the judge engines.")
    num_cpus: float = Field(0.5, gt=0, description="Logical Ray CPUs reserved for the GenRM replica.")
    prompt_template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        description="Judge prompt (the user turn), a Python format string with the fields {question}, "
        "{response} and {reference}; write literal braces as {{ and }}.",
    )
    system_prompt: str | None = Field(None, description="System turn of the judge chat (None: template's).")
    apply_chat_template: bool = Field(True, description="Wrap the prompt in the judge's chat template.")
    max_new_tokens: int = Field(32, gt=0, description="Most tokens the judge may write per verdict.")
    verdict_pattern: str = Field(
        DEFAULT_VERDICT_PATTERN,
        description="Regex that must match the judge's whole answer (stripped, after a <think> block; "
        "re.fullmatch) with one group capturing the verdict; prefix it with (?s).*? to allow reasoning "
        "before the verdict.",
    )
    verdict_scores: dict[str, float] = Field(
        default_factory=lambda: {"CORRECT": 1.0, "INCORRECT": 0.0},
        description="Score of each verdict the pattern captures; a captured verdict not listed is unparsed.",
    )
    unparsed_score: float = Field(0.0, description="Score of a sample whose judge answer has no verdict.")
    max_batch_size: int = Field(64, gt=0, description="Most judge prompts sent in one /generate.")
    batch_wait_s: float = Field(
        0.02, ge=0, description="Seconds a judge batch waits for more requests before it is sent."
    )
    request_timeout_s: float = Field(300.0, gt=0, description="Seconds one judge /generate may take.")

    @field_validator("prompt_template")
    @classmethod
    def _template_fields(cls, template: str) -> str:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        except ValueError as e:
            raise ValueError(f"genrm.prompt_template is not a valid format string ({e}); "
                             "write literal braces as {{ and }}") from e  # fmt: skip
        unknown = names - set(TEMPLATE_FIELDS)
        if unknown:
            raise ValueError(
                f"genrm.prompt_template uses unknown fields {sorted(unknown)}; the fields are "
                f"{list(TEMPLATE_FIELDS)} (write literal braces as {{{{ and }}}})"
            )
        return template

    @field_validator("verdict_pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        try:
            groups = re.compile(pattern).groups
        except re.error as e:
            raise ValueError(f"genrm.verdict_pattern is not a valid regex: {e}") from e
        if groups < 1:
            raise ValueError(
                "genrm.verdict_pattern needs a group capturing the verdict, e.g. (CORRECT|INCORRECT)"
            )
        return pattern

    @model_validator(mode="after")
    def _scores_given(self) -> GenRMConfig:
        if not self.verdict_scores:
            raise ValueError("genrm.verdict_scores must map at least one verdict to a score")
        return self


def question_text(prompt: str | list[dict[str, Any]]) -> str:
    """The question of a prompt: the text itself, or the last user turn of chat messages."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m.get("role") == "user"] or list(prompt)
    content = users[-1].get("content", "") if users else ""
    if isinstance(content, list):  # multimodal content parts: keep the text parts
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def render_judge_prompt(template: str, question: str, response: str, reference: Any) -> str:
    """The judge's user turn for one sample (``reference`` None renders as an empty string)."""
    return template.format(
        question=question, response=response, reference="" if reference is None else str(reference)
    )


def parse_verdict(text: str, pattern: str, scores: dict[str, float]) -> str | None:
    """The verdict in the judge's answer (a key of ``scores``), or None when there is none.

    Strict: ``pattern`` must match the whole stripped answer (``re.fullmatch``); the verdict is its first
    group, and a verdict that is not a key of ``scores`` counts as none. A thinking judge's answer is what
    follows its ``<think>`` block (a block that never closes holds no verdict).
    """
    match = re.fullmatch(pattern, after_reasoning(text).strip())
    if match is None:
        return None
    verdict = match.group(1)
    return verdict if verdict in scores else None


@dataclass
class JudgeResult:
    """The GenRM service's answer to one request, in the order of its items."""

    scores: list[float]  # score per item (the verdict's, or unparsed_score)
    verdicts: list[str | None]  # parsed verdict per item; None = unparsed
    latency_s: float  # seconds of the judge batch that carried the request (queueing included)
    texts: list[str] = field(default_factory=list)  # the judge's raw answers (for logs and debugging)


def judge_item(sample: Sample, strip_reasoning: bool = True) -> dict[str, Any]:
    """What the judge needs of a sample (the sample itself stays in the caller): the response after its
    reasoning block with `strip_reasoning` (the judge grades the answer, not the thinking)."""
    return {
        "question": question_text(sample.prompt),
        "response": after_reasoning(sample.response_text, strip_reasoning),
        "reference": sample.label,
    }


_HANDLES: dict[str, Any] = {}  # Serve application name -> handle, per process


async def genrm(
    samples: list[Sample], app_name: str = GENRM_APP, strip_reasoning: bool = True
) -> list[dict[str, float]]:
    """The ``genrm`` reward (per group): judge every sample of the group with the GenRM service.

    Works wherever a Serve handle does: the Rollout replica, a reward pool worker, a test driver.
    Raises if the service is not deployed (set ``reward.genrm``); the scorer then gives the fallback.
    """
    from ray import serve

    if app_name not in _HANDLES:
        _HANDLES[app_name] = serve.get_app_handle(app_name)
    result: JudgeResult = await _HANDLES[app_name].judge.remote(
        [judge_item(s, strip_reasoning) for s in samples]
    )
    return [
        {
            "reward": score,
            "genrm/latency_s": result.latency_s,
            "genrm/unparsed": float(verdict is None),
            "genrm/correct": float(verdict == "CORRECT"),
        }
        for score, verdict in zip(result.scores, result.verdicts, strict=True)
    ]

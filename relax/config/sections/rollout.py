"""The `rollout` section: sampling, the engines, partial rollout, and its nested `elastic` (the elastic
REST API) and `agent` (agentic rollouts) sections."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from relax.data.config import Section


class ElasticConfig(Section):
    """The elastic rollout REST API (docs/elastic_api.md), served by the Rollout role."""

    enabled: bool = Field(True, description="Serve the elastic API (scale out/in, engines, operations).")
    host: str | None = Field(
        None,
        description="Address the API listens on; None = `resources.bind` (127.0.0.1 on one machine, the "
        "Rollout node's address on a cluster).",
    )
    port: int = Field(
        0, ge=0, le=65535, description="API port (0 = a free port); the URL goes to endpoints.json."
    )
    operation_timeout_s: float = Field(
        600.0, gt=0, description="Default deadline of one scale operation; past it the operation rolls back."
    )
    drain_timeout_s: float = Field(
        60.0,
        ge=0,
        description="Scale-in: how long a removed engine may finish its requests before it is stopped.",
    )
    max_engines: int = Field(16, gt=0, description="Scale-out refuses to go past this many engines.")


class AgentConfig(Section):
    """Agentic rollouts (relax/agentic): how one sample's trajectory is produced."""

    kind: Literal["single_turn", "multi_turn", "external"] = Field(
        "single_turn",
        description="`single_turn`: one response per sample; `multi_turn`: model turns alternate with an "
        "environment's observations (`env`); `external`: an agent program (`command`) drives an OpenAI "
        "endpoint per sample and its calls become the trajectory.",
    )
    env: str = Field(
        "tools",
        description="multi_turn: a built-in environment name (tools, calculator, search) or an import path "
        "`package.module:factory` (called with `env_kwargs`, returns a relax.agentic.env.Environment).",
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the env factory."
    )
    max_turns: int = Field(
        4, gt=0, description="Model turns per trajectory; the episode ends after the last."
    )
    max_total_tokens: int = Field(
        256, gt=0, description="Token budget of the whole response (model and environment tokens)."
    )
    max_turn_tokens: int | None = Field(
        None, gt=0, description="Cap on one model turn in tokens (None = rollout.max_new_tokens)."
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, description="A tool call running longer becomes an error observation."
    )
    end_on_truncated_turn: bool = Field(
        True,
        description="A model turn cut at its token cap ends the episode (else the environment answers it).",
    )
    stop_at_tool_call: bool = Field(
        True, description="End a model turn at `</tool_call>` (the tool runs while the engine is free)."
    )
    tools_in_prompt: bool = Field(
        True, description="List the environment's tools in the system turn (with data.apply_chat_template)."
    )
    command: list[str] = Field(
        default_factory=list,
        description="external: the agent program and its arguments; it gets RELAX_BASE_URL, RELAX_SESSION_ID, "
        "RELAX_SAMPLE_FILE and OPENAI_API_KEY (its session's token) in its environment (and `{base_url}`/`{session_id}` in arguments are filled).",
    )
    agent_timeout_s: float = Field(
        300.0, gt=0, description="external: the agent process is killed after this."
    )
    max_concurrent_agents: int = Field(16, gt=0, description="external: agent processes running at once.")
    contexts_per_sample: int = Field(
        1,
        gt=0,
        description="Training rows per sample (multi-agent: one per context, e.g. planner and worker).",
    )
    advantage_fn: str | None = Field(
        None,
        description="Multi-agent: `package.module:fn(samples) -> [[float per context] per sample]`, the value "
        "each context's row gets as its reward (see relax/agentic/multi_agent.py).",
    )

    @model_validator(mode="after")
    def _needs(self) -> AgentConfig:
        if self.kind == "external" and not self.command:
            raise ValueError("rollout.agent.kind=external needs rollout.agent.command=[program, args...]")
        if self.contexts_per_sample > 1 and self.advantage_fn is None:
            raise ValueError(
                "rollout.agent.contexts_per_sample > 1 needs rollout.agent.advantage_fn=package.module:fn "
                "(how a sample's reward is shared among its contexts)"
            )
        return self


class RolloutConfig(Section):
    prompts_per_step: int = Field(16, gt=0, description="Prompts drawn per training step.")
    n_samples_per_prompt: int = Field(8, gt=0, description="Responses sampled per prompt (GRPO group).")
    max_new_tokens: int = Field(64, gt=0, description="Response length cap in tokens.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k sampling (-1 = off; else at least 1).")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Min-p sampling threshold (0 = off).")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings.")
    engine: str = Field(
        "embedded",
        description="The engine backend (relax/backends/inference/registry.py; an unknown name stops the run "
        "before Ray starts): `embedded`: Relax starts its own engines; `external`: attach to `engine_urls`; "
        "`sglang`: Relax starts SGLang servers (pip install 'relax[sglang]').",
    )
    num_engines: int = Field(1, gt=0, description="Embedded engines to start.")
    engine_urls: list[str] = Field(default_factory=list, description="Engine base URLs (external mode).")
    engine_max_running: int = Field(256, gt=0, description="Max concurrently decoded requests per engine.")
    engine_threads: int = Field(2, gt=0, description="torch intra-op threads of each embedded engine (CPU).")
    engine_max_total_tokens: int | None = Field(
        None,
        gt=0,
        description="Embedded engines' KV cache ceiling in tokens; the pool grows up to it as tokens arrive and "
        "preempts rows past it (None: engine_kv_memory_fraction of the GPU's memory, 262144 on the CPU).",
    )
    engine_kv_memory_fraction: float = Field(
        0.25,
        gt=0,
        le=0.95,
        description="With engine_max_total_tokens=None, the share of its GPU's memory an embedded engine's KV "
        "cache may grow to (in colocate the training rank plans around what the engine holds).",
    )
    engine_prefix_cache: bool = Field(
        True,
        description="Embedded engines reuse the KV of prompt prefixes across requests (GRPO groups sent "
        "apart, agent turns, shared system prompts); emptied by every weight update.",
    )
    engine_chunked_prefill_size: int | None = Field(
        None,
        ge=-1,
        description="Embedded engines prefill at most this many prompt tokens a step; a longer prompt (a long "
        "agent history) is prefilled in chunks while the running requests keep decoding (None: 8192 on a "
        "GPU, 512 on the CPU; -1 or 0: off).",
    )
    request_timeout_s: float = Field(300.0, gt=0, description="Timeout of one /generate call.")
    partial_rollout: bool = Field(
        False,
        description="A weight update aborts in-flight generation; unfinished samples resume under the new "
        "weights (otherwise the update waits until in-flight generation ends).",
    )
    partial_rollout_mode: Literal["abort", "in_place"] = Field(
        "abort",
        description="Partial rollout: `abort` ends in-flight requests and resumes each unfinished sample "
        "with a new request (prompt and tokens so far prefilled again under the new weights, at most "
        "`max_aborts` times); `in_place` keeps the running requests and their KV cache, and the engines "
        "load the weights between two steps (no prefill again; earlier tokens keep the old weights' KV "
        "cache). Embedded engines keep generating through the push; SGLang engines are paused in place "
        "for it.",
    )
    max_aborts: int = Field(
        2, ge=0, description="Partial rollout: times one sample may be aborted; later updates wait for it."
    )
    batch_order: Literal["step", "completion"] = Field(
        "step",
        description="`step`: a group trains in the step that drew its prompt. `completion`: a finished group "
        "goes to the oldest started step still short of groups, so with steps running ahead (hybrid, "
        "fully_async; max_staleness >= 1) a long response no longer holds its step back; pair it with "
        "partial_rollout and a max_aborts above the steps a long response spans "
        "(relax/rollout/step_assembler.py).",
    )
    over_provision: int = Field(
        0,
        ge=0,
        description="Completion order in hybrid/fully_async: keep this many prompt groups in flight beyond "
        "what the started steps take, so a step trains on the first prompts_per_step groups to finish "
        "(relax/rollout/step_assembler.py). 0 = off.",
    )
    mask_offpolicy_tokens: bool = Field(
        False,
        description="Partial rollout: loss mask 0 on tokens generated before the last abort or in-place update.",
    )
    elastic: ElasticConfig = Field(default_factory=ElasticConfig, description="Elastic rollout REST API.")

    agent: AgentConfig = Field(default_factory=AgentConfig, description="Multi-turn and agentic rollouts.")

    @property
    def rows_per_step(self) -> int:
        """Training rows of one step: prompts x samples x contexts per sample."""
        return self.prompts_per_step * self.n_samples_per_prompt * self.agent.contexts_per_sample

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(
                f"rollout.top_k={value} samples from no token; use -1 (off) or a count of at least 1"
            )
        return value

    @model_validator(mode="after")
    def _external_needs_urls(self) -> RolloutConfig:
        if self.engine == "external" and not self.engine_urls:
            raise ValueError("rollout.engine=external needs rollout.engine_urls=[http://host:port, ...]")
        return self

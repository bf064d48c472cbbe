"""The typed configuration of a Relax run: one pydantic model per area, nested under `RelaxConfig`.

Every field has a one-line description (shown by `relax train --help-config`). Unknown keys are errors
(`extra="forbid"`) so a typo never silently falls back to a default.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from relax.algorithms.config import AlgorithmConfig
from relax.data.config import DataConfig, Section
from relax.rewards.config import RewardConfig


class RunConfig(Section):
    name: str = Field("relax-run", description="Run name; the run folder is `<output_dir>/<name>`.")
    output_dir: str = Field("runs", description="Parent folder of run folders.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    token: SecretStr | None = Field(
        None,
        exclude=True,
        description="The run's secret, which every server the run starts requires as a bearer token; set by "
        "the Controller from RELAX_RUN_TOKEN or generated, kept in <run_dir>/secrets/run_token (0600), "
        "never written to config.yaml.",
    )

    def token_value(self) -> str | None:
        return self.token.get_secret_value() if self.token is not None else None

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


class ModelConfig(Section):
    path: str = Field(
        ...,
        description="Hugging Face model folder (config.json, safetensors, tokenizer), or a Hub id "
        "(`Qwen/Qwen2.5-0.5B-Instruct`) resolved through the Hub cache (HF_HOME; HF_HUB_OFFLINE=1: the cache "
        "only) to the folder of one commit before any role starts.",
    )
    revision: str | None = Field(
        None,
        description="Hub branch, tag or commit when `path` (and `reference_path`) is a Hub id; None = the "
        "default branch. config.yaml records the commit it resolved to, so every node and a resume load "
        "the same files.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype of the trainer's master weights and of the engines."
    )
    reference_path: str | None = Field(
        None,
        description="Model folder of the frozen reference (KL terms) and distillation teacher; None = "
        "`path`, the initial policy. On-policy distillation needs it.",
    )


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
    engine: Literal["embedded", "external"] = Field(
        "embedded",
        description="`embedded`: Relax starts its own engines; `external`: attach to `engine_urls`.",
    )
    num_engines: int = Field(1, gt=0, description="Embedded engines to start.")
    engine_urls: list[str] = Field(default_factory=list, description="Engine base URLs (external mode).")
    engine_max_running: int = Field(256, gt=0, description="Max concurrently decoded requests per engine.")
    engine_threads: int = Field(2, gt=0, description="torch intra-op threads of each embedded engine (CPU).")
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


class LoraConfig(Section):
    """LoRA through PEFT: only the adapters train; base weights stay frozen (trainer.backend=fsdp)."""

    rank: int = Field(8, gt=0, description="Adapter rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names that get adapters (PEFT `target_modules`).",
    )
    sync: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="What weight sync sends: adapter tensors only, or merged base+adapter weights of the "
        "adapted modules; `auto` = merged (the embedded engine loads plain weights by name).",
    )


class TrainerConfig(Section):
    num_steps: int = Field(100, gt=0, description="Training steps (one rollout batch and one update each).")
    lr: float = Field(1e-3, gt=0, description="AdamW peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping by global norm.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up (optimizer steps).")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Decay after warm-up."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final lr as a fraction of lr (cosine/linear).")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="Token budget of one micro-batch (dynamic batch size; padded tokens count). None = auto: "
        "8192 on CPU; on a GPU planned from the model's size and the memory free beside the engine "
        "(relax/backends/training/memory.py).",
    )
    pack_sequences: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Run a micro-batch's text samples packed into one row instead of padded to the longest "
        "(relax/backends/training/packing.py): `auto` packs with flash attention, and with SDPA/eager when "
        "that saves a quarter of the tokens and the row is at most 4096 tokens.",
    )
    num_mini_batches: int = Field(
        1,
        gt=0,
        description="Optimizer steps per rollout batch (PPO mini-batches); the weight version still "
        "advances by one per training step.",
    )
    threads: int = Field(2, gt=0, description="torch intra-op threads of the trainer (CPU).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Trainer device.")
    backend: Literal["torch", "fsdp"] = Field(
        "torch",
        description="`torch`: one in-process rank; `fsdp`: FSDP2 over `num_ranks` Ray actors (gloo/NCCL).",
    )
    num_ranks: int = Field(1, gt=0, description="Training ranks (one Ray actor, and one GPU on GPU, each).")
    cpus_per_rank: float = Field(1.0, gt=0, description="Logical Ray CPUs reserved per training rank.")
    ranks_see_all_gpus: bool = Field(
        False,
        description="Two or more training ranks on GPUs see every GPU of their node and pick theirs by index, "
        "so NCCL copies between ranks peer to peer (NVLink) instead of through host memory, where Ray's "
        "per-actor CUDA_VISIBLE_DEVICES sends it (docs/gpus.md).",
    )
    mixed_precision: Literal["none", "bf16"] = Field(
        "bf16", description="FSDP on GPU: bf16 compute over fp32 master weights, fp32 gradient reduction."
    )
    gradient_checkpointing: bool | None = Field(
        None,
        description="Recompute activations in backward (saves memory). None = auto: off on CPU; on a GPU on "
        "only when micro-batches of 8192 tokens would not fit without it (relax/backends/training/memory.py).",
    )
    compile_layers: bool | None = Field(
        None,
        description="fsdp: torch.compile each decoder layer's forward (fuses the small ops; the first steps "
        "compile). None = auto: on for ranks on a GPU, off on CPU.",
    )
    pi_old_from_update: bool = Field(
        True,
        description="colocate/hybrid with one optimizer step per batch: pi_old (recomputed by the trainer) "
        "comes from the update's own forward, on the same weights, instead of a forward pass of its own "
        "(docs/trainer.md).",
    )
    weight_sync_backend: Literal["auto", "nccl", "gloo", "disk"] = Field(
        "auto",
        description="How the trainer's weights reach the engines: `auto` = a broadcast group over NCCL when "
        "the trainer and engines hold GPUs (receivers on a training rank's own GPU get CUDA IPC instead), "
        "gloo (through host memory) on CPU or when SGLang engines share the trainer's GPUs; `disk` = "
        "safetensors files under `<run_dir>/weights` that the engines load, for engines that cannot join a "
        "process group (they must see the run folder).",
    )
    weight_sync_ipc: bool = Field(
        True,
        description="Hand weights to receivers on a training rank's own GPU (colocated embedded engines, "
        "ActorFwd) by CUDA IPC: no collective, no host copy.",
    )
    weight_sync_flatten: bool | None = Field(
        None,
        description="Broadcast each bucket as one packed buffer (one collective per bucket) instead of one "
        "per tensor; default: on for embedded engines, off for SGLang (its protocol is per tensor).",
    )
    publish_bucket_mb: int = Field(
        256, gt=0, description="Weight-publish bucket size (MiB of gathered tensors)."
    )
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters instead of all weights (fsdp backend)."
    )

    @property
    def uses_group(self) -> bool:
        """Whether the Actor runs the FSDP rank group (any LoRA, more than one rank, or backend=fsdp)."""
        return self.backend == "fsdp" or self.num_ranks > 1 or self.lora is not None


class ScheduleConfig(Section):
    """How rollout and training take turns: the execution mode, how far rollout runs ahead, and the
    streaming knobs (relax/config/modes.py derives what each mode does from these)."""

    mode: Literal["colocate", "hybrid", "fully_async"] = Field(
        "colocate",
        description="Execution mode. colocate: rollout and training take turns (on-policy); hybrid: Rollout "
        "runs ahead while the Actor trains, old/ref log-probs and advantages in process on the Actor; "
        "fully_async: Rollout, Actor, ActorFwd, Reference and Advantages as separate streaming services.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="How many steps rollout may run ahead of training (relax/rollout/staleness.py); "
        "0 = on-policy. colocate generates each step on request, so it is on-policy whatever this says.",
    )
    data_plane: Literal["transferqueue", "ray"] = Field(
        "transferqueue",
        description="Where step data streams between roles: TransferQueue, or one Ray actor (lighter).",
    )
    balance_data: bool = Field(
        False, description="hybrid/colocate: order each step's rows into token-balanced rank shares."
    )
    fetch_ahead: bool | None = Field(
        None,
        description="hybrid/fully_async: the Actor takes step k+1's rows before step k+1 starts: during step "
        "k's update when it runs in rank processes (fsdp, GPUs), after it with the in-process trainer "
        "(overlapping the weight push; during the update the fetch would share its interpreter lock). "
        "None (auto) = on; false = off.",
    )
    overlap_push: bool | None = Field(
        None,
        description="hybrid/fully_async: the Actor starts step k+1's update while step k's weights are pushed, "
        "publishing a copy of them kept when step k's update ended (one more copy of the weights in "
        "memory). None (auto) = with the in-process trainer; the fsdp ranks publish their live shards.",
    )
    debug_train_delay_s: float = Field(
        0.0, ge=0, description="Testing: the Actor sleeps this long before each update (a slow trainer)."
    )
    debug_engine_step_sleep_s: float = Field(
        0.0,
        ge=0,
        description="Testing: each engine sleeps this long after every decode step (a slow rollout).",
    )


PLACEMENT_KEYS = (
    "rollout",
    "actor",
    "actor_fwd",
    "reference",
    "advantages",
    "genrm",
    "metrics",
    "engines",
    "ranks",
    "data_plane",
)


class PlacementConfig(Section):
    """Where one role (or the embedded engines, or the training ranks) may run on a heterogeneous
    cluster, in Ray's own terms (docs/cluster.md)."""

    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each replica/actor asks for (nodes started with "
        "`ray start --resources '{\"h200\": 8}'`), e.g. {h200: 1}.",
    )
    label_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the replica/actor needs (nodes started with `ray start --labels "
        "tier=cpu`), e.g. {tier: cpu}; Ray's label selector syntax (`!value`, `in(a,b)`) works.",
    )


class ResourcesConfig(Section):
    """Where the roles run: GPUs and CPUs per role, the Ray cluster. How they take turns is `schedule`."""

    engine_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs per embedded engine (fractions share a GPU). None = auto "
        "(relax/orchestration/gpus.py): 0 without GPUs; colocate shares each GPU between a trainer rank and "
        "an engine; the other modes split the GPUs between engines and trainer.",
    )
    trainer_gpus: float | None = Field(
        None, ge=0, description="GPUs per training rank (None = auto, as for engine_gpus)."
    )
    fwd_gpus: float | None = Field(
        None, ge=0, description="fully_async: GPUs of the ActorFwd and Reference roles each (None = auto)."
    )
    num_cpus: int = Field(8, gt=0, description="Logical CPUs declared to a locally started Ray.")
    rollout_cpus: str | None = Field(
        None,
        description="CPU budget of rollout: pin the embedded engines, the Rollout role and Advantages to "
        "these CPUs ('0', '0-3,8'; relax/utils/cpu_affinity.py). None = any CPU.",
    )
    training_cpus: str | None = Field(
        None,
        description="CPU budget of training: pin the Actor (and its ranks), ActorFwd and Reference to these "
        "CPUs. None = any CPU.",
    )
    gpu_group: str | None = Field(
        None,
        description="Named Ray placement group of one-GPU bundles shared by colocated engines and training "
        "ranks (engine i and rank i use bundle i mod G); colocate on GPUs creates it (relax-gpus) if None.",
    )
    num_gpus: int | None = Field(
        None, ge=0, description="GPUs declared to a locally started Ray (None = every visible GPU)."
    )
    dashboard: bool = Field(
        False,
        description="Start Ray's dashboard with the local cluster Relax starts, listening on 127.0.0.1 only "
        "(its URL is logged; reach it from elsewhere through an SSH tunnel). A cluster Relax joins keeps "
        "its own dashboard settings.",
    )
    data_plane_cpus: float = Field(
        1.0,
        ge=0,
        description="Logical Ray CPUs of each TransferQueue actor (its controller and storage unit); where they "
        "go is resources.placement.data_plane.",
    )
    placement: dict[str, PlacementConfig] = Field(
        default_factory=dict,
        description=f"Where roles and actor groups go, by name ({', '.join(PLACEMENT_KEYS)}): custom "
        "resources and node labels; unnamed ones go anywhere (docs/cluster.md, examples/cluster.yaml).",
    )
    bind: Literal["auto", "loopback", "node"] = Field(
        "auto",
        description="Where the servers Relax starts (engines, weight receivers, elastic API, agent endpoint, "
        "doorbell, weight-sync rendezvous) listen and what they advertise: `loopback` = 127.0.0.1, `node` = "
        "the address of the node they run on (Ray's node IP; never all interfaces); `auto` = loopback when "
        "the cluster has one node at start, else node. Set `node` for a cluster that grows during the run.",
    )
    ray_address: str | None = Field(
        None,
        description="Existing Ray cluster to join (`auto`, `HOST:6379`, `ray://...`); None = the cluster in "
        "RAY_ADDRESS (set by `ray job submit`), else start a local one on 127.0.0.1 (docs/cluster.md).",
    )
    object_store_mb: int = Field(1024, gt=0, description="Object store size of a locally started Ray.")

    @field_validator("placement")
    @classmethod
    def _placement_keys(cls, value: dict[str, PlacementConfig]) -> dict[str, PlacementConfig]:
        if unknown := sorted(set(value) - set(PLACEMENT_KEYS)):
            raise ValueError(f"unknown placement key(s) {unknown}; valid keys: {', '.join(PLACEMENT_KEYS)}")
        return value

    @field_validator("rollout_cpus", "training_cpus", mode="before")
    @classmethod
    def _cpu_number(cls, value: Any) -> Any:
        """One CPU written as a number (YAML `0`; an override's value that looks like one reads as 0.0)."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return str(int(value))
        return value

    @model_validator(mode="after")
    def _cpu_lists_parse(self) -> ResourcesConfig:
        from relax.utils.cpu_affinity import parse_cpu_list

        for key in ("rollout_cpus", "training_cpus"):
            if (value := getattr(self, key)) is not None:
                try:
                    parse_cpu_list(value)
                except ValueError as e:
                    raise ValueError(f"resources.{key}: {e}") from None
        return self


class WandbConfig(Section):
    project: str = Field("relax", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user; None = the default).")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline writes `<run_dir>/wandb/offline-run-*` (sync later); online uploads."
    )


class ClearMLConfig(Section):
    project: str = Field("relax", description="ClearML project.")
    offline: bool = Field(True, description="Record the task locally (no server), uploadable later.")


class OpsConfig(Section):
    checkpoint_interval: int = Field(50, ge=0, description="Save every N steps (0 = only at the end).")
    keep_checkpoints: int = Field(2, gt=0, description="Checkpoints kept on disk (oldest deleted).")
    tensorboard: bool = Field(True, description="Write TensorBoard event files into the run folder.")
    log_interval: int = Field(10, gt=0, description="Steps between one-line status logs.")
    progress: bool = Field(True, description="Show a live progress bar.")
    # -- health and recovery (relax/orchestration/health.py, relax/orchestration/recovery.py) --
    heartbeat_interval_s: float = Field(2.0, gt=0, description="Seconds between a service's heartbeats.")
    heartbeat_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A service silent this many seconds is restarted (stateless) or fails the run.",
    )
    max_role_restarts: int = Field(
        3,
        ge=0,
        description="In-place restarts of one stateless role before a global restart is taken instead.",
    )
    step_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        description="A step (rollout, update, weight push, eval) running longer fails the run, naming the role "
        "and phase that stalled (relax/orchestration/watchdog.py); None = no limit.",
    )
    stop_grace_s: float = Field(
        60.0,
        gt=0,
        description="After SIGTERM/Ctrl-C the step in flight may finish (and be checkpointed) for this long; "
        "then the run stops without it. A second signal stops at once.",
    )
    max_global_restarts: int = Field(
        2, ge=0, description="Global restarts from the last checkpoint (Actor failure) before the run stops."
    )
    # -- metrics service and notifications (relax/roles/metrics.py, relax/ops/) --
    notify_urls: list[str] = Field(
        default_factory=list,
        description="Apprise URLs notified of run start, failures, restarts and the end (e.g. json://host/path).",
    )
    wandb: WandbConfig | None = Field(None, description="Log metrics to Weights & Biases (None = off).")
    clearml: ClearMLConfig | None = Field(None, description="Log metrics to ClearML (None = off).")
    trace: bool = Field(False, description="Write each step's phases as a Chrome trace (`trace.json`).")


class EvalSetConfig(Section):
    """One held-out set: its own data, reward and sampling settings."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Set name; metrics go to eval/<name>/.")
    files: list[str] = Field(
        ...,
        min_length=1,
        description="Prompt files (.jsonl or .parquet), or Hub data sets `hf://datasets/<org>/<name>?config="
        "<config>&split=<split>` as in data.train_files (split default test).",
    )
    reward: RewardConfig | None = Field(None, description="Reward for this set (None = the training reward).")
    n_samples_per_prompt: int = Field(1, gt=0, description="Samples per prompt (n of pass@k).")
    k_values: list[int] = Field(default_factory=lambda: [1], description="k values for pass@k and mean@k.")
    max_new_tokens: int | None = Field(
        None, gt=0, description="Response cap (None = rollout.max_new_tokens)."
    )
    temperature: float = Field(0.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_prompts: int | None = Field(None, gt=0, description="Evaluate only the first N prompts.")
    correct_threshold: float = Field(
        0.5, description="A sample counts as correct for pass@k if reward >= this."
    )
    save_samples: int = Field(64, ge=0, description="Responses (with scores) saved per evaluation as JSONL.")

    @model_validator(mode="after")
    def _k_fits(self) -> EvalSetConfig:
        bad = [k for k in self.k_values if not 1 <= k <= self.n_samples_per_prompt]
        if bad:
            raise ValueError(
                f"eval set {self.name!r}: k_values {bad} must be between 1 and n_samples_per_prompt="
                f"{self.n_samples_per_prompt}; raise n_samples_per_prompt or drop those k"
            )
        return self


class EvalConfig(Section):
    sets: list[EvalSetConfig] = Field(default_factory=list, description="Held-out sets (empty = no eval).")
    interval: int = Field(0, ge=0, description="Evaluate every N training steps (0 = never during training).")
    before_train: bool = Field(False, description="Evaluate once before the first step.")
    at_end: bool = Field(True, description="Evaluate after the last step.")

    @model_validator(mode="after")
    def _unique_names(self) -> EvalConfig:
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.sets names must be unique, got {names}")
        return self


# section.key -> new section.key: keys renamed or moved, still accepted under the old name (with a warning)
MOVED_KEYS = {
    f"resources.{key}": f"schedule.{key}"
    for key in (
        "mode",
        "max_staleness",
        "data_plane",
        "balance_data",
        "fetch_ahead",
        "overlap_push",
        "debug_train_delay_s",
        "debug_engine_step_sleep_s",
    )
}


def migrate_moved_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` (a raw config mapping) with keys in `MOVED_KEYS` moved to their new place; each
    moved key warns once (FutureWarning) with its new name. Both names set is an error."""
    out = dict(data)
    for old, new in MOVED_KEYS.items():
        old_section, old_key = old.split(".")
        section = out.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        new_section, new_key = new.split(".")
        target = out.get(new_section)
        target = dict(target) if isinstance(target, dict) else {}
        if new_key in target:
            raise ValueError(f"{old} and {new} are both set; {old} is the old name of {new}: keep only {new}")
        section = dict(section)
        target[new_key] = section.pop(old_key)
        out[old_section], out[new_section] = section, target
        warnings.warn(f"config key {old} is now {new}; the old name still works for now", FutureWarning, 2)
    return out


class RelaxConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    ops: OpsConfig = Field(default_factory=OpsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """Keys that moved to another section keep working under their old name, with a warning."""
        if isinstance(data, dict):
            data = migrate_moved_keys(data)
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> RelaxConfig:
        self.algorithm.validate_against(
            max_staleness=self.schedule.max_staleness, has_teacher=self.model.reference_path is not None
        )
        if self.algorithm.old_log_probs == "rollout" and self.rollout.temperature != 1.0:
            raise ValueError(
                f"algorithm.old_log_probs=rollout takes the engine's log-probs, which are after temperature "
                f"{self.rollout.temperature}, as pi_old; the trainer's are at temperature 1. Set "
                "rollout.temperature=1.0 or algorithm.old_log_probs=recompute"
            )
        if self.algorithm.spec.needs_critic and self.schedule.mode == "fully_async":
            raise ValueError(
                f"algorithm {self.algorithm.name!r} trains a critic, which runs in process on the Actor; "
                "fully_async has no critic role: use schedule.mode=hybrid (streaming) or colocate"
            )
        if self.rollout.over_provision and (
            self.rollout.batch_order != "completion" or self.schedule.mode == "colocate"
        ):
            raise ValueError(
                f"rollout.over_provision={self.rollout.over_provision} sends surplus groups to later steps: it "
                "needs rollout.batch_order=completion and schedule.mode hybrid or fully_async (colocate "
                "generates each step on request); set those, or rollout.over_provision=0"
            )
        if self.schedule.overlap_push and self.trainer.uses_group:
            raise ValueError(
                "schedule.overlap_push=true needs the in-process trainer: the fsdp ranks publish their live "
                "shards, which the next update would change mid-push; leave schedule.overlap_push unset"
            )
        if self.trainer.weight_sync_backend == "disk" and self.trainer.lora is not None:
            raise ValueError(
                "trainer.weight_sync_backend=disk writes full weights; LoRA runs publish adapters or merged "
                "modules through the broadcast group: leave trainer.weight_sync_backend=auto"
            )
        if self.algorithm.spec.needs_complete_groups and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                f"algorithm {self.algorithm.name!r} normalises rewards within prompt groups and needs "
                "rollout.n_samples_per_prompt >= 2 (8 is typical)"
            )
        return self


def register_config_secrets(cfg: RelaxConfig) -> None:
    """Mask this config's credentials and the run's token in everything this process logs."""
    from relax.utils.redact import register_secret, secret_values

    for value in secret_values(cfg.model_dump(mode="json")):
        register_secret(value)
    register_secret(cfg.run.token_value())

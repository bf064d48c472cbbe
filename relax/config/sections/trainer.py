"""The `trainer` section: optimizer, micro-batching, the training backend and its ranks, weight sync, and
the nested `lora` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relax.data.config import Section


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
    attention_kernel: Literal["auto", "flash", "cudnn"] = Field(
        "auto",
        description="SDPA kernel of the trainer's attention on a GPU: `flash` (no per-shape set-up), "
        "`cudnn` (1.5-1.8x faster kernels, but 0.1-1.6 s to build a plan for each new micro-batch shape: "
        "for runs whose shapes repeat), `auto` = flash (docs/trainer.md, Attention kernel).",
    )
    pi_old_from_update: bool = Field(
        True,
        description="colocate/hybrid with one optimizer step per batch: pi_old (recomputed by the trainer) "
        "comes from the update's own forward, on the same weights, instead of a forward pass of its own "
        "(docs/trainer.md).",
    )
    # A name in relax.weights.sender.TRANSPORTS, checked before Ray starts (preflight): a new transport
    # is added in relax/weights/ alone (docs/weights.md), which config/ may not import.
    weight_sync_backend: str = Field(
        "auto",
        description="How the trainer's weights reach the engines (a transport of relax.weights.sender."
        "TRANSPORTS): `auto` = a broadcast group over NCCL when "
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

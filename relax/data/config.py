"""The `data` section of the config (prompt files, row keys, media processing), owned by the data layer
that reads it; `relax.config.relax_config` nests it under `RelaxConfig`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from relax.data.chat_template import check_template_kwargs


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MediaConfig(Section):
    """Multimodal rows: where their media are listed and how the model's processor turns them into tensors."""

    image_key: str = Field("images", description="Row field listing the images of the <image> placeholders.")
    video_key: str = Field("videos", description="Row field listing the videos of the <video> placeholders.")
    audio_key: str = Field(
        "audios", description="Row field listing the audio clips of the <audio> placeholders."
    )
    processor: Literal["direct", "full", "auto"] = Field(
        "direct",
        description="`direct`: the image processor and feature extractor, placeholders expanded by Relax (no "
        "torchvision needed); `full`: the model's processor class; `auto`: full if it loads, else direct.",
    )
    workers: int = Field(
        2,
        ge=0,
        description="Worker processes that load and process media (0 = a thread of the rollout role).",
    )
    image_min_pixels: int | None = Field(
        None, gt=0, description="Resize floor in pixels (None = the model's)."
    )
    image_max_pixels: int | None = Field(None, gt=0, description="Resize cap in pixels (None = the model's).")
    video_fps: float = Field(2.0, gt=0, description="Frames per second sampled from a video.")
    video_max_frames: int = Field(16, gt=0, description="Cap on sampled frames per video (evenly spread).")
    video_max_tokens: int = Field(
        256,
        gt=0,
        description="Token budget per video; frames are shrunk to fit it (at least 1 token/frame pair).",
    )
    audio_max_seconds: float = Field(30.0, gt=0, le=30.0, description="Longer audio clips are an error.")
    cache_rows: int = Field(256, ge=0, description="Processed rows kept in memory for reuse (LRU).")

    def keys(self) -> dict[str, str]:
        """Media kind -> row field."""
        return {"image": self.image_key, "video": self.video_key, "audio": self.audio_key}


class DataConfig(Section):
    train_files: list[str] = Field(
        ...,
        min_length=1,
        description="Prompt files (.jsonl or .parquet), or Hub data sets written "
        "`hf://datasets/<org>/<name>[@revision]?config=<config>&split=<split>&prompt=<column>&label=<column>` "
        "(split default train; docs/data.md). One entry may be written without the list.",
    )
    prompt_key: str = Field("prompt", description="Row field holding a plain-text prompt.")
    messages_key: str = Field("messages", description="Row field holding chat messages.")
    label_key: str = Field("label", description="Row field holding the reference answer.")
    metadata_key: str = Field("metadata", description="Row field holding free-form metadata.")
    apply_chat_template: bool = Field(True, description="Wrap prompts in the tokenizer's chat template.")
    system_prompt: str | None = Field(None, description="System message prepended when templating.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Variables for the chat template when prompts are rendered (rollout, eval, the "
        "prompt-length check, agent turns), e.g. {enable_thinking: false} for Qwen3 to train without "
        "its <think> block; passed to apply_chat_template as /v1's chat_template_kwargs are.",
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded by run.seed).")
    max_prompt_len: int = Field(
        1024, gt=0, description="Longest prompt in tokens (chat template included); see overlong_prompts."
    )
    overlong_prompts: Literal["drop", "error"] = Field(
        "drop",
        description="Prompts longer than max_prompt_len, found when the data loads: `drop` trains without "
        "them (a warning names their file and line, the count is the data/dropped_overlong metric), "
        "`error` refuses the data before the run starts. Default drop: a few outliers of a large data set "
        "should not cost a run, and the warning and metric keep them visible (verl's "
        "filter_overlong_prompts). Rows with media are checked when processed (an error).",
    )
    media: MediaConfig = Field(default_factory=MediaConfig, description="Images, videos and audio of rows.")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_template_kwargs(v, "data.chat_template_kwargs")

    @field_validator("train_files", mode="before")
    @classmethod
    def _one_entry(cls, value: object) -> object:
        # `data.train_files=hf://...?config=main&split=train` on the command line: YAML's flow list
        # `[hf://...?...]` would need quotes, as `?` ends a plain scalar inside brackets
        return [value] if isinstance(value, str) else value

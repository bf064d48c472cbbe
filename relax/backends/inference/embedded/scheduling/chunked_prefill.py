"""Chunked prefill: a prompt longer than the step's prefill budget is prefilled over several engine steps,
`size` tokens a step, and the running batch gets one decode step after each chunk, so a long prompt or a
long agent history delays the running decodes by one chunk's time per token instead of by its whole
prefill (SGLang's `--chunked-prefill-size`).

Why the chunk has a slot of its own and is not mixed into the decode forward: a decode step runs through
the lean decoder's one-token Triton kernel and the CUDA graphs, which read the running batch's slots
0..B-1 by length (`attention_step.py`); a prefill runs through SDPA. The prompt being chunked lives in
the slot just past the batch as it was when it was admitted (`slot`), which no decode step reads and no
row move writes (rows only move down into holes of the batch), and joins the batch, moved to slot B,
when its last chunk is done. Each chunk after the first is `ModelRunner.prefill_after` from column
`done` (the path a prefix-cache hit takes), so a chunk attends over the slot's earlier columns exactly as
one whole prefill would.

One prompt is chunked at a time and nothing else is admitted meanwhile, so the queue stays first in,
first out and the slot past the batch stays free: the batch only shrinks while a chunked prompt waits.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from relax.backends.inference.embedded.model.runner import ModelRunner
from relax.backends.inference.embedded.scheduling.sequence import Sequence

GPU_CHUNK = 8192  # SGLang's default on large GPUs: large enough that a chunk's GEMMs stay efficient
# A CPU prefills far fewer tokens a second, so a GPU-sized chunk would stall its decodes for seconds,
# while a few hundred rows already keep its matmuls efficient (docs/engines.md, Chunked prefill)
CPU_CHUNK = 512


def default_chunk_size(device_type: str) -> int:
    """The prefill budget per step when the engine is not given one."""
    return GPU_CHUNK if device_type == "cuda" else CPU_CHUNK


@dataclass
class ChunkedPrefill:
    """A prompt (the samples of one queue entry) part way through its prefill."""

    unit: list[Sequence]  # its samples; they join the batch together after the last chunk
    ids: list[int]  # the tokens to prefill (`Sequence.prefill_ids` of the first sample)
    slot: int  # the cache slot its KV is written to (past the running batch)
    done: int  # leading columns of `slot` that hold its KV (a prefix-cache hit's, then each chunk's)
    size: int  # tokens per chunk

    def last(self) -> bool:
        """The next chunk is the last one."""
        return len(self.ids) - self.done <= self.size

    def live(self) -> list[Sequence]:
        """Its samples not ended (by an abort) meanwhile."""
        return [s for s in self.unit if s.finish is None]

    def run(self, runner: ModelRunner) -> Tensor:
        """Prefill the next chunk into the slot; returns the logits of its last token [1, V] (the first
        output token's, after the last chunk)."""
        end = min(self.done + self.size, len(self.ids))
        chunk = self.ids[self.done : end]
        if self.done == 0:  # nothing before it: the plain causal prefill
            logits_1V = runner.prefill([chunk], [self.slot])
        else:
            logits_1V = runner.prefill_after([chunk], [self.slot], [self.done])
        self.done = end
        return logits_1V

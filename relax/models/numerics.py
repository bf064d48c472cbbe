"""One numerics setting for every process that runs a model on a GPU, engines and trainers alike.

The engine's log-probs and the trainer's must agree for RL's importance ratios, and in bf16 they agree
only as far as the two sides compute the same sums. cuBLAS may reduce the partial sums of a split-K
product in bf16 (PyTorch's default, `allow_bf16_reduced_precision_reduction`) and picks split-K by
shape, so the same rows gave other values in a product of other height: the engine encodes a request
group's images, the trainer a micro-batch's, and the vision tower's output for one image differed by
up to 0.19 between the two (3B VL shape on an H200; docs/multimodal.md). With the partial sums reduced
in float32 it was the same to the bit. The text decoder's remaining engine-trainer gap comes from the
sequence length (other attention and product tiles), which this does not change.
"""

from __future__ import annotations

import torch


def use_float32_reductions() -> None:
    """Reduce the partial sums of half-precision GEMMs in float32 in this process (both flags are
    process-wide; a CPU process is unaffected)."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False

"""The wire names of a step's columns in the data plane, by producer. Rows and columns are plain Python
values (lists of ints/floats, floats); `relax.data.rows` converts between them and `Sample`/`TrainBatch`.
"""

from __future__ import annotations

ROLLOUT_COLUMNS = [  # Rollout: one row per sample
    "prompt_ids",  # [P] prompt tokens
    "response_ids",  # [R] generated tokens
    "loss_mask",  # [R] 1 = trained token
    "rollout_log_probs",  # [R] behaviour log-probs reported by the engine
    "reward",  # scalar reward
    "group_id",  # prompt group (GRPO)
    "weight_versions",  # every weight version that produced a token of the sample
    "length",  # P + R, for length-balanced sampling
    "multimodal_inputs",  # "" for text; media tensors as safetensors + base64 (relax.data.mm_codec)
]
LOG_PROBS = "log_probs"  # ActorFwd: [R] old-policy log-probs
REF_LOG_PROBS = "ref_log_probs"  # Reference: [R]
ADVANTAGES = "advantages"  # Advantages: [R]
# Advantages: the step's `advantages/*` metrics on the first row it wrote, {} on the others; they reach
# the Actor's metrics with the rows instead of by one more Serve call a step from the driver
ADVANTAGES_METRICS = "advantages_metrics"
RETURNS = "returns"  # Advantages (critic algorithms): [R]


def partition_name(step: int) -> str:
    """The partition holding training step `step`'s data."""
    return f"train_{step}"

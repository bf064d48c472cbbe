"""CPU cost of turning a step's per-token Python lists into tensors on the Actor and its rank. Not a test.

A step of 32 prompts x 8 samples with 2,048-token responses carries about half a million values in each
per-token column (response ids, loss mask, behaviour log-probs), read from the data plane as Python lists.
The Actor decodes them into a `TrainBatch` (`batch_from_columns`), measures the engine-vs-trainer gap
(`_mismatch_metrics`), pads masks and log-probs (`pad_ragged`) and sends the batch to its rank, which
builds each micro-batch's input ids (`build_micro_batch`). All of it is CPU time between the rollout and
the update, on the step's critical path. This script times, on one step's worth of synthetic rows, each
flattening the list-comprehension way (what the code did) and with `flat_tensor` (numpy's `fromiter`),
checks that both give the same tensor, and times the other conversions for scale:

    python benchmarks/trainer_inputs.py                    # 256 samples x 2,048 tokens, 128-token prompts
    python benchmarks/trainer_inputs.py --samples 256 --tokens 8192

Prints milliseconds for each; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import time
from collections.abc import Callable

import torch

from relax.data.batch import flat_tensor, pad_ragged
from relax.data.rows import batch_from_columns
from relax.roles.actor import _mismatch_metrics


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def columns(n: int, tokens: int, prompt: int, seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)
    return {
        "prompt_ids": [[rng.randrange(151_936) for _ in range(prompt)] for _ in range(n)],
        "response_ids": [[rng.randrange(151_936) for _ in range(tokens)] for _ in range(n)],
        "loss_mask": [[1] * tokens for _ in range(n)],
        "rollout_log_probs": [[-rng.random() * 9 for _ in range(tokens)] for _ in range(n)],
        "reward": [rng.random() for _ in range(n)],
        "group_id": [i // 8 for i in range(n)],
        "weight_versions": [[1] for _ in range(n)],
        "length": [prompt + tokens] * n,
        "multimodal_inputs": [""] * n,
    }


def comprehension(rows: list[list], dtype: torch.dtype) -> torch.Tensor:
    """What the Actor and the rank did before `flat_tensor`."""
    return torch.tensor([x for row in rows for x in row], dtype=dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048, help="response tokens a sample")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens a sample")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    cols = columns(args.samples, args.tokens, args.prompt)
    batch = batch_from_columns(cols)
    batch.old_log_probs = [torch.tensor(r) + 0.01 for r in batch.rollout_log_probs]
    seqs = [pr + r for pr, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
    flats = {  # name -> (rows, dtype)
        "log-probs (float32)": (batch.rollout_log_probs, torch.float32),
        "loss mask (bool)": (batch.loss_mask, torch.bool),
        "input ids (int64)": (seqs, torch.long),
    }
    result: dict = {"samples": args.samples, "tokens": args.tokens, "prompt": args.prompt, "flatten_ms": {}}
    for name, (rows, dtype) in flats.items():
        assert torch.equal(flat_tensor(rows, dtype), comprehension(rows, dtype)), name
        old = best_ms(lambda r=rows, d=dtype: comprehension(r, d), args.repeats)
        new = best_ms(lambda r=rows, d=dtype: flat_tensor(r, d), args.repeats)
        result["flatten_ms"][name] = {"comprehension": round(old, 2), "flat_tensor": round(new, 2)}
        print(f"{name:22s} comprehension {old:7.1f} ms, flat_tensor {new:6.1f} ms ({old / new:.1f}x)")
    blob = pickle.dumps(batch, protocol=5)
    others = {
        "batch_from_columns": lambda: batch_from_columns(cols),
        "_mismatch_metrics": lambda: _mismatch_metrics(batch),
        "pad_ragged (loss mask)": lambda: pad_ragged(batch.loss_mask, args.tokens),
        "pickle the batch (to a rank)": lambda: pickle.dumps(batch, protocol=5),
        "unpickle it (on the rank)": lambda: pickle.loads(blob),
    }
    result["other_ms"] = {}
    for name, fn in others.items():
        ms = best_ms(fn, args.repeats)
        result["other_ms"][name] = round(ms, 2)
        print(f"{name:30s} {ms:7.1f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""`trainer.compile_layers`: ragged micro-batches (one row or several, padded or not, the one-token dummy)
settle at a few graphs instead of recompiling on every new shape, and the compiled layers compute what
the eager ones do. Dynamo's guards do not depend on the backend, so the test compiles with `eager`
(no C++ toolchain, seconds on CPU); the trainer uses inductor."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from relax.backends.training.forward import build_micro_batch, policy_forward
from relax.backends.training.fsdp import compile_layers


def _micro_batches(seed: int = 0):
    rng = random.Random(seed)
    for i in range(12):
        rows = rng.choice([1, 2, 3, 5, 8])
        same = i % 4 == 0  # every row the same length: no padding, so no attention mask
        p_len, r_len = rng.randint(3, 40), rng.randint(1, 30)
        prompts = [
            [rng.randint(1, 200) for _ in range(p_len if same else rng.randint(3, 40))] for _ in range(rows)
        ]
        resps = [
            [rng.randint(1, 200) for _ in range(r_len if same else rng.randint(1, 30))] for _ in range(rows)
        ]
        batch = SimpleNamespace(prompt_ids=prompts, response_ids=resps, media_rows=lambda idx: None)
        yield build_micro_batch(None if i == 5 else batch, list(range(rows)), torch.device("cpu"))


@pytest.mark.parametrize("pack,graphs", [("off", 3), ("on", 2)])
def test_compiled_layers_settle_at_a_few_graphs_and_match_eager(tiny_model_dir, pack, graphs):
    """Padded (`pack=off`): rows >= 2 with a padding mask, rows >= 2 without one, a single row; left to
    Dynamo's default the same micro-batches made 6 graphs and kept adding more as new shapes came.
    Packed: one row with a block mask, and the unpacked single row."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    layers = [m for m in model.modules() if type(m).__name__ == "Qwen2DecoderLayer"]
    assert layers
    eager = [policy_forward(model, mb, False, pack)[0].detach() for mb in _micro_batches()]

    torch._dynamo.reset()
    counters.clear()
    compile_layers(layers, backend="eager")
    for mb, want in zip(_micro_batches(), eager, strict=True):
        got, _ = policy_forward(model, mb, False, pack)
        got.sum().backward()
        torch.testing.assert_close(got.detach(), want)
    assert counters["stats"]["unique_graphs"] <= graphs
    torch._dynamo.reset()

"""The packed prefill past cached prefixes (`packed_prefill.py`): on the CPU its per-suffix reference,
driven through the engine, gives the masked path's outputs for a batch of hits of different lengths; on
CUDA the variable-length flash kernel matches that reference on grouped heads."""

from __future__ import annotations

import random

import pytest
import torch

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.model import packed_prefill

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _sessions(e: EmbeddedEngine, sessions: int = 5, turns: int = 3) -> tuple[list[list[int]], list[float]]:
    """Agent-like sessions of different lengths; each turn all of them are submitted together, so one
    admission holds several prefix-cache hits with different prefixes and suffixes."""
    rng = random.Random(0)
    system = [rng.randrange(1, 500) for _ in range(40)]
    convs = [system + [rng.randrange(1, 500) for _ in range(3 + 7 * s)] for s in range(sessions)]
    outs, logprobs = [], []
    for turn in range(turns):
        futures = [e.submit(c, GREEDY) for c in convs]
        done = [f.result()[0] for f in futures]
        results = [r.output_ids for r in done]
        outs += results
        logprobs += [lp for r in done for lp in r.output_logprobs]
        # the shortest conversations get the longest next messages: a short suffix's padding then runs
        # past every row's columns (its rotary positions must still be covered)
        convs = [c + r + [rng.randrange(1, 500) for _ in range(2 + 6 * (sessions - s) + turn)] for s, (c, r) in
                 enumerate(zip(convs, results, strict=True))]  # fmt: skip
    return outs, logprobs


def test_packed_hits_give_the_masked_paths_outputs(tiny_model_dir, monkeypatch):
    plans: list[tuple[int, ...]] = []
    real_plan = packed_prefill.plan

    def spy(starts, lengths, T, device):
        plans.append(tuple(starts))
        return real_plan(starts, lengths, T, device)

    monkeypatch.setattr(packed_prefill, "plan", spy)
    results = {}
    for packed in (False, True):
        e = EmbeddedEngine(str(tiny_model_dir), device="cpu", dtype="float32", seed=0)
        e.runner.packed_prefill = packed  # on the CPU: `attend`'s per-suffix reference
        try:
            results[packed] = _sessions(e.start())
            assert e.metrics().cache_hit_rate > 0.3
        finally:
            e.shutdown()
    assert results[True][0] == results[False][0]
    assert torch.allclose(torch.tensor(results[True][1]), torch.tensor(results[False][1]), atol=1e-4)
    # several hits with different cached prefixes went through one packed prefill
    assert any(len(set(starts)) > 1 for starts in plans), plans


@pytest.mark.skipif(
    not (torch.cuda.is_available() and packed_prefill.available(torch.device("cuda"), torch.bfloat16)),
    reason="needs CUDA with flash attention",
)
@pytest.mark.parametrize("Hq,Hk,D", [(14, 2, 64), (12, 2, 128), (16, 16, 128)])
def test_the_flash_kernel_matches_the_reference(Hq, Hk, D):
    gen = torch.Generator().manual_seed(Hq * D)
    starts, lengths = [0, 37, 300, 5, 1024], [9, 1, 130, 64, 17]
    T = max(lengths)
    packed = packed_prefill.plan(starts, lengths, T, torch.device("cuda"))
    total_k = int(packed.cu_k[-1])
    q = torch.randn(len(lengths), T, Hq, D, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(total_k, Hk, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(total_k, Hk, D, generator=gen).to("cuda", torch.bfloat16)
    scale = D**-0.5
    got = packed_prefill.attend(q, k, v, packed, scale)
    want = packed_prefill.attend(q.cpu().float(), k.cpu().float(), v.cpu().float(),
                                 _to_cpu(packed), scale)  # fmt: skip
    real = packed.q_index.cpu()
    assert torch.allclose(got.float().cpu()[real], want[real], atol=2e-2, rtol=2e-2)
    assert got.float().cpu()[real].abs().max() > 0.05  # not all zeros
    padding = torch.ones(len(lengths) * T, dtype=torch.bool)
    padding[real] = False
    assert got[padding.cuda()].abs().max() == 0


def _to_cpu(p: packed_prefill.PackedPrefill) -> packed_prefill.PackedPrefill:
    return packed_prefill.PackedPrefill(
        **{name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in vars(p).items()}
    )


def test_the_plan_packs_real_tokens_and_covers_the_paddings_positions():
    p = packed_prefill.plan([100, 0, 30], [1, 50, 4], 50, torch.device("cpu"))
    assert p.q_index.tolist() == [0, *range(50, 100), *range(100, 104)]
    assert p.cu_q.tolist() == [0, 1, 51, 55] and p.cu_k.tolist() == [0, 101, 151, 185]
    assert (p.max_q, p.max_k) == (50, 101)
    assert p.k_rows.tolist() == [0] * 101 + [1] * 50 + [2] * 34
    assert p.k_cols.tolist() == [*range(101), *range(50), *range(34)]
    assert p.columns == 100 + 50  # the first suffix's padding sits at positions up to 149

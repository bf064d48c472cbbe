"""The batched sampler draws from the distribution it reports: frequencies match the (truncated,
renormalised) probabilities, excluded and banned tokens are never drawn, and seeded rows repeat. The fused
CUDA kernel (`fused_sampling.py`) runs the same checks where there is a GPU with Triton."""

from __future__ import annotations

import math

import pytest
import torch

from relax.backends.inference.embedded.sampling import fused_sampling
from relax.backends.inference.embedded.sampling.sampling import BatchSampler, RowParams, make_generator

CPU = torch.device("cpu")
needs_fused = pytest.mark.skipif(
    not fused_sampling.available(), reason="the fused sampler needs CUDA and Triton"
)


def _row(**kw) -> RowParams:
    base = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "generator": None}
    return RowParams(**{**base, **kw})


METHODS = ["inverse_cdf", "race"]  # the CPU's and the GPU's torch draws, both checked on the CPU
ALL_METHODS = [*METHODS, pytest.param("fused", marks=needs_fused)]  # + the CUDA kernel, on a GPU


def _device(method: str) -> torch.device:
    return torch.device("cuda") if method == "fused" else CPU


def _frequencies(
    logits_V: torch.Tensor, row: RowParams, draws: int, method: str, seed: int = 0
) -> torch.Tensor:
    """Token frequencies over `draws` rows sampled in one batch from the same logits."""
    dev = _device(method)
    sampler = BatchSampler([row] * draws, dev, method)
    gen = make_generator(seed, dev)
    tokens, logp = sampler.sample(logits_V.expand(draws, -1).contiguous().to(dev), gen)
    tokens, logp = tokens.cpu(), logp.cpu()
    want_logp = torch.log_softmax(logits_V / max(row.temperature, 1e-6), -1)[tokens]
    torch.testing.assert_close(logp, want_logp)  # the log-prob before truncation, at the temperature
    return torch.bincount(tokens, minlength=logits_V.numel()).double() / draws


def _close(freq: torch.Tensor, probs: torch.Tensor, draws: int) -> None:
    """Every frequency within 5 standard errors of its probability (a 1e-6 false-alarm rate per token)."""
    se = (probs * (1 - probs) / draws).sqrt().clamp_min(1e-9)
    assert ((freq - probs).abs() <= 5 * se + 1e-9).all(), (freq, probs)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_frequencies_follow_the_softmax_at_the_temperature(method):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for temperature in (1.0, 0.7):
        draws = 40_000
        freq = _frequencies(logits, _row(temperature=temperature), draws, method)
        _close(freq, torch.softmax(logits.double() / temperature, -1), draws)


@pytest.mark.parametrize("method", METHODS)
def test_truncation_renormalises_and_never_draws_excluded_tokens(method):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
    probs = torch.softmax(logits.double(), -1)
    draws = 40_000
    freq = _frequencies(logits, _row(top_k=3), draws, method)
    assert freq[3:].sum() == 0
    _close(freq, torch.cat([probs[:3] / probs[:3].sum(), torch.zeros(3, dtype=torch.float64)]), draws)
    freq = _frequencies(logits, _row(top_p=0.5), draws, method)  # keeps tokens whose preceding mass <= 0.5
    keep = (probs.cumsum(0) - probs) <= 0.5
    assert freq[~keep].sum() == 0 and freq[keep].sum() == 1


@pytest.mark.parametrize("method", ALL_METHODS)
def test_frequencies_hold_across_a_vocabulary_of_many_parts(method):
    """The fused kernel sums a row in parts of 4096 entries and then searches one part: mass in several
    parts, at their edges, and banned entries between them. The torch paths take the same check."""
    V = 3 * 4 * fused_sampling.SUB + 5
    logits = torch.full((V,), -1e30)
    logits[4096:8192] = -6.0  # a part of small, spread mass: about a fifth of the total
    hot = torch.tensor([0, 4095, 4096, 9000, V - 1])
    logits[hot] = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    # The torch paths do not sum in parts, and the tests above hold them to 40k draws; here each draw
    # expands a 49k-entry row, so they take fewer (same 5-SE bound, seeded): the kernel keeps 40k.
    draws = 40_000 if method == "fused" else 8_000
    freq = _frequencies(logits, _row(temperature=0.9), draws, method)
    probs = torch.softmax(logits.double() / 0.9, -1)
    _close(freq[hot], probs[hot], draws)
    spread = slice(4097, 8192)
    _close(freq[spread].sum()[None], probs[spread].sum()[None], draws)
    assert freq[logits < -1e29].sum() == 0


@pytest.mark.parametrize("method", ALL_METHODS)
def test_banned_tokens_are_never_drawn(method):
    logits = torch.tensor([0.0, -1e30, 0.0, -1e30, 0.0])  # media tokens of a multimodal model
    freq = _frequencies(logits, _row(), 20_000, method)
    assert freq[1] == 0 and freq[3] == 0
    assert math.isclose(float(freq.sum()), 1.0)


def test_a_draw_at_the_top_of_the_cdf_still_lands_on_a_kept_token():
    """If u * total rounds up to total (u = 1 stands for it), the search must stop at the last kept
    token, not run past it into the banned ones or off the vocabulary."""
    logits = torch.tensor([0.0, 0.0, -1e30, -1e30])
    sampler = BatchSampler([_row()], CPU, "inverse_cdf")
    gen = make_generator(0, CPU)
    original = torch.rand

    def rand_one(*args, **kwargs):
        return torch.ones_like(original(*args, **kwargs))

    torch.rand = rand_one
    try:
        tokens, _ = sampler.sample(logits[None], gen)
    finally:
        torch.rand = original
    assert int(tokens[0]) == 1


@pytest.mark.parametrize("method", ALL_METHODS)
def test_seeded_rows_repeat_whatever_the_batch(method):
    dev = _device(method)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).to(dev)
    drawn = set()
    for step in range(20):  # several steps of the same generators
        if step == 0:
            alone_row, mixed_row = (
                _row(generator=make_generator(7, dev)),
                _row(generator=make_generator(7, dev)),
            )
        alone, _ = BatchSampler([alone_row], dev, method).sample(logits[1:2], make_generator(0, dev))
        batch = [_row(), mixed_row, _row()]
        mixed, _ = BatchSampler(batch, dev, method).sample(logits, make_generator(5 + step, dev))
        assert int(alone[0]) == int(mixed[1])
        drawn.add(int(alone[0]))
    assert len(drawn) > 1  # the generator advances: not one token over and over


@needs_fused
def test_cuda_batches_take_the_fused_kernel_unless_a_row_truncates_or_is_greedy():
    cuda = torch.device("cuda")
    assert BatchSampler([_row(), _row(temperature=0.6)], cuda).inv_temp_B is not None
    assert BatchSampler([_row(), _row(top_p=0.9)], cuda).inv_temp_B is None
    assert BatchSampler([_row(), _row(temperature=0.0)], cuda).inv_temp_B is None
    logits = torch.randn(256, 151936, device=cuda, dtype=torch.bfloat16) * 3
    tokens, logp = BatchSampler([_row(temperature=0.8)] * 256, cuda).sample(logits, make_generator(0, cuda))
    want = torch.log_softmax(logits.float() / 0.8, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logp, want, atol=2e-4, rtol=1e-4)  # a vocabulary of Qwen's size


def test_fused_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="fused sampler needs CUDA"):
        BatchSampler([_row()], CPU, "fused")


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown sampling method 'gumbel'"):
        BatchSampler([_row()], CPU, "gumbel")


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_of_non_finite_logits_fails_only_itself(method, bad):
    """A row whose logits overflowed (inf, NaN) must not fail the step of the whole batch: every row
    gets a token inside the vocabulary, and the finite rows draw as usual."""
    dev = _device(method)
    V = 512
    logits_BV = torch.full((3, V), -30.0, device=dev)
    logits_BV[0, 7] = 30.0  # a finite row that all but surely draws token 7
    logits_BV[1, 5] = bad  # the bad row: inf in one place (inf - inf = NaN after the max) or NaN
    logits_BV[2, 9] = 30.0
    sampler = BatchSampler([_row(temperature=1e-5 if method != "fused" else 1.0)] * 3, dev, method)
    tokens_B, logp_B = sampler.sample(logits_BV, make_generator(0, dev))
    tokens = tokens_B.tolist()
    assert all(0 <= t < V for t in tokens), tokens
    assert tokens[0] == 7 and tokens[2] == 9
    assert math.isfinite(logp_B[0].item()) and math.isfinite(logp_B[2].item())

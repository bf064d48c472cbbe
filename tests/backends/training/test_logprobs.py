"""The chunked lm-head log-probs / entropy against the plain full-logits computation (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from relax.backends.training import forward as fw
from relax.backends.training import logprobs as lp
from relax.models.multimodal_model import BANNED_LOGIT

N, H, V = 11, 8, 37


def plain(hidden_NH, weight_VH, targets_N, banned=()):
    """The reference: full [N, V] logits, log-softmax, gather, -sum p log p."""
    logits_NV = hidden_NH @ weight_VH.T
    if banned:
        logits_NV = logits_NV.index_fill(-1, torch.tensor(banned), BANNED_LOGIT)
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    return logp_NV.gather(-1, targets_N[:, None]).squeeze(-1), -(logp_NV.exp() * logp_NV).sum(-1)


def leaves(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, H, generator=g) * 2).requires_grad_()
    weight = torch.randn(V, H, generator=g).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, weight, targets, g_logp, g_ent


def grads(loss, hidden, weight):
    return torch.autograd.grad(loss, [hidden, weight])


@pytest.mark.parametrize("chunk", [1, 4, N, 64])
@pytest.mark.parametrize("banned", [(), (3, 30)])
def test_values_and_gradients_match_full_logits(chunk, banned):
    hidden, weight, targets, g_logp, g_ent = leaves()
    targets = torch.where(torch.isin(targets, torch.tensor(banned or [-1])), 0, targets)
    want_logp, want_ent = plain(hidden, weight, targets, banned)
    got_logp, got_ent = lp.token_logprobs(hidden, weight, targets, banned=banned, chunk_tokens=chunk)
    torch.testing.assert_close(got_logp, want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-5, rtol=1e-5)
    # a loss that uses both outputs
    want = grads((want_logp * g_logp + want_ent * g_ent).sum(), hidden, weight)
    got = grads((got_logp * g_logp + got_ent * g_ent).sum(), hidden, weight)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # a loss without the entropy: its backward term is skipped, the gradient is that of log p alone
    want_logp, _ = plain(hidden, weight, targets, banned)
    got_logp, got_ent = lp.token_logprobs(hidden, weight, targets, banned=banned, chunk_tokens=chunk)
    got = grads((got_logp * g_logp).sum(), hidden, weight)
    for a, b in zip(got, grads((want_logp * g_logp).sum(), hidden, weight), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # entropy alone
    _, want_ent = plain(hidden, weight, targets, banned)
    _, got_ent = lp.token_logprobs(hidden, weight, targets, banned=banned, chunk_tokens=chunk)
    got = grads((got_ent * g_ent).sum(), hidden, weight)
    for a, b in zip(got, grads((want_ent * g_ent).sum(), hidden, weight), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_entropy_by_hand_and_gradient_flow():
    # two equal logits and one far below: p = (1/2, 1/2, ~0), H = log 2, log p(target 0) = -log 2
    weight = torch.tensor([[1.0], [1.0], [-50.0]], requires_grad=True)
    hidden = torch.tensor([[1.0]], requires_grad=True)
    logp, ent = lp.token_logprobs(hidden, weight, torch.tensor([0]))
    torch.testing.assert_close(logp, torch.tensor([-0.6931472]))
    torch.testing.assert_close(ent, torch.tensor([0.6931472]))
    # the gradient reaches hidden and weight; with_entropy=False gives None; no grad without grad inputs
    logp.sum().backward()
    assert hidden.grad is not None and weight.grad is not None
    # d log p(0) / d z = onehot(0) - p = (1/2, -1/2, 0); dz/dW_v = h = 1
    torch.testing.assert_close(weight.grad[:, 0], torch.tensor([0.5, -0.5, 0.0]), atol=1e-6, rtol=0)
    logp, ent = lp.token_logprobs(hidden.detach(), weight.detach(), torch.tensor([0]), with_entropy=False)
    assert ent is None and not logp.requires_grad


def test_frozen_weight_gets_no_gradient():
    hidden, weight, targets, g_logp, _ = leaves(1)
    frozen = weight.detach()
    logp, _ = lp.token_logprobs(hidden, frozen, targets, chunk_tokens=3)
    (logp * g_logp).sum().backward()
    assert hidden.grad is not None and frozen.grad is None


def test_ragged_index_and_scatter():
    rows, cols = lp.ragged_index(torch.tensor([2, 0, 3]))
    assert rows.tolist() == [0, 0, 2, 2, 2] and cols.tolist() == [0, 1, 0, 1, 2]
    out = lp.scatter_padded(torch.arange(1.0, 6.0), rows, cols, (3, 3))
    assert out.tolist() == [[1, 2, 0], [0, 0, 0], [3, 4, 5]]


def test_policy_forward_matches_the_models_own_logits(tiny_model_dir):
    """The chunked path through the tiny model == the full-logits path, values and gradients."""
    from test_torch_backend import make_batch

    from relax.models.multimodal_model import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32)
    assert lp.plain_head(model) is model.lm_head
    batch = make_batch(n=5)
    mb = fw.build_micro_batch(batch, list(range(5)), torch.device("cpu"))
    got_logp, got_ent = fw.policy_forward(model, mb, with_entropy=True)
    kwargs = {"position_ids": mb.position_ids}
    want_logp, want_ent = fw._policy_forward_logits(model, mb, True, kwargs)
    torch.testing.assert_close(got_logp, want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(0)
    up_logp, up_ent = torch.randn(got_logp.shape, generator=g), torch.randn(got_ent.shape, generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad((got_logp * up_logp + got_ent * up_ent).sum(), params)
    want = torch.autograd.grad((want_logp * up_logp + want_ent * up_ent).sum(), params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

"""The GRPO path end to end through the two entry points, with hand-computed values."""

import math

import pytest
import torch

from relax.algorithms import AlgorithmConfig, PolicyLossInputs, compute_advantages, make_policy_loss


def _inputs(lp, old, adv, mask, n_tok, n_seq, **kw):
    return PolicyLossInputs(
        log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=mask, rollout_log_probs=kw.get("rollout"),
        ref_log_probs=kw.get("ref"), entropy=kw.get("entropy"), global_num_tokens=n_tok,
        global_num_seqs=n_seq, max_response_len=mask.shape[1],
    )  # fmt: skip


def test_grpo_advantages_non_contiguous_groups():
    rewards = torch.tensor([1.0, 3.0, 0.0, 2.0])
    groups = torch.tensor([7, 5, 7, 5])  # group 7: {1, 0}; group 5: {3, 2}
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    out = compute_advantages(AlgorithmConfig(), rewards, groups, mask)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # (r - mean) / (unbiased std + eps), std = sqrt(0.5)
    expected = torch.tensor([[a, a, 0], [a, 0, 0], [-a, -a, -a], [0, 0, 0]])
    torch.testing.assert_close(out.advantages_NT, expected)
    assert out.returns_NT is None


def test_grpo_all_equal_rewards_and_empty_response_are_finite_zero():
    out = compute_advantages(
        AlgorithmConfig(),
        torch.tensor([1.0, 1.0]),
        torch.tensor([0, 0]),
        torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
    )
    assert torch.equal(out.advantages_NT, torch.zeros(2, 2))
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_grpo_size_one_or_incomplete_group_is_an_error():
    mask = torch.ones(3, 2)
    with pytest.raises(ValueError, match="size"):
        compute_advantages(AlgorithmConfig(), torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), mask)
    with pytest.raises(ValueError, match="want 3"):
        compute_advantages(
            AlgorithmConfig(), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask[:2], group_size=3
        )


def test_grpo_loss_value_and_gradient():
    # ratios e^{0.5} (clipped at 1.2 for A>0) and e^{-0.5} (unclipped... for A<0 clipped at 0.8)
    lp = torch.tensor([[0.5, 0.0], [-0.5, 0.0]], requires_grad=True)
    old = torch.zeros(2, 2, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = make_policy_loss(AlgorithmConfig())(_inputs(lp, old, adv, mask, 3.0, 2.0))
    # token losses: max(-e^.5, -1.2) = -1.2 ; -1 ; max(e^-.5, 0.8) = 0.8 ; (masked)
    torch.testing.assert_close(loss, torch.tensor((-1.2 - 1.0 + 0.8) / 3))
    loss.backward()
    # clipped tokens get no gradient; token (0,1): d(-r*A)/dlp = -1/3 ; masked token gets 0
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1 / 3], [0.0, 0.0]]))
    assert old.grad is None or torch.all(old.grad == 0)
    assert metrics["clip_frac"] == pytest.approx(2 / 3)
    assert isinstance(metrics["ratio_mean"], float)


def test_grpo_fully_masked_micro_batch_is_finite():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = make_policy_loss(AlgorithmConfig())(
        _inputs(lp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), 0.0, 2.0)
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.all(lp.grad == 0)
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_tensor_metrics_are_the_float_metrics_left_on_the_device(name):
    """The trainer's form (`tensor_metrics`) reads as the public one, value for value, and the loss and
    its gradient are the same."""
    from relax.algorithms.pipeline import ValueLossInputs, make_value_loss

    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 4, generator=g, requires_grad=True)
    args = (lp, torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), torch.ones(3, 4), 12.0, 3.0)
    cfg = AlgorithmConfig(name=name, tis=True)
    x = _inputs(*args, rollout=torch.randn(3, 4, generator=g))
    loss_f, floats = make_policy_loss(cfg)(x)
    loss_t, tensors = make_policy_loss(cfg, tensor_metrics=True)(x)
    assert floats and set(floats) == set(tensors)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in tensors.values())
    assert {k: float(v) for k, v in tensors.items()} == pytest.approx(floats, rel=1e-6)
    torch.testing.assert_close(loss_t, loss_f)
    if name == "ppo":
        v = ValueLossInputs(lp, args[1], args[2], args[3], 12.0, 3.0, 4)
        f = make_value_loss(cfg)(v)[1]
        t = make_value_loss(cfg, tensor_metrics=True)(v)[1]
        assert {k: float(x) for k, x in t.items()} == pytest.approx(f, rel=1e-6)

"""Policy losses: closed-form values, what receives gradient, masks and edge cases."""

import math

import pytest
import torch

from relax.algorithms.policy_losses import (
    cispo_loss,
    gspo_loss,
    m2po_loss,
    m2po_mask,
    ppo_clip_loss,
    reinforce_loss,
    sapo_loss,
)


def _leaf(values):
    return torch.tensor(values, requires_grad=True)


def test_ppo_asymmetric_clip_higher():
    lp = _leaf([[math.log(1.25), math.log(1.25)]])
    loss, m = ppo_clip_loss(lp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.28)
    # A>0: min(1.25, 1.28) -> unclipped -1.25 ; A<0: max(1.25, 1.25) -> 1.25 (clip at 0.8 not active)
    torch.testing.assert_close(loss, torch.tensor([[-1.25, 1.25]]))
    assert m["clip_frac"].item() == 0.0


def test_ppo_dual_clip_caps_negative_advantage():
    lp = _leaf([[math.log(5.0), math.log(5.0)]])
    loss, m = ppo_clip_loss(
        lp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), dual_clip_c=3.0
    )
    # A<0: max(5, 1.2)=5 capped at 3 ; A>0: max(-5, -1.2) = -1.2
    torch.testing.assert_close(loss, torch.tensor([[3.0, -1.2]]))
    loss.sum().backward()
    assert torch.all(lp.grad == 0)  # both tokens are clipped: no gradient
    assert m["dual_clip_frac"].item() == 0.5


def test_gspo_sequence_ratio_value_and_gradient():
    lp = _leaf([[0.1, -0.1, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = gspo_loss(lp, torch.zeros(1, 3), torch.ones(1, 3), mask, clip_low=0.5, clip_high=0.5)
    # geometric mean of masked token ratios: exp((0.1 - 0.1)/2) = 1
    torch.testing.assert_close(loss * mask, torch.tensor([[-1.0, -1.0, 0.0]]))
    (loss * mask).sum().backward()
    # d/dlp_t of -s_i = -s_i per token (GSPO-token form)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))
    assert m["seq_ratio_mean"].item() == pytest.approx(1.0)


def test_gspo_clips_whole_sequence():
    lp = _leaf([[0.2, 0.0]])  # s = exp(0.1) ~ 1.105 > 1 + 4e-4
    loss, m = gspo_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    torch.testing.assert_close(loss, torch.full((1, 2), -(1 + 4e-4)))
    loss.sum().backward()
    assert torch.all(lp.grad == 0) and m["clip_frac"].item() == 1.0


def test_sapo_gate_value_and_unit_gradient_on_policy():
    lp = _leaf([[0.0, 0.0]])
    loss, _ = sapo_loss(lp, torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), 1.0, 2.0)
    # f(1) = 4/tau * 0.5 = 2/tau ; loss = -f * A
    torch.testing.assert_close(loss, torch.tensor([[-2.0 * 2.0, 1.0 * 1.0]]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0, 1.0]]))  # = -A, like vanilla PG at r=1


def test_sapo_gate_off_policy():
    r = 2.0
    loss, _ = sapo_loss(
        _leaf([[math.log(r)]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 1.0, 1.05
    )
    sig = 1 / (1 + math.exp(-(r - 1)))
    assert loss.item() == pytest.approx(-4 * sig)


def test_cispo_weight_is_stop_gradient_and_clipped():
    lp = _leaf([[math.log(3.0), math.log(0.5)]])
    loss, m = cispo_loss(lp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 1.0, 1.0)
    # weights: clip(3, 0, 2) = 2 ; clip(0.5) = 0.5 ; loss = -w * A * log pi
    torch.testing.assert_close(loss, torch.tensor([[-2 * math.log(3.0), -0.5 * math.log(0.5)]]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0, -0.5]]))  # gradient kept, weight constant
    assert m["clip_frac"].item() == 0.5


def test_reinforce_unclipped_and_old_gets_no_grad():
    lp, old = _leaf([[math.log(4.0)]]), _leaf([[0.0]])
    loss, _ = reinforce_loss(lp, old, torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(4.0)
    loss.sum().backward()
    assert lp.grad.item() == pytest.approx(4.0) and old.grad is None


def test_m2po_mask_drops_largest_until_budget():
    log_ratio = torch.tensor([[0.1, 0.2, 0.5, -0.3, 0.05]])
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]])  # last token: A<0, r>1 -> not a candidate
    mask = torch.ones(1, 5)
    # candidates m2 = {0.01, 0.04, 0.25, 0.09}; prefix means sorted: .01, .025, .0467, .0975
    keep = m2po_mask(log_ratio, adv, mask, tau=0.04)
    torch.testing.assert_close(keep, torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]]))
    assert torch.equal(m2po_mask(log_ratio, adv, mask, tau=1.0), mask)


def test_m2po_loss_masked_tokens_get_no_gradient():
    lp = _leaf([[0.1, 0.5]])
    loss, m = m2po_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), tau=0.04)
    torch.testing.assert_close(loss, torch.tensor([[-math.exp(0.1), 0.0]]))
    loss.sum().backward()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 0].item() == pytest.approx(-math.exp(0.1))
    assert m["m2po_masked_frac"].item() == 0.5


@pytest.mark.parametrize("fn", [ppo_clip_loss, gspo_loss, sapo_loss, cispo_loss, reinforce_loss, m2po_loss])
def test_losses_finite_on_extreme_and_fully_masked_inputs(fn):
    lp = _leaf([[-80.0, 0.0], [0.0, 0.0]])
    old = torch.tensor([[0.0, -90.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    loss, metrics = fn(lp, old, torch.ones(2, 2), mask)
    (loss * mask).sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    _, metrics = fn(lp, old, torch.ones(2, 2), torch.zeros(2, 2))
    assert all(torch.isfinite(v) for v in metrics.values())

"""KL estimators, entropy bonus, off-policy corrections and distillation."""

import math

import pytest
import torch

from relax.algorithms import AlgorithmConfig, PolicyLossInputs, compute_advantages, make_policy_loss
from relax.algorithms.distillation import (
    distillation_advantages,
    distillation_loss,
    forward_kl,
    jsd,
    reverse_kl,
)
from relax.algorithms.kl import kl_k1, kl_k2, kl_k3, kl_low_var, kl_penalty, reward_kl_shaping
from relax.algorithms.off_policy import icepop_mask, mismatch_metrics, opsm_mask, tis_weights

LP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])  # lp - ref = [0.5, -1.0]


def test_kl_estimators_hand_values():
    d = torch.tensor([[0.5, -1.0]])
    torch.testing.assert_close(kl_k1(LP, REF), d)
    torch.testing.assert_close(kl_k2(LP, REF), 0.5 * d**2)
    torch.testing.assert_close(kl_k3(LP, REF), torch.exp(-d) - 1 + d)
    torch.testing.assert_close(kl_low_var(LP, REF), torch.exp(-d) - 1 + d)
    # low_var clamps: lp - ref = -30 -> k3 = e^{20} - 1 - 20 -> clamped to 10
    assert kl_low_var(torch.tensor([-30.0]), torch.tensor([0.0])).item() == 10.0
    with pytest.raises(ValueError, match="valid: k1"):
        kl_penalty(LP, REF, "k9")


def test_reward_kl_shaping_is_detached_and_masked():
    lp = LP.clone().requires_grad_(True)
    out = reward_kl_shaping(lp, REF, torch.tensor([[1.0, 0.0]]), coef=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.0]]))
    assert not out.requires_grad


def _inputs(lp, **kw):
    B, T = lp.shape
    base = dict(old_log_probs=torch.zeros(B, T), advantages=torch.zeros(B, T), loss_mask=torch.ones(B, T),
                rollout_log_probs=None, ref_log_probs=None, entropy=None, global_num_tokens=float(B * T),
                global_num_seqs=float(B), max_response_len=T)  # fmt: skip
    base.update(kw)
    return PolicyLossInputs(log_probs=lp, **base)


def test_kl_loss_and_entropy_bonus_gradients():
    lp = LP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    entropy = torch.tensor([[0.3, 0.7]], requires_grad=True)
    cfg = AlgorithmConfig(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01)
    loss, m = make_policy_loss(cfg)(_inputs(lp, ref_log_probs=ref, entropy=entropy))
    # zero advantages -> pg 0; k2 mean = (0.125 + 0.5)/2 ; entropy mean 0.5
    assert loss.item() == pytest.approx(0.1 * 0.3125 - 0.01 * 0.5)
    loss.backward()
    torch.testing.assert_close(lp.grad, 0.1 * torch.tensor([[0.5, -1.0]]) / 2)
    torch.testing.assert_close(entropy.grad, torch.full((1, 2), -0.01 / 2))
    assert ref.grad is None
    assert m["kl_loss"] == pytest.approx(0.3125) and m["entropy"] == pytest.approx(0.5)


def test_missing_inputs_raise_clear_errors():
    lp = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="ref_log_probs"):
        make_policy_loss(AlgorithmConfig(kl_coef=0.1))(_inputs(lp))
    with pytest.raises(ValueError, match="rollout_log_probs"):
        make_policy_loss(AlgorithmConfig(tis=True))(_inputs(lp))


def test_tis_icepop_opsm_and_mismatch():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-math.log(3.0), math.log(4.0), 0.0]])  # pi_old/mu = 3, 1/4, 1
    torch.testing.assert_close(tis_weights(old, rollout, 0.0, 2.0), torch.tensor([[2.0, 0.25, 1.0]]))
    mask = torch.ones(1, 3)
    torch.testing.assert_close(icepop_mask(old, rollout, mask, 0.5, 2.5), torch.tensor([[0.0, 0.0, 1.0]]))
    # OPSM: mean(mu - pi) = (-log3 + log4)/3 > 0.01; drop only when the advantage is negative
    assert torch.equal(opsm_mask(old, rollout, -torch.ones(1, 3), mask, 0.01), torch.zeros(1, 3))
    assert torch.equal(opsm_mask(old, rollout, torch.ones(1, 3), mask, 0.01), mask)
    m = mismatch_metrics(old, rollout, mask)
    assert m["mismatch_abs_diff"].item() == pytest.approx((math.log(3) + math.log(4)) / 3)
    assert m["mismatch_ratio_max"].item() == pytest.approx(3.0)


def test_tis_scales_pg_term_in_pipeline():
    lp = torch.zeros(1, 2, requires_grad=True)
    rollout = torch.tensor([[-math.log(3.0), 0.0]])  # TIS weights 2 (clamped), 1
    cfg = AlgorithmConfig(name="rloo", tis=True)
    loss, m = make_policy_loss(cfg)(_inputs(lp, advantages=torch.ones(1, 2), rollout_log_probs=rollout))
    assert loss.item() == pytest.approx((-2.0 - 1.0) / 2)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -0.5]]))
    assert m["tis_weight_mean"] == pytest.approx(1.5)


def test_distillation_divergences_hand_values():
    lp, teacher = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.0, -1.0 + math.log(2.0)]])  # rho = 1, 2
    torch.testing.assert_close(reverse_kl(lp, teacher), torch.tensor([[0.0, -math.log(2.0)]]))
    torch.testing.assert_close(forward_kl(lp, teacher), torch.tensor([[0.0, 2 * math.log(2.0)]]))
    j = 0.5 * math.log(2 / 3) + 0.5 * 2 * math.log(4 / 3)
    torch.testing.assert_close(jsd(lp, teacher), torch.tensor([[0.0, j]]))


def test_distillation_advantage_and_loss_terms():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0]], requires_grad=True)
    adv = distillation_advantages(lp, teacher, torch.tensor([[1.0, 0.0]]), coef=2.0)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0]]))  # -2 * (lp - teacher), masked
    assert not adv.requires_grad
    loss = distillation_loss(lp, teacher, coef=1.0)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.5, -1.0]]))  # d/dlp 0.5 (lp - t)^2
    assert teacher.grad is None


def test_on_policy_distillation_pipeline_uses_teacher_or_reference():
    cfg = AlgorithmConfig(name="on_policy_distillation")
    lp, teacher = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    out = compute_advantages(cfg, torch.tensor([5.0]), torch.tensor([0]), torch.ones(1, 2),
                             log_probs_NT=lp, ref_log_probs_NT=teacher)  # fmt: skip
    torch.testing.assert_close(out.advantages_NT, torch.tensor([[-0.5, 1.0]]))  # reward ignored
    with pytest.raises(ValueError, match="teacher_log_probs_NT"):
        compute_advantages(cfg, torch.tensor([5.0]), torch.tensor([0]), torch.ones(1, 2), log_probs_NT=lp)

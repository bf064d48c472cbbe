"""Loss aggregation: hand values per mode, and micro-batch/rank splits equal one big batch."""

import pytest
import torch

from relax.algorithms import AlgorithmConfig, PolicyLossInputs, make_policy_loss
from relax.algorithms.aggregation import aggregate_loss, get_reducer

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", (1 + 2 + 3 + 4) / 4),
        ("seq_mean_token_mean", (2.0 + 4.0) / 2),
        ("seq_mean_token_sum", (6.0 + 4.0) / 2),
        ("seq_mean_token_sum_norm", 10.0 / (2 * 3)),
        ("custom", (1 + 2 + 3 + 4) / 4),
    ],
)
def test_modes_hand_values(mode, expected):
    path = "relax.algorithms.aggregation:token_mean" if mode == "custom" else None
    got = aggregate_loss(
        LOSS, MASK, mode, global_num_tokens=4, global_num_seqs=2, max_response_len=3, custom_path=path
    )
    assert got.item() == pytest.approx(expected)


def test_fully_masked_row_and_unknown_mode():
    zero = aggregate_loss(LOSS, torch.zeros_like(MASK), "seq_mean_token_mean", global_num_tokens=0,
                          global_num_seqs=2, max_response_len=3)  # fmt: skip
    assert zero.item() == 0.0
    with pytest.raises(ValueError, match="valid: token_mean"):
        get_reducer("nope")
    with pytest.raises(ValueError, match="is not a callable"):
        get_reducer("custom", "relax.algorithms.aggregation:nothing_here")


def _batch(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 0, 4, 2])  # includes an empty response
    mask = (torch.arange(T) < lengths[:, None]).float()
    lp = -torch.rand(B, T, generator=g)
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    ref = lp + 0.2 * torch.randn(B, T, generator=g)
    rollout = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    ent = torch.rand(B, T, generator=g)
    return lp, old, ref, rollout, adv, ent, mask, lengths


def _run(cfg, lp_full, rows, old, ref, rollout, adv, ent, mask, lengths, n_tok, n_seq):
    """One micro-batch of the given rows, padded only to ITS OWN max length."""
    T = max(int(lengths[rows].max()), 1)
    lp = lp_full[rows, :T]
    x = PolicyLossInputs(
        log_probs=lp, old_log_probs=old[rows, :T], advantages=adv[rows, :T], loss_mask=mask[rows, :T],
        rollout_log_probs=rollout[rows, :T], ref_log_probs=ref[rows, :T], entropy=ent[rows, :T] * (1 + lp - lp.detach()),
        global_num_tokens=n_tok, global_num_seqs=n_seq, max_response_len=int(lengths.max()),
    )  # fmt: skip
    return make_policy_loss(cfg)(x)[0]


CONFIGS = [
    AlgorithmConfig(
        loss_agg_mode=mode, kl_coef=0.1, entropy_coef=0.01, tis=True, icepop=True, dual_clip_c=3.0
    )
    for mode in ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
] + [
    AlgorithmConfig(name="gspo"),
    AlgorithmConfig(name="sapo"),
    AlgorithmConfig(name="cispo", opsm=True),
    AlgorithmConfig(name="dr_grpo"),
    AlgorithmConfig(name="rloo", distill_coef=0.5, distill_mode="loss"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name}-{c.loss_agg_mode}")
def test_split_over_micro_batches_and_ranks_equals_one_batch(cfg):
    lp, old, ref, rollout, adv, ent, mask, lengths = _batch()
    n_tok, n_seq = float(mask.sum()), float(mask.shape[0])
    full_lp = lp.clone().requires_grad_(True)
    full = _run(cfg, full_lp, torch.arange(6), old, ref, rollout, adv, ent, mask, lengths, n_tok, n_seq)
    full.backward()
    split_lp = lp.clone().requires_grad_(True)
    total = torch.zeros(())
    for rank_rows in ([0, 1, 2], [3, 4, 5]):  # two "ranks"
        for mb in (rank_rows[:2], rank_rows[2:]):  # two micro-batches each (grad accumulation)
            loss = _run(
                cfg, split_lp, torch.tensor(mb), old, ref, rollout, adv, ent, mask, lengths, n_tok, n_seq
            )
            loss.backward()
            total = total + loss.detach()
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(split_lp.grad, full_lp.grad)
    assert torch.isfinite(full_lp.grad).all()

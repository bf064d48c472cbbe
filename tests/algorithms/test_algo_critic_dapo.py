"""PPO critic (value head, clipped value loss) and DAPO's data-side pieces."""

import types

import pytest
import torch
from torch import nn

from relax.algorithms import (
    AlgorithmConfig,
    ValueHeadModel,
    ValueLossInputs,
    clipped_value_loss,
    compute_advantages,
    filter_groups_dynamic_sampling,
    make_value_loss,
    overlong_penalty,
)


class TinyLM(nn.Module):
    """Stands in for an HF causal LM: returns ``hidden_states`` when asked."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=hidden)
        self.embed = nn.Embedding(10, hidden)

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        h = self.embed(input_ids)
        return types.SimpleNamespace(hidden_states=(h * 0, h))


def test_value_head_shapes_zero_init_and_gradient():
    model = ValueHeadModel(TinyLM())
    values = model(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert values.shape == (2, 3) and torch.all(values == 0)
    values.sum().backward()
    assert model.value_head.bias.grad.item() == 6.0
    assert model.backbone.embed.weight.grad is not None


def test_clipped_value_loss_hand_values_and_grad():
    values = torch.tensor([[1.0, 0.1]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0]])
    loss, m = clipped_value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    # token 0: unclipped 0, clipped (0.2 - 1)^2 = 0.64 -> 0.32 ; token 1: both 0.81 -> 0.405
    torch.testing.assert_close(loss, torch.tensor([[0.32, 0.405]]))
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.9]]))  # clipped token: no grad
    assert old.grad is None and m["vf_clip_frac"].item() == 0.5
    unclipped, _ = clipped_value_loss(values, old, returns, torch.ones(1, 2), clip=None)
    torch.testing.assert_close(unclipped, torch.tensor([[0.0, 0.405]]))


def test_make_value_loss_scaling():
    fn = make_value_loss(AlgorithmConfig(name="ppo", value_clip=None, value_loss_coef=0.5))
    x = ValueLossInputs(values=torch.tensor([[1.0, 3.0]]), old_values=torch.zeros(1, 2), returns=torch.zeros(1, 2),
                        loss_mask=torch.tensor([[1.0, 0.0]]), global_num_tokens=4.0, global_num_seqs=2.0,
                        max_response_len=2)  # fmt: skip
    loss, m = fn(x)
    assert loss.item() == pytest.approx(0.5 * 0.5 / 4) and m["vf_loss"] == pytest.approx(0.5)


def test_dynamic_sampling_filter():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    keep = filter_groups_dynamic_sampling(rewards, groups)
    assert keep.tolist() == [False, False, True, True, False, False]


def test_overlong_penalty_piecewise():
    lengths = torch.tensor([10, 16, 18, 20, 25])
    got = overlong_penalty(lengths, max_len=20, buffer_len=4, penalty=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    assert torch.equal(overlong_penalty(lengths, 20, 0, 1.0), torch.zeros(5))
    with pytest.raises(ValueError, match="exceeds"):
        overlong_penalty(lengths, 20, 30, 1.0)


def test_overlong_shaping_in_compute_advantages():
    cfg = AlgorithmConfig(name="dapo", overlong_buffer_len=4, normalize_std=False)
    out = compute_advantages(cfg, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 1),
                             response_lengths_N=torch.tensor([10, 18]), max_response_len=20)  # fmt: skip
    torch.testing.assert_close(out.advantages_NT[:, 0], torch.tensor([0.25, -0.25]))
    with pytest.raises(ValueError, match="response_lengths_N"):
        compute_advantages(cfg, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 1))


def test_value_head_on_a_tiny_hf_causal_lm():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    model = ValueHeadModel(transformers.LlamaForCausalLM(cfg))
    nn.init.normal_(model.value_head.weight)
    values = model(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long))
    assert values.shape == (1, 3) and torch.isfinite(values).all()
    values.sum().backward()
    assert model.backbone.model.embed_tokens.weight.grad is not None

"""Sequence packing (`packing.py`): a packed forward gives the padded forward's response log-probs,
entropy and gradients (the one forward path every trainer uses), and `auto` packs only where it pays."""

from __future__ import annotations

import copy

import pytest
import torch
from test_torch_backend import make_batch

from relax.backends.training import forward as fw
from relax.backends.training.packing import DENSE_MAX_TOKENS, should_pack
from relax.models.multimodal_model import load_causal_lm
from relax.models.tiny import write_tiny_model


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param, vocab_size=512)
    torch.manual_seed(0)
    return load_causal_lm(path, dtype=torch.float32).train()


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(model, run):
    """run(pack) -> (logp [B, T], entropy [B, T]); both modes agree, values and gradients."""
    out = {}
    for pack in ("off", "on"):
        logp, ent = run(pack)
        weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)
        out[pack] = (logp.detach(), ent.detach(), _grads(model, (logp * weights).sum() + 0.1 * ent.sum()))
    (lp0, e0, g0), (lp1, e1, g1) = out["off"], out["on"]
    assert lp0.abs().sum() > 0 and (lp0 != 0).sum() == (lp1 != 0).sum()
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e1, e0, atol=1e-5, rtol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) > 5
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("n", "seed", "idx"), [(7, 3, [0, 2, 3, 4, 6]), (6, 4, [1, 2, 3, 5])])
def test_packed_forward_matches_padded(model, n, seed, idx):
    batch = make_batch(n=n, seed=seed)  # prompts of 3-8 tokens, responses of 1-6
    mb = fw.build_micro_batch(batch, idx, torch.device("cpu"))
    _compare(model, lambda pack: fw.policy_forward(model, mb, with_entropy=True, pack=pack))


def test_auto_packs_only_where_it_pays(model):
    assert should_pack(model, [10, 40, 12], "auto")  # 120 padded for 62 real tokens
    assert not should_pack(model, [40, 38, 40], "auto")  # hardly any padding: the dense mask costs more
    assert not should_pack(model, [DENSE_MAX_TOKENS, 10], "auto")  # an [N, N] mask too large for SDPA
    assert should_pack(model, [40, 38, 40], "on") and not should_pack(model, [10, 40], "off")
    before = model.config._attn_implementation
    model.config._attn_implementation = "flash_attention_2"  # variable-length kernels: always
    try:
        assert should_pack(model, [DENSE_MAX_TOKENS, 10], "auto")
    finally:
        model.config._attn_implementation = before


def test_right_padded_without_mask_matches_left_padded(model):
    """Text rows run right-padded with no attention mask (causal attention never reaches the padding
    after a row's tokens): the same log-probs, entropy and gradients as left-padded with a mask."""
    batch = make_batch(n=6, seed=5)
    idx = [0, 1, 3, 4, 5]
    out = {}
    for right in (False, True):
        mb = fw.build_micro_batch(batch, idx, torch.device("cpu"), right=right)
        logp, ent = fw.policy_forward(model, mb, with_entropy=True, pack="off")
        weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)
        out[right] = (logp.detach(), ent.detach(), _grads(model, (logp * weights).sum() + 0.1 * ent.sum()))
    assert fw.micro_batch(model, batch, idx, torch.device("cpu")).right  # the layout text rows get
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-5, rtol=1e-5)
    for name, g in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_critic_values_agree_in_both_layouts(model):
    from relax.algorithms.critic import ValueHeadModel

    critic = ValueHeadModel(model)
    torch.nn.init.normal_(critic.value_head.weight)  # a head that reads the states
    batch = make_batch(n=5, seed=6)
    got = [
        fw.value_forward(critic, fw.build_micro_batch(batch, [0, 1, 2, 4], torch.device("cpu"), right=r))
        for r in (False, True)
    ]
    assert got[0].abs().sum() > 0
    torch.testing.assert_close(got[1], got[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["left", "right", "packed"])
def test_lengths_rounded_to_the_gpu_multiple_change_nothing(model, monkeypatch, layout):
    """On a GPU sequence lengths are padded to a multiple of 8 (`forward.CUDA_SEQ_MULTIPLE`): the extra
    columns (padded layouts) or the extra padding sequence (packed row) change no output or gradient."""
    batch = make_batch(n=6, seed=8)
    idx = [0, 1, 2, 4, 5]
    lens = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in idx]
    assert max(lens) % 8 and sum(lens) % 8  # the batch does need padding, in both layouts
    right, pack = layout != "left", "on" if layout == "packed" else "off"
    out = {}
    for multiple in (1, 8):
        monkeypatch.setattr(fw, "seq_multiple", lambda device, m=multiple: m)
        mb = fw.build_micro_batch(batch, idx, torch.device("cpu"), right=right)
        assert mb.input_ids.size(1) == -(-max(lens) // multiple) * multiple
        logp, ent = fw.policy_forward(model, mb, with_entropy=True, pack=pack)
        weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)
        out[multiple] = (logp.detach(), ent.detach(), _grads(model, (logp * weights).sum() + 0.1 * ent.sum()))
    torch.testing.assert_close(out[8][0], out[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[8][1], out[1][1], atol=1e-5, rtol=1e-5)
    for name, g in out[1][2].items():
        torch.testing.assert_close(out[8][2][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_row_padded_to_the_multiple(model, monkeypatch):
    """The packed row itself reaches the model at a multiple of 8 tokens."""
    from relax.backends.training import packing

    seen = []
    real = packing.decoder_hidden
    monkeypatch.setattr(
        packing, "decoder_hidden", lambda m, **kw: seen.append(kw["input_ids"].shape) or real(m, **kw)
    )
    ids = torch.arange(1, 12)
    packing.packed_response_states(model, ids, torch.tensor([5, 6]), torch.tensor([2, 3]), multiple=8)
    assert seen == [torch.Size([1, 16])]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: SDPA's flash kernel in bf16")
def test_right_padded_flash_path_matches_masked_path_on_a_gpu(model):
    """On a GPU the mask-free layout runs SDPA's flash kernel, the masked one another kernel: in bf16 the
    two agree to bf16 noise against the fp32 result."""
    batch = make_batch(n=8, seed=7)
    idx = list(range(8))
    gpu = copy.deepcopy(model).to("cuda", torch.bfloat16)
    with torch.no_grad():
        ref, _ = fw.policy_forward(model, fw.build_micro_batch(batch, idx, torch.device("cpu")), False, "off")
        got = {
            right: fw.policy_forward(
                gpu, fw.build_micro_batch(batch, idx, torch.device("cuda"), right=right), False, "off"
            )[0]
            .float()
            .cpu()
            for right in (False, True)
        }
    for right, logp in got.items():
        assert (logp - ref).abs().max() < 0.05, right  # bf16 against fp32
    assert (got[True] - got[False]).abs().max() < 0.05

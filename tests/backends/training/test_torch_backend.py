"""The one-rank torch trainer: log-probs, micro-batching equivalence, checkpoints."""

from __future__ import annotations

import math
import random

import torch
from transformers import AutoModelForCausalLM

from relax.algorithms import AlgorithmConfig
from relax.algorithms.pipeline import make_policy_loss
from relax.backends.training.torch_backend import TorchTrainer
from relax.config import TrainerConfig
from relax.data.batch import TrainBatch, pack_micro_batches


def make_batch(n=6, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, 400, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    resps = [
        torch.randint(0, 400, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    b = TrainBatch(
        prompt_ids=prompts,
        response_ids=resps,
        loss_mask=[[1.0] * len(r) for r in resps],
        rollout_log_probs=[[0.0] * len(r) for r in resps],
        rewards=[float(i % 2) for i in range(n)],
        group_index=[i // 2 for i in range(n)],
        weight_versions=[0] * n,
    )
    b.advantages = [torch.full((len(r),), 1.0 if i % 2 else -1.0) for i, r in enumerate(resps)]
    return b


def test_pack_micro_batches_respects_budget():
    lens = [5, 1, 9, 3, 3, 7]
    batches = pack_micro_batches(lens, 12)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or max(lens[i] for i in b) * len(b) <= 12


def test_pack_micro_batches_is_even_at_the_fewest_count():
    # filled to the budget these would be 4 + 4 + 1 samples: a sliver that makes compiled layers
    # meet a new, much smaller shape (docs/gpus.md)
    assert [len(b) for b in pack_micro_batches([100] * 9, 400)] == [3, 3, 3]
    rng = random.Random(0)
    for _ in range(50):
        lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 200))]
        budget = rng.randint(300, 5000)
        batches = pack_micro_batches(lens, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lens)))
        assert all(max(lens[i] for i in b) * len(b) <= budget for b in batches)
        assert len(batches) == _greedy_count(lens, budget)  # as few as filling them would take


def _greedy_count(lens: list[int], budget: int) -> int:
    """The micro-batches that filling each to the budget in sorted order takes: the fewest possible."""
    count, current = 0, []
    for n in sorted(lens):
        if current and n * (len(current) + 1) > budget:
            count, current = count + 1, []
        current.append(n)
    return count + bool(current)


def test_log_probs_match_manual_forward(tiny_model_dir):
    tr = TorchTrainer(str(tiny_model_dir), TrainerConfig(max_tokens_per_micro_batch=16))
    b = make_batch()
    got = tr.compute_log_probs(b)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for i in range(len(b)):
        ids = torch.tensor([b.prompt_ids[i] + b.response_ids[i]])
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        P = len(b.prompt_ids[i])
        want = torch.stack([logp[P - 1 + t, ids[0, P + t]] for t in range(len(b.response_ids[i]))])
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def _train_once(model_dir, budget):
    tr = TorchTrainer(str(model_dir), TrainerConfig(max_tokens_per_micro_batch=budget, lr=1e-2), seed=0)
    b = make_batch()
    b.old_log_probs = tr.compute_log_probs(b)
    metrics = tr.train_batch(b, make_policy_loss(AlgorithmConfig()))
    # After one AdamW step exp_avg = (1 - beta1) * grad: a linear read-out of the accumulated gradient
    # (the weights themselves move by ~lr*sign(grad), which amplifies float noise on near-zero grads).
    grads = {n: tr.optimizer.state[p]["exp_avg"].clone() for n, p in tr.model.named_parameters()}
    return metrics, grads


def test_micro_batching_equals_one_batch(tiny_model_dir):
    m1, g1 = _train_once(tiny_model_dir, budget=10_000)
    m2, g2 = _train_once(tiny_model_dir, budget=12)
    assert abs(m1["train/loss"] - m2["train/loss"]) < 1e-5
    assert abs(m1["train/grad_norm"] - m2["train/grad_norm"]) < 1e-4
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], atol=1e-6, rtol=1e-4)


def test_checkpoint_round_trip(tiny_model_dir, tmp_path):
    cfg = TrainerConfig(lr=1e-2)
    tr = TorchTrainer(str(tiny_model_dir), cfg)
    b = make_batch()
    b.old_log_probs = tr.compute_log_probs(b)
    loss_fn = make_policy_loss(AlgorithmConfig())
    tr.train_batch(b, loss_fn)
    tr.save(tmp_path)
    tr.train_batch(b, loss_fn)
    after_two = {k: v.clone() for k, v in tr.model.state_dict().items()}

    tr2 = TorchTrainer(str(tiny_model_dir), cfg)
    tr2.load(tmp_path)
    assert tr2.step == 1
    tr2.train_batch(b, loss_fn)  # the restored optimizer state must give the same second step
    for k, v in tr2.model.state_dict().items():
        torch.testing.assert_close(v, after_two[k], atol=1e-6, rtol=1e-5)


def test_weight_version_counts_training_steps_not_mini_batches(tiny_model_dir):
    """With num_mini_batches=3 one step takes three optimizer steps, but the policy moves one version:
    staleness, sample versions and the resume step are all counted in training steps."""
    tr = TorchTrainer(str(tiny_model_dir), TrainerConfig(lr=1e-2, num_mini_batches=3), total_steps=4)
    b = make_batch()
    b.old_log_probs = tr.compute_log_probs(b)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.train_batch(b, make_policy_loss(AlgorithmConfig()))
    assert tr.step == 1
    assert tr.scheduler.last_epoch == 3  # the schedule still advances per optimizer step
    assert any(not torch.equal(v, before[k]) for k, v in tr.model.state_dict().items())


def test_ratio_check_reads_the_first_optimizer_step(tiny_model_dir):
    """The on-policy check comes from the training forward of the first mini-batch (before any update),
    with no extra forward: 1 when pi_old came from these weights, the exact ratio where it did not, and
    rows without engine log-probs left out of the behaviour ratio."""
    tr = TorchTrainer(
        str(tiny_model_dir), TrainerConfig(lr=1e-2, num_mini_batches=2, max_tokens_per_micro_batch=12)
    )
    loss = make_policy_loss(AlgorithmConfig())
    b = make_batch()  # mini-batches [0, 2, 4] and [1, 3, 5]
    b.old_log_probs = tr.compute_log_probs(b)
    b.rollout_log_probs = [lp.tolist() for lp in b.old_log_probs]
    b.rollout_log_probs[4] = []  # no engine log-probs for this row
    b.old_log_probs[1] = b.old_log_probs[1] + 0.5  # off by 0.5, but in the second mini-batch
    m = tr.train_batch(b, loss)
    assert m["staleness/first_mb_ratio_dev"] < 1e-5
    assert m["staleness/first_mb_behaviour_ratio_dev"] < 1e-5

    b.old_log_probs = tr.compute_log_probs(b)
    b.rollout_log_probs = [lp.tolist() for lp in b.old_log_probs]
    b.old_log_probs[2] = b.old_log_probs[2].clone()
    b.old_log_probs[2][0] += 0.5  # one token of the first mini-batch: ratio exp(-0.5)
    b.rollout_log_probs[0][0] -= 0.25  # behaviour ratio exp(0.25)
    m = tr.train_batch(b, loss)
    assert abs(m["staleness/first_mb_ratio_dev"] - (1 - math.exp(-0.5))) < 1e-4
    assert abs(m["staleness/first_mb_behaviour_ratio_dev"] - (math.exp(0.25) - 1)) < 1e-4


def test_pad_ragged_pads_cuts_and_keeps_order():
    from relax.data.batch import pad_ragged

    rows = [[1.5, 2.0, 3.0], [], [4.0], [5.0, 6.0, 7.0, 8.0, 9.0]]
    want = torch.tensor([[1.5, 2.0, 3.0, 0.0], [0, 0, 0, 0], [4.0, 0, 0, 0], [5.0, 6.0, 7.0, 8.0]])
    assert torch.equal(pad_ragged(rows, 4), want)
    assert torch.equal(pad_ragged([torch.tensor(r) for r in rows], 4), want)  # tensor rows alike
    assert torch.equal(pad_ragged([[1, 2], [3]], 3, dtype=torch.long), torch.tensor([[1, 2, 0], [3, 0, 0]]))
    assert pad_ragged([[], []], 2).abs().sum() == 0 and pad_ragged([], 3).shape == (0, 3)


def test_ragged_rows_cross_processes_as_one_tensor():
    import pickle

    from relax.data.batch import Ragged

    rows = Ragged([torch.arange(3.0), torch.zeros(0), torch.tensor([7.0])])
    back = pickle.loads(pickle.dumps(rows))
    assert isinstance(back, Ragged) and [r.tolist() for r in back] == [[0.0, 1.0, 2.0], [], [7.0]]
    b = make_batch(n=4)
    sub = pickle.loads(pickle.dumps(b.subset([3, 1])))  # tensor columns go flat
    assert isinstance(sub.advantages, Ragged) and torch.equal(sub.advantages[0], b.advantages[3])
    assert sub.prompt_ids == [b.prompt_ids[3], b.prompt_ids[1]]

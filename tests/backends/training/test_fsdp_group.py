"""FSDP2 rank groups on gloo: 1 rank == 2 ranks == micro-batched, and resume on another rank count."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_torch_backend import make_batch

from relax.algorithms import AlgorithmConfig
from relax.algorithms.pipeline import make_policy_loss
from relax.backends.inference.embedded.http.server import EngineServer
from relax.backends.training.rank_group import TrainerGroup, balance_by_tokens
from relax.backends.training.torch_backend import TorchTrainer
from relax.config import TrainerConfig
from relax.engine_api.client import EngineClient

LOSS = make_policy_loss(AlgorithmConfig())


def fsdp_cfg(**kw) -> TrainerConfig:
    base = {"backend": "fsdp", "lr": 1e-2, "threads": 1, "cpus_per_rank": 0.5, "device": "cpu"}
    return TrainerConfig(**{**base, **kw})


def train_step(trainer, batch) -> dict[str, float]:
    batch.old_log_probs = trainer.compute_log_probs(batch)
    return trainer.train_batch(batch, LOSS)


def test_balance_by_tokens_spreads_tokens_and_keeps_every_sample():
    lens = [10, 1, 9, 2, 8, 3, 7]
    shards = balance_by_tokens(lens, 2)
    assert sorted(i for s in shards for i in s) == list(range(7))
    loads = [sum(lens[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 2
    assert balance_by_tokens([5], 3) == [[0], [], []]  # an idle rank still takes part (dummy micro-batch)
    b = make_batch(n=4)
    sub = b.subset([3, 1])
    assert sub.prompt_ids == [b.prompt_ids[3], b.prompt_ids[1]] and len(sub) == 2


@pytest.fixture(scope="module")
def groups(tiny_model_dir, ray_cluster):
    """A 1-rank group that micro-batches (12-token budget) and a 2-rank group that does not."""
    made = {
        1: TrainerGroup(str(tiny_model_dir), fsdp_cfg(num_ranks=1, max_tokens_per_micro_batch=12)),
        2: TrainerGroup(str(tiny_model_dir), fsdp_cfg(num_ranks=2)),
    }
    yield made
    for g in made.values():
        if g.ranks:
            g.shutdown()


def test_one_rank_two_ranks_and_micro_batches_give_the_same_update(tiny_model_dir, groups):
    """The in-process trainer (1 rank, one batch) == FSDP 1 rank micro-batched == FSDP 2 ranks."""
    batch = make_batch(n=7)
    ref = TorchTrainer(str(tiny_model_dir), TrainerConfig(lr=1e-2, threads=1, device="cpu"))
    want_logp = ref.compute_log_probs(batch)
    want = train_step(ref, make_batch(n=7))
    want_grad = {n: ref.optimizer.state[p]["exp_avg"] for n, p in ref.model.named_parameters()}
    want_w = {n: t.clone() for n, t in ref.model.state_dict().items()}

    for ranks, group in groups.items():
        for got, exp in zip(group.compute_log_probs(batch), want_logp, strict=True):
            torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
        metrics = train_step(group, make_batch(n=7))
        assert group.step == 1
        assert abs(metrics["train/loss"] - want["train/loss"]) < 1e-5, ranks
        assert abs(metrics["train/grad_norm"] - want["train/grad_norm"]) < 1e-4, ranks
        assert metrics["staleness/first_mb_ratio_dev"] < 1e-4, ranks  # on-policy: the max over ranks
        # After one AdamW step exp_avg = (1 - beta1) * grad: the accumulated, all-reduced gradient.
        grads = group.gather_optimizer_state("exp_avg")
        for name, g in want_grad.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4)
        # The weights moved by ~lr*sign(grad): float noise on near-zero gradients may move an entry
        # by a fraction of lr (1e-2), hence the absolute tolerance.
        for name, w in group.named_weights():
            torch.testing.assert_close(w, want_w[name], atol=5e-4, rtol=0)


def test_resume_on_a_different_rank_count(tiny_model_dir, groups, tmp_path):
    """Save with 2 ranks, kill them, resume with 1; save with 1, resume with a new 2-rank group."""
    one, two = groups[1], groups[2]
    train_step(two, make_batch(seed=1))
    two.save(tmp_path / "ckpt_a")
    step_a = two.step
    train_step(two, make_batch(seed=2))
    uninterrupted = dict(two.named_weights())
    two.kill()  # the run dies after its checkpoint

    one.load(tmp_path / "ckpt_a")
    assert one.step == step_a
    train_step(one, make_batch(seed=2))
    assert one.step == step_a + 1
    _assert_weights_close(dict(one.named_weights()), uninterrupted)

    one.save(tmp_path / "ckpt_b")
    train_step(one, make_batch(seed=3))
    uninterrupted = dict(one.named_weights())
    groups[2] = two = TrainerGroup(str(tiny_model_dir), fsdp_cfg(num_ranks=2))
    two.load(tmp_path / "ckpt_b")
    assert two.step == step_a + 1
    train_step(two, make_batch(seed=3))
    assert two.step == step_a + 2
    _assert_weights_close(dict(two.named_weights()), uninterrupted)


def _assert_weights_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in got.items():
        torch.testing.assert_close(w, want[name], atol=1e-4, rtol=1e-4)


def test_full_publish_skips_the_tied_head_and_the_engine_matches(tiny_model_dir, groups):
    """2 ranks publish every weight but the LM head, which is the embedding (tie_word_embeddings): the
    engine ties it the same way, so its log-probs then match the trainer's."""
    group = groups[2]
    train_step(group, make_batch(seed=4))
    full = dict(group.named_weights())
    assert "lm_head.weight" in full  # the trainer's state dict still names it
    server = EngineServer(str(tiny_model_dir), port=0, seed=0, dtype="float32")
    server.start()
    try:
        group.connect_engines([server.url])
        stats = group.send_from_ranks(version=group.step)
        head = full["lm_head.weight"]
        assert stats["perf/weight_sync_bytes"] == sum(t.numel() * t.element_size() for t in full.values()) - (
            head.numel() * head.element_size()
        )

        assert_engine_matches(group, server.url)
    finally:
        server.stop()


def assert_engine_matches(group: TrainerGroup, url: str) -> None:
    """The engine at `url` reports the group's weight version, and its log-probs of a sampled answer
    are the group's."""

    async def sample():
        client = EngineClient(url, timeout_s=60)
        try:
            return await client.generate([5, 6, 7, 8], {"max_new_tokens": 6, "ignore_eos": True})
        finally:
            await client.close()

    out = asyncio.run(sample())
    assert out.weight_version == str(group.step)
    batch = make_batch(n=1)
    batch.prompt_ids, batch.response_ids = [[5, 6, 7, 8]], [out.output_ids]
    got = group.compute_log_probs(batch)[0]
    torch.testing.assert_close(torch.tensor(out.output_log_probs), got, atol=1e-4, rtol=1e-4)


def test_ranks_that_do_not_fit_say_so_and_fail(ray_cluster, monkeypatch, caplog):
    """Ranks the cluster cannot place report what they wait for and what is free, then fail naming the
    keys to change, instead of hanging in the Actor's start-up."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    import relax.utils.placement as placement

    monkeypatch.setattr(placement, "PLACEMENT_WARN_S", 0.3)
    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 0.9)
    pg = placement_group([{"CPU": 1000}], strategy="PACK")
    with caplog.at_level("WARNING", logger="relax.utils.placement"):
        with pytest.raises(RuntimeError, match=r"2 training rank\(s\).*free now: CPU .*resources.num_cpus"):
            placement.wait_for_placement(pg, "2 training rank(s) of {'CPU': 1000}")
    assert sum("not placed after" in r.getMessage() for r in caplog.records) >= 2
    assert placement_group_table(pg)["state"] == "REMOVED"
    assert ray.is_initialized()


@pytest.mark.parametrize(
    "device,gpus,ranks,want",
    [("auto", 0, 2, False), ("auto", 1, 2, False), ("auto", 2, 2, True), ("cuda", 1, 2, True)],
)
def test_auto_device_asks_for_gpus_only_when_every_rank_gets_one(monkeypatch, device, gpus, ranks, want):
    """2 ranks on a 1-GPU host under `auto` train on the CPU instead of waiting forever for a second GPU."""
    import ray

    from relax.backends.training.rank_group import _wants_gpu

    monkeypatch.setattr(
        ray, "cluster_resources", lambda: {"CPU": 8.0, **({"GPU": float(gpus)} if gpus else {})}
    )
    assert _wants_gpu(TrainerConfig(device=device, num_ranks=ranks), ranks) is want

"""Blocking on the data plane between roles (fully_async): Advantages waits for both log_probs and
ref_log_probs; the Actor does not train on rows that miss a column; ActorFwd waits for the weights of
the previous step."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.config import load_config
from relax.data.columns import ADVANTAGES, ADVANTAGES_METRICS, LOG_PROBS, REF_LOG_PROBS
from relax.data.rows import sample_to_row
from relax.data.sample import Sample
from relax.dataplane.plane import LocalDataPlane
from relax.orchestration.registry import roles_for
from relax.roles.actor import ActorRole
from relax.roles.actor_fwd import ActorFwdRole
from relax.roles.advantages import AdvantagesRole


@pytest.fixture
def cfg(tiny_model_dir, arith_file, tmp_path):
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "schedule.mode=fully_async",
            "schedule.data_plane=ray",
            "algorithm.kl_coef=0.1",  # the loss needs reference log-probs
            "trainer.threads=1",
        ],
    )


def step_rows():
    out = []
    for g in range(2):
        for k in range(2):
            s = Sample(index=g, prompt="1+1=", prompt_ids=[5, 6, 7], group_id=g, sample_id=k)
            s.response_ids = [8, 9] if k else [8]
            s.rollout_log_probs = [-1.0] * len(s.response_ids)
            s.reward = float(k)
            s.weight_versions = [0]
            out.append(sample_to_row(s))
    return out


async def put_step(plane, step):
    """Step `step`'s rows with their advantages, as the Actor takes them in fully_async."""
    rows = step_rows()
    ids = await plane.put_rows(f"train_{step}", rows)
    advantages = [[1.0] * len(r["response_ids"]) for r in rows]
    metrics = [{"advantages/advantage_std": 0.0}] + [{}] * (len(rows) - 1)
    await plane.put_columns(f"train_{step}", ids, {ADVANTAGES: advantages, ADVANTAGES_METRICS: metrics})


def test_advantages_wait_for_log_probs_and_ref_log_probs(cfg):
    async def main():
        plane = LocalDataPlane()
        adv = AdvantagesRole(cfg, plane=plane)
        fwd = ActorFwdRole(cfg, plane=plane)
        ref = ActorFwdRole(cfg, reference=True, plane=plane)
        await plane.put_rows("train_1", step_rows())
        task = asyncio.create_task(adv.process(1))
        await ref.process(1)  # reference log-probs alone are not enough
        await asyncio.sleep(0.3)
        assert not task.done()
        assert plane.status("train_1")["columns"].get(ADVANTAGES) is None
        fwd_task = asyncio.create_task(fwd.process(1))
        await asyncio.sleep(0.3)
        assert not fwd_task.done()  # ActorFwd waits for the weights trained through step 0
        await fwd.set_weights(fwd.model.state_dict(), 0)
        await fwd_task
        await asyncio.wait_for(task, 30)
        cols = plane.status("train_1")["columns"]
        assert cols[LOG_PROBS] == cols[REF_LOG_PROBS] == cols[ADVANTAGES] == 4

    asyncio.run(main())


def test_actor_does_not_train_on_rows_missing_a_column(cfg):
    async def main():
        plane = LocalDataPlane()
        actor = ActorRole(cfg, plane=plane)
        rows = step_rows()
        ids = await plane.put_rows("train_1", rows)
        fake = {LOG_PROBS: [[-1.0] * len(r["response_ids"]) for r in rows]}
        fake[ADVANTAGES] = [[1.0] * len(r["response_ids"]) for r in rows]
        fake[ADVANTAGES_METRICS] = [{"advantages/advantage_std": 0.5}] + [{}] * (len(rows) - 1)
        await plane.put_columns("train_1", ids, fake)  # everything but ref_log_probs
        train = asyncio.create_task(actor.train(1))
        await asyncio.sleep(0.5)
        assert not train.done() and actor.trainer.step == 0
        await plane.put_columns("train_1", ids[:3], {REF_LOG_PROBS: fake[LOG_PROBS][:3]})
        await asyncio.sleep(0.3)
        assert not train.done() and actor.trainer.step == 0  # one row still misses it
        await plane.put_columns("train_1", ids[3:], {REF_LOG_PROBS: fake[LOG_PROBS][3:]})
        metrics = await asyncio.wait_for(train, 60)
        assert actor.trainer.step == 1 and "train/loss" in metrics
        assert metrics["advantages/advantage_std"] == 0.5  # Advantages' metrics come with the rows
        assert plane.status("train_1") == {"rows": 0}  # cleared after training

    asyncio.run(main())


def test_rollout_log_probs_as_pi_old_need_no_actor_fwd(cfg):
    """`algorithm.old_log_probs: rollout`: fully_async deploys no ActorFwd; Advantages takes pi_old from
    the rollout column and the Actor trains on rows that never get a `log_probs` column. The in-process
    Actor (colocate, hybrid) uses the rollout log-probs too instead of forwarding."""
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"old_log_probs": "rollout"})})
    assert "actor_fwd" not in [r.name for r in roles_for(cfg)]
    assert "reference" in [r.name for r in roles_for(cfg)]  # kl_coef > 0

    async def main():
        plane = LocalDataPlane()
        adv, actor = AdvantagesRole(cfg, plane=plane), ActorRole(cfg, plane=plane)
        rows = step_rows()
        ids = await plane.put_rows("train_1", rows)
        task = asyncio.create_task(adv.process(1))
        await asyncio.sleep(0.3)
        assert not task.done()  # still waits for the reference
        await plane.put_columns("train_1", ids, {REF_LOG_PROBS: [r["rollout_log_probs"] for r in rows]})
        await asyncio.wait_for(task, 30)
        assert LOG_PROBS not in plane.status("train_1")["columns"]
        metrics = await asyncio.wait_for(actor.train(1), 60)
        assert actor.trainer.step == 1 and "train/loss" in metrics
        assert metrics["perf/actor_old_log_probs_s"] >= 0.0  # filled in process from the rollout column
        assert "advantages/advantage_std" in metrics and "advantages/reward_mean" in metrics

    asyncio.run(main())
    algo = cfg.algorithm.model_copy(update={"kl_coef": 0.0})
    res = cfg.schedule.model_copy(update={"mode": "colocate"})
    actor = ActorRole(cfg.model_copy(update={"algorithm": algo, "schedule": res}), plane=LocalDataPlane())
    from relax.data.rows import batch_from_columns

    batch = batch_from_columns({k: [r[k] for r in step_rows()] for k in step_rows()[0]})
    times: dict[str, float] = {}
    metrics = actor.train_sync(batch, times)
    assert [t.tolist() for t in batch.old_log_probs] == [[-1.0], [-1.0, -1.0], [-1.0], [-1.0, -1.0]]
    assert "train/loss" in metrics


def test_rollout_log_probs_as_pi_old_need_temperature_one(tiny_model_dir, arith_file):
    with pytest.raises(ValueError, match="rollout.temperature=1.0 or algorithm.old_log_probs=recompute"):
        load_config(
            None,
            [
                f"model.path={tiny_model_dir}",
                f"data.train_files=[{arith_file}]",
                "algorithm.old_log_probs=rollout",
                "rollout.temperature=0.7",
            ],
        )


@pytest.mark.parametrize("with_update", [True, False])
def test_actor_takes_the_next_steps_rows_ahead(cfg, with_update):
    """Streaming modes: the Actor takes step 2's rows before `train(2)` asks for them, so step 2 does not
    wait for them. With the update in rank processes (`fetch_with_update`) the fetch runs while step 1
    trains; with the in-process trainer it starts when step 1's update ends (and overlaps the weight push).
    The Actor reports holding step 2 (a restarted stage role starts after it); nothing is fetched past the
    last step, and every trained partition is cleared."""
    algo = cfg.algorithm.model_copy(update={"kl_coef": 0.0, "old_log_probs": "rollout"})
    res = cfg.schedule.model_copy(update={"debug_train_delay_s": 1.0})
    trainer = cfg.trainer.model_copy(update={"num_steps": 2})
    cfg = cfg.model_copy(update={"algorithm": algo, "schedule": res, "trainer": trainer})

    async def main():
        plane = LocalDataPlane()
        actor = ActorRole(cfg, plane=plane)
        assert actor.prefetch and not actor.fetch_with_update  # auto: on; the in-process trainer's way
        off = cfg.schedule.model_copy(update={"fetch_ahead": False})
        assert not ActorRole(cfg.model_copy(update={"schedule": off}), plane=plane).prefetch
        actor.fetch_with_update = with_update
        await put_step(plane, 1)
        train = asyncio.create_task(actor.train(1))
        await asyncio.sleep(0.3)  # step 1 is in its update
        assert actor.received_step() == 1
        await put_step(plane, 2)  # completes while step 1 trains
        await asyncio.sleep(0.3)
        assert not train.done()
        assert actor.received_step() == (2 if with_update else 1)
        await asyncio.wait_for(train, 60)
        await asyncio.sleep(0.3)  # the driver would be pushing the weights now
        assert actor.received_step() == 2 and plane.status("train_2")["consumed"] == {"actor": 4}
        gets, get = [], plane.get

        async def counted_get(*args, **kwargs):
            gets.append(args[0])
            return await get(*args, **kwargs)

        plane.get = counted_get
        metrics = await asyncio.wait_for(actor.train(2), 60)
        # step 2 trained on the rows fetched ahead: it asked the plane for nothing more
        assert actor.trainer.step == 2 and gets == [] and metrics["perf/actor_wait_data_s"] >= 0
        assert actor._next is None  # step 2 is the last one: nothing fetched ahead
        assert plane.status("train_1") == plane.status("train_2") == {"rows": 0}

    asyncio.run(main())


def test_overlap_push_publishes_the_weights_the_update_ended_with(cfg):
    """overlap_push: the push of step 1, which runs while step 2 trains, sends the copy of the weights kept
    when step 1's update ended, not the live weights step 2 changes (here: has changed)."""
    algo = cfg.algorithm.model_copy(update={"kl_coef": 0.0, "old_log_probs": "rollout"})
    res = cfg.schedule.model_copy(update={"fetch_ahead": False})
    trainer = cfg.trainer.model_copy(update={"num_steps": 2})
    cfg = cfg.model_copy(update={"algorithm": algo, "schedule": res, "trainer": trainer})

    async def main():
        plane = LocalDataPlane()
        actor = ActorRole(cfg, plane=plane)
        assert actor.overlap_push  # auto: the in-process trainer in a streaming mode
        sent: list[tuple[int, dict]] = []

        class Recorder:  # a sender without receivers: one bucket, recorded
            connected, bucket_bytes = True, 1 << 40

            async def send_bucket(self, bucket, version, last):
                sent.append((version, {n: t.clone() for n, t in bucket}))

        actor.sender = Recorder()
        await put_step(plane, 1)
        await put_step(plane, 2)
        await actor.train(1)
        after_1 = {n: t.detach().clone() for n, t in actor.trainer.named_weights()}
        await actor.train(2)
        assert await actor.push_weights(1) == 1
        version, weights = sent[0]
        assert version == 1 and actor.trainer.step == 2
        assert all(torch.equal(weights[n], after_1[n]) for n in weights)
        live = dict(actor.trainer.named_weights())
        assert any(not torch.equal(weights[n], live[n]) for n in weights)  # step 2 changed the live ones
        assert await actor.push_weights() == 2  # no version: the current weights

    asyncio.run(main())

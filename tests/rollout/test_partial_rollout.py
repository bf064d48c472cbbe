"""Partial rollout: a weight update aborts in-flight generation, unfinished samples continue under the new
weights with their earlier tokens and behaviour log-probs kept and every version recorded; a sample at
the abort cap is waited for instead; in `in_place` mode the engines pause and requests run on across the
update; without partial rollout the update waits for generation to end."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from relax.rollout.partial_rollout import InflightRequests


class FakeEngine:
    """Emits one token per tick with log-prob -version; an abort ends the request with what it has."""

    def __init__(self) -> None:
        self.version = 0
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.calls: list[str] = []  # "all" or the rid of each abort call, "pause", "resume"
        self.engines = {"e0": SimpleNamespace(client=self)}
        self.resumed = asyncio.Event()
        self.resumed.set()

    async def pause(self, mode: str) -> None:
        assert mode == "in_place"
        self.calls.append("pause")
        self.resumed.clear()

    async def resume(self) -> None:
        self.calls.append("resume")
        self.resumed.set()

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.calls.append("all" if abort_all else rid)
        self.aborted |= set(self.running) if abort_all else {rid}

    async def generate(self, prompt_ids, params, rid=None):
        self.running.add(rid)
        try:
            return await self._generate(prompt_ids, params, rid)
        finally:
            self.running.discard(rid)

    async def _generate(self, prompt_ids, params, rid):
        outs = []
        ids, lps = [], []
        versions, starts = [str(self.version)], [0]
        for _ in range(params["max_new_tokens"]):
            if rid in self.aborted:
                break
            await asyncio.sleep(0.01)
            await self.resumed.wait()
            if str(self.version) != versions[-1]:  # updated in place while it ran
                versions.append(str(self.version))
                starts.append(len(ids))
            ids.append(len(prompt_ids) + len(ids))
            lps.append(-float(self.version))
        finish = "abort" if rid in self.aborted else "length"
        for _ in range(params.get("n", 1)):
            outs.append(
                SimpleNamespace(
                    output_ids=list(ids),
                    output_log_probs=list(lps),
                    finish_reason=finish,
                    weight_version=str(self.version),
                    text="",
                    weight_versions=versions if len(versions) > 1 else [],
                    weight_version_starts=starts if len(versions) > 1 else [],
                )
            )
        return outs


async def update(inflight: InflightRequests, engine: FakeEngine) -> None:
    await inflight.begin_update()
    engine.version += 1
    await inflight.end_update()


def test_update_aborts_and_samples_resume_under_new_weights():
    async def main():
        engine = FakeEngine()
        inflight = InflightRequests(engine, partial=True, max_aborts=2)
        group = asyncio.create_task(inflight.generate_group([1, 2], {"n": 2, "max_new_tokens": 20}))
        await asyncio.sleep(0.05)
        await update(inflight, engine)
        out = await group
        for g in out:
            assert len(g.output_ids) == 20 and g.finish_reason == "length"
            assert g.weight_versions == [0, 1] and g.aborts == 1
            k = g.offpolicy_len
            assert 0 < k < 20
            assert g.log_probs[:k] == [0.0] * k and g.log_probs[k:] == [-1.0] * (20 - k)  # kept, then new
        assert inflight.num_aborted == 1
        assert engine.calls == ["all"]  # everything in flight was abortable: one call per engine

    asyncio.run(main())


def test_a_sample_at_the_abort_cap_is_waited_for():
    async def main():
        engine = FakeEngine()
        inflight = InflightRequests(engine, partial=True, max_aborts=1)
        group = asyncio.create_task(inflight.generate_group([1], {"n": 1, "max_new_tokens": 30}))
        await asyncio.sleep(0.05)
        await update(inflight, engine)  # first abort
        await asyncio.sleep(0.05)
        await update(inflight, engine)  # at the cap: the update waits for the sample to finish
        (g,) = await group
        assert g.aborts == 1 and g.weight_versions == [0, 1] and len(g.output_ids) == 30

    asyncio.run(main())


def test_without_partial_rollout_the_update_waits():
    async def main():
        engine = FakeEngine()
        inflight = InflightRequests(engine, partial=False)
        group = asyncio.create_task(inflight.generate_group([1], {"n": 1, "max_new_tokens": 10}))
        await asyncio.sleep(0.03)
        await update(inflight, engine)
        assert group.done()  # the update waited for generation to end
        (g,) = group.result()
        assert g.weight_versions == [0] and g.aborts == 0 and len(g.output_ids) == 10

    asyncio.run(main())


def test_a_capped_sample_is_not_aborted_with_the_others():
    """One sample at the cap and one below it: the update aborts only the second, by rid (an
    `abort_all` would also end the capped one), and waits for the first to finish."""

    async def main():
        engine = FakeEngine()
        inflight = InflightRequests(engine, partial=True, max_aborts=1)
        capped = asyncio.create_task(inflight.generate_group([1], {"n": 1, "max_new_tokens": 30}))
        await asyncio.sleep(0.05)
        await update(inflight, engine)  # aborts `capped` once: it is now at the cap
        fresh = asyncio.create_task(inflight.generate_group([2], {"n": 1, "max_new_tokens": 30}))
        await asyncio.sleep(0.05)
        engine.calls.clear()
        await update(inflight, engine)
        assert engine.calls and "all" not in engine.calls and len(engine.calls) == 1
        (c,), (f,) = await capped, await fresh
        assert c.aborts == 1 and len(c.output_ids) == 30  # finished under the update, not aborted again
        assert f.aborts == 1 and f.weight_versions == [1, 2] and len(f.output_ids) == 30

    asyncio.run(main())


async def in_place_update(engine, during=None) -> InflightRequests:
    """A group of 2 x 20 tokens across one in-place update (the engine's version bumped during it, after
    `during(inflight)`): no sample is aborted or repeated, and each keeps the old tokens' log-probs."""
    inflight = InflightRequests(engine, partial=True, max_aborts=0, partial_mode="in_place")
    group = asyncio.create_task(inflight.generate_group([1, 2], {"n": 2, "max_new_tokens": 20}))
    await asyncio.sleep(0.05)
    await inflight.begin_update()
    assert not group.done() and inflight.inflight  # nothing aborted, nothing waited for
    if during is not None:
        await during(inflight)
    engine.version += 1  # the push
    await inflight.end_update()
    for g in await group:
        assert len(g.output_ids) == 20 and g.finish_reason == "length"
        assert g.weight_versions == [0, 1] and g.aborts == 0
        k = g.offpolicy_len  # tokens before the update
        assert 0 < k < 20
        assert g.log_probs[:k] == [0.0] * k and g.log_probs[k:] == [-1.0] * (20 - k)
    assert inflight.num_aborted == 0
    return inflight


def test_in_place_the_engines_pause_and_requests_run_on_under_the_new_weights():
    engine = FakeEngine()
    asyncio.run(in_place_update(engine))
    assert engine.calls == ["pause", "resume"]


class LiveEngine(FakeEngine):
    """An engine that loads a push between two steps on its own (the embedded engine)."""

    base_url = "http://127.0.0.1:1"

    async def model_info(self) -> dict:
        self.calls.append("model_info")
        return {"live_weight_updates": True}


def test_in_place_an_engine_that_loads_live_is_not_paused_and_new_requests_go_on():
    async def late_request(inflight: InflightRequests) -> None:
        # during the push a new request is not held back until the update ends
        late = await asyncio.wait_for(inflight.generate([3], {"n": 1, "max_new_tokens": 2}), timeout=5)
        assert len(late[0].output_ids) == 2

    async def main():
        inflight = await in_place_update(engine, late_request)
        await inflight.begin_update()  # the engine was asked once
        await inflight.end_update()

    engine = LiveEngine()
    asyncio.run(main())
    assert engine.calls == ["model_info"]  # never paused nor resumed


def test_an_unknown_partial_mode_is_refused():
    with pytest.raises(ValueError, match="use abort or in_place"):
        InflightRequests(FakeEngine(), partial=True, partial_mode="keep")

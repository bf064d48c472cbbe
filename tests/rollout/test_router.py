"""The router over two real engine servers, each `relax engine serve` in its own process on 127.0.0.1:
load spreading, prompt-group affinity, engines added and removed at run time, an engine SIGKILLed while
requests are in flight (all of them complete on the other, the dead one is marked unhealthy), and a
health probe that takes the restarted engine back.
"""

from __future__ import annotations

import asyncio

import pytest

from relax.backends.inference.launcher import (
    ServerProcess,
    embedded_engine_command,
    server_url,
)
from relax.engine_api.client import EngineClient
from relax.rollout.router import NoHealthyEngineError, Router
from relax.utils.net import free_port

PROMPT = [5, 6, 7, 8]
ENGINE_ARGS = ("--threads", "1", "--dtype", "float32", "--max-running", "16", "--seed", "0")


def start_engine(model_dir, port: int | None = None) -> ServerProcess:
    port = port or free_port()
    cmd = embedded_engine_command(str(model_dir), port, "127.0.0.1", *ENGINE_ARGS)
    return ServerProcess(cmd, server_url("127.0.0.1", port)).start(timeout_s=120)


async def slow_down(urls: list[str], seconds: float | None) -> None:
    for url in urls:
        async with EngineClient(url) as c:
            await c.slow_down(seconds)


def params(n_tokens: int) -> dict:
    return {"max_new_tokens": n_tokens, "ignore_eos": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    procs = [start_engine(tiny_model_dir), start_engine(tiny_model_dir)]
    yield procs
    for p in procs:
        p.stop()


def served(router: Router) -> dict[str, int]:
    return {row["url"]: row["served"] for row in router.status()}


def test_spreads_load_and_keeps_groups_together(engines):
    urls = [p.url for p in engines]

    async def main() -> None:
        await slow_down(urls, 0.01)
        router = Router(urls, timeout_s=60)
        try:
            await asyncio.gather(*(router.generate(PROMPT, params(8)) for _ in range(8)))
            assert all(n >= 2 for n in served(router).values()), router.status()  # least outstanding
            before = served(router)
            outs = await asyncio.gather(
                *(router.generate(PROMPT, params(4), group_key="prompt-17") for _ in range(6))
            )
            grew = {u for u, n in served(router).items() if n > before[u]}
            assert len(grew) == 1 and all(len(o.output_ids) == 4 for o in outs)
            group = await router.generate(PROMPT, {**params(4), "n": 3})  # one request, one engine
            assert len(group) == 3
        finally:
            await slow_down(urls, None)
            await router.close()

    asyncio.run(main())


def test_engines_added_and_removed_at_run_time(engines):
    first, second = (p.url for p in engines)

    async def main() -> None:
        await slow_down([first], 0.02)
        router = Router([first], timeout_s=60)
        try:
            in_flight = asyncio.create_task(router.generate(PROMPT, params(30)))
            await asyncio.sleep(0.3)
            router.add_engine(second)
            router.remove_engine(first)
            assert router.urls() == [second]
            outs = await asyncio.gather(*(router.generate(PROMPT, params(3)) for _ in range(4)))
            assert served(router) == {second: 4} and all(len(o.output_ids) == 3 for o in outs)
            assert len((await in_flight).output_ids) == 30  # finished on the removed engine
            router.remove_engine(second)
            with pytest.raises(NoHealthyEngineError):
                await router.generate(PROMPT, params(1))
        finally:
            await slow_down([first], None)
            await router.close()

    asyncio.run(main())


@pytest.mark.timeout(240)
def test_killed_engine_work_moves_elsewhere_and_probe_brings_it_back(engines, tiny_model_dir):
    victim, survivor = engines
    urls = [victim.url, survivor.url]

    async def main() -> None:
        await slow_down(urls, 0.03)
        router = Router(urls, timeout_s=60)
        try:
            tasks = [asyncio.create_task(router.generate(PROMPT, params(40))) for _ in range(8)]
            for _ in range(200):  # until both engines hold requests
                if all(e.outstanding > 0 for e in router.engines.values()):
                    break
                await asyncio.sleep(0.02)
            assert router.engines[victim.url].outstanding > 0
            await asyncio.sleep(0.2)  # mid-generation
            victim.kill()
            outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            assert [len(o.output_ids) for o in outs] == [40] * 8
            assert all(o.finish_reason == "length" for o in outs)
            assert not router.engines[victim.url].healthy
            assert router.urls(healthy_only=True) == [survivor.url]
            assert served(router)[victim.url] == 0
            assert (await router.probe())[victim.url] is False

            port = int(victim.url.rsplit(":", 1)[1])
            engines[0] = start_engine(tiny_model_dir, port)  # the restarted engine, same URL
            assert (await router.probe())[victim.url] is True
            await slow_down([survivor.url], 0.05)  # the restarted one is now the less loaded
            outs = await asyncio.gather(*(router.generate(PROMPT, params(6)) for _ in range(6)))
            assert served(router)[victim.url] > 0 and all(len(o.output_ids) == 6 for o in outs)
        finally:
            await slow_down([survivor.url], None)
            await router.close()

    asyncio.run(main())


def test_background_health_checks_mark_a_dead_engine(tiny_model_dir):
    proc = start_engine(tiny_model_dir)

    async def main() -> None:
        router = Router([proc.url], timeout_s=30, probe_timeout_s=2)
        router.start_health_checks(interval_s=0.2)
        try:
            proc.kill()
            for _ in range(100):
                if not router.engines[proc.url].healthy:
                    break
                await asyncio.sleep(0.1)
            assert not router.engines[proc.url].healthy
            with pytest.raises(NoHealthyEngineError):
                await router.generate(PROMPT, params(1))
        finally:
            await router.close()

    try:
        asyncio.run(main())
    finally:
        proc.stop()


def test_a_request_waits_for_a_replacement_when_no_engine_is_left(engines):
    """The only engine is dead: with `replacement_wait_s` the request waits (it holds no engine meanwhile,
    `waiting` says so) and is served by the engine added later; past the wait it fails naming it."""
    dead = f"http://127.0.0.1:{free_port()}"

    async def main() -> None:
        router = Router([dead], timeout_s=60)
        router.replacement_wait_s = 120.0
        try:
            request = asyncio.create_task(router.generate(PROMPT, params(2)))
            while router.waiting == 0:
                assert not request.done(), request
                await asyncio.sleep(0.05)
            router.remove_engine(dead)
            router.add_engine(engines[0].url)  # the replacement, once it holds the weights
            out = await request
            assert len(out.output_ids) == 2 and router.waiting == 0
            router.remove_engine(engines[0].url)
            router.add_engine(dead)
            router.replacement_wait_s = 0.5
            with pytest.raises(NoHealthyEngineError, match="waited 0.5s for a replacement"):
                await router.generate(PROMPT, params(2))
            assert router.waiting == 0
        finally:
            await router.close()

    asyncio.run(main())

"""`EngineFleet` (relax/fleet/fleet.py) on its own, with real engines: which backend it asks (the engine
registry), what it owns (engines it started, never external ones), its members around a replacement (a
failed engine leaves the router, its replacement joins the weight-sync group first and takes requests
only once admitted), and the elastic API it serves."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx
import pytest

from relax.backends.inference.embedded.http.server import EngineServer
from relax.backends.inference.registry import UnknownEngineError
from relax.config import load_config
from relax.fleet.fleet import REPLACEMENT_WAIT_S, EngineFleet
from relax.orchestration.preflight import PreflightError, check_local, missing_extras
from relax.utils.auth import auth_headers, process_token

GREEDY = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}


def _cfg(model_dir, *overrides: str):
    base = [f"model.path={model_dir}", "rollout.engine_threads=1", "rollout.engine_max_running=8"]
    return load_config("tests/toy_arith.yaml", [*base, *overrides])


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """An engine serving on loopback that the fleet did not start (an external engine)."""
    server = EngineServer(str(tiny_model_dir), port=0, threads=1, max_running=8, seed=0)
    server.start()
    yield server
    server.stop()


def test_an_unknown_engine_stops_the_run_before_ray_starts_naming_the_known_ones(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, "rollout.engine=vllm")
    with pytest.raises(
        PreflightError, match="'vllm' is no engine backend; the known ones are: embedded, ext"
    ):
        check_local(cfg)  # the driver's first check, before Ray
    with pytest.raises(UnknownEngineError, match="embedded, external, sglang"):
        EngineFleet(cfg)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_a_missing_engine_package_is_named_with_its_install_command(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, "rollout.engine=sglang")
    (problem,) = missing_extras(cfg)
    assert problem.startswith("rollout.engine = sglang needs the package 'sglang'")
    assert "pip install 'relax[sglang]'" in problem
    with pytest.raises(RuntimeError, match=r"needs the package 'sglang'.*pip install 'relax\[sglang\]'"):
        EngineFleet(cfg)  # before any engine starts: no Ray in this test


def test_external_engines_are_attached_and_left_running(tiny_model_dir, engine):
    cfg = _cfg(tiny_model_dir, "rollout.engine=external", f"rollout.engine_urls=[{engine.url}]")

    async def main() -> None:
        fleet = EngineFleet(cfg)
        assert fleet.backend.name == "external" and not fleet.backend.in_cluster
        assert (fleet.group, fleet.supervisor) == (None, None)  # nothing of its own to replace
        assert fleet.router.replacement_wait_s == 0  # so a request never waits for a replacement
        assert fleet.urls() == [engine.url]
        assert fleet.plan() is None  # no elastic manager: the group stays
        assert await fleet.replace_dead() == {"urls": [engine.url], "replaced": 0, "pending": []}
        assert fleet.admit() == []
        out = await fleet.router.generate([1, 2, 3], GREEDY)
        assert len(out.output_ids) == 2
        await fleet.close()

    asyncio.run(main())
    assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200  # closing left it running


def test_the_elastic_api_runs_on_the_roles_loop_and_stops_with_the_fleet(tiny_model_dir, engine):
    cfg = _cfg(tiny_model_dir, "rollout.engine=external", f"rollout.engine_urls=[{engine.url}]")
    fleet = EngineFleet(cfg)
    assert fleet.start_elastic() is None and fleet.elastic is None  # outside an event loop: no API

    async def main() -> None:
        url = fleet.start_elastic()
        assert url is not None and fleet.elastic is not None
        async with httpx.AsyncClient(headers=auth_headers(process_token()), timeout=30) as http:
            listed = (await http.get(f"{url}/v1/engines")).json()
            assert [e["url"] for e in listed["engines"]] == [engine.url]
            assert fleet.plan() is None  # no scale operation ran: the weight-sync group is unchanged
            await fleet.close()
            assert fleet.elastic is None
            with pytest.raises(httpx.TransportError):
                await http.get(f"{url}/v1/engines")

    asyncio.run(main())


async def _until_down(url: str) -> None:
    """Wait until the engine at `url` no longer answers (a killed actor takes its server down soon after)."""
    async with httpx.AsyncClient(timeout=2) as http:
        while True:
            try:
                await http.get(f"{url}/health")
            except httpx.TransportError:
                return
            await asyncio.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_failed_engine_is_replaced_and_takes_requests_only_once_admitted(ray_cluster, tiny_model_dir):
    import ray

    cfg = _cfg(tiny_model_dir, "rollout.num_engines=1", "resources.engine_gpus=0")

    async def main() -> None:
        fleet = EngineFleet(cfg)
        try:
            assert fleet.backend.name == "embedded" and fleet.router.replacement_wait_s == REPLACEMENT_WAIT_S
            first = list(fleet.group.urls)
            assert fleet.urls() == first and len(first) == 1
            # healthy engines are left alone
            assert await fleet.replace_dead() == {"urls": first, "replaced": 0, "pending": []}

            ray.kill(fleet.group.actors[0], no_restart=True)
            await _until_down(first[0])
            got = await fleet.replace_dead()
            (new,) = got["pending"]
            assert got["replaced"] == 1 and new == fleet.group.urls[0] and new not in first
            assert got["urls"] == [new]  # the weight-sync group to form: the replacement
            assert fleet.urls() == []  # it holds no weights yet: no requests (they wait for it)
            assert fleet.supervisor.restarts == 1

            assert fleet.admit() == [new]  # after the push that gave it the weights
            assert fleet.urls() == [new]
            async with httpx.AsyncClient(timeout=30) as http:
                assert (await http.get(f"{new}/health")).status_code == 200
            assert fleet.admit() == []  # once
        finally:
            await fleet.close()
        assert fleet.group is None

    asyncio.run(main())

"""The elastic API over real HTTP, without Ray: real embedded engines (in-process servers on loopback), a
real router with requests flowing, and a stand-in trainer that re-forms the weight-sync group and
publishes real weights (gloo) the way `StepFlow.push_weights` does, every few hundred milliseconds."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from relax.backends.inference.embedded.http.server import EngineServer
from relax.fleet.elastic_api import ElasticServer
from relax.fleet.elastic_manager import ElasticManager
from relax.rollout.router import Router
from relax.weights.publisher import WeightPublisher
from relax.weights.sender import send_weights

ENGINE_KW = {"threads": 1, "max_running": 8, "seed": 0}


class ThreadEngineProvider:
    """`ray_native` stand-in: engines as in-process servers."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self.started: list[EngineServer] = []
        self.stopped: list[EngineServer] = []

    def launch(self) -> EngineServer:
        server = EngineServer(str(self.model_dir), **ENGINE_KW)
        self.started.append(server)
        return server

    async def url(self, server: EngineServer) -> str:
        await asyncio.to_thread(server.start)
        return server.url

    async def stop(self, server: EngineServer, graceful: bool = True) -> None:
        await asyncio.to_thread(server.stop)
        self.stopped.append(server)


class Harness:
    """The role loop (a thread), a router with traffic, the manager and its API, a stand-in trainer."""

    def __init__(self, model_dir) -> None:
        from relax.models.multimodal_model import load_causal_lm

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.initial = EngineServer(str(model_dir), **ENGINE_KW)
        self.initial.start()
        self.provider = ThreadEngineProvider(model_dir)
        self.router = Router([self.initial.url], timeout_s=60)
        self.manager = self.run(self._make_manager())
        self.api = ElasticServer(self.manager, self.loop)
        self.url = self.api.start()
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.named = [(n, t.detach().clone()) for n, t in load_causal_lm(model_dir).state_dict().items()]
        self.pushing = threading.Event()
        self.pushing.set()
        self.version = 0
        self.publisher = WeightPublisher()
        self.run(self.publisher.connect([self.initial.url]))
        self._stop = False
        self.tasks = [self.submit(self._trainer()), self.submit(self._traffic())]

    async def _make_manager(self) -> ElasticManager:
        return ElasticManager(self.router, [self.initial.url], provider=self.provider, drain_timeout_s=10)

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _trainer(self) -> None:
        """What StepFlow.push_weights does for the manager, one 'step' every 0.3 s."""
        while not self._stop:
            await asyncio.sleep(0.3)
            if not self.pushing.is_set():
                continue
            plan = self.manager.plan()
            if plan is not None:
                await self.publisher.connect(plan)
                await self.manager.group_formed(plan)
            self.version += 1
            with torch.no_grad():  # weights change every step, so a stale engine would show
                self.named[0][1].add_(0.001)
            await send_weights(self.publisher, self.named, self.version)
            if plan is not None:
                await self.manager.pushed(self.version)

    async def _traffic(self) -> None:
        """Generation keeps flowing through the router, like the rollout loop's."""
        while not self._stop:
            await asyncio.gather(
                *(
                    self.router.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 1.0})
                    for _ in range(4)
                )
            )

    def wait_op(self, op_id: str, timeout: float = 90) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            op = self.http.get(f"/v1/operations/{op_id}").json()
            if op["done"]:
                return op
            time.sleep(0.1)
        raise AssertionError(f"operation {op_id} did not end in {timeout}s: {op}")

    def engines(self) -> list[dict]:
        return self.http.get("/v1/engines").json()["engines"]

    def close(self) -> None:
        self._stop = True
        for t in self.tasks:
            t.result(60)
        self.api.stop()
        self.run(self.manager.close())
        self.run(self.publisher.close())
        self.run(self.router.close())
        self.initial.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def harness(tiny_model_dir):
    h = Harness(tiny_model_dir)
    yield h
    h.close()


def test_bad_requests_are_4xx_with_a_message(harness):
    h = harness
    cases = [
        (
            "/v1/engines/scale_out",
            {"mode": "ray_native", "num_engines": -1},
            400,
            "greater than or equal to 1",
        ),
        ("/v1/engines/scale_out", {"mode": "ray_native"}, 400, "takes num_engines"),
        ("/v1/engines/scale_out", {"mode": "external", "engine_urls": ["ftp://x"]}, 400, "http(s)://"),
        ("/v1/engines/scale_out", {"mode": "warp", "num_engines": 2}, 400, "mode"),
        ("/v1/engines/scale_out", {"mode": "ray_native", "num_engines": 1}, 400, "already 1 engines"),
        ("/v1/engines/scale_out", {"mode": "ray_native", "num_engines": 99}, 400, "max_engines"),
        ("/v1/engines/scale_in", {"num_engines": 1, "engine_urls": ["http://a:1"]}, 400, "exactly one"),
        ("/v1/engines/scale_in", {"engine_urls": ["http://127.0.0.1:9"]}, 400, "unknown engine"),
        ("/v1/engines/scale_in", {"engine_urls": [h.initial.url]}, 400, "protected"),
        ("/v1/engines/scale_in", {"num_engines": 1}, 400, "num_engines must be below"),
    ]
    for path, body, status, words in cases:
        r = h.http.post(path, json=body)
        assert r.status_code == status, (body, r.text)
        assert words in r.json()["error"]["message"], (body, r.text)
    r = h.http.post(
        "/v1/engines/scale_out", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert h.http.get("/v1/operations/none-such").status_code == 404
    assert h.http.get("/v1/operations").json()["operations"] == []  # nothing was started


def test_scale_out_both_modes_then_scale_in_lifo(harness, tiny_model_dir):
    h = harness
    body = {"mode": "ray_native", "num_engines": 2}
    r = h.http.post("/v1/engines/scale_out", json=body, headers={"Idempotency-Key": "out-1"})
    assert r.status_code == 202, r.text
    assert r.json()["request_id"] == "out-1"
    busy = h.http.post("/v1/engines/scale_in", json={"num_engines": 1})
    assert busy.status_code == 409 and "one operation runs at a time" in busy.json()["error"]["message"]
    replay = h.http.post("/v1/engines/scale_out", json=body, headers={"Idempotency-Key": "out-1"})
    assert replay.status_code == 200 and replay.json()["request_id"] == "out-1"
    op = h.wait_op("out-1")
    assert op["state"] == "active", op
    states = [s["state"] for s in op["history"]]
    assert states == ["pending", "creating", "health_checking", "weight_syncing", "active"]
    native = op["engines"][0]

    external = EngineServer(str(tiny_model_dir), **ENGINE_KW)  # an engine someone else runs
    external.start()
    try:
        r = h.http.post("/v1/engines/scale_out", json={"mode": "external", "engine_urls": [external.url]})
        assert r.status_code == 202, r.text
        op = h.wait_op(r.json()["request_id"])
        assert op["state"] == "active", op
        assert [s["state"] for s in op["history"]][1] == "connecting"
        rows = {e["url"]: e for e in h.engines()}
        assert set(rows) == {h.initial.url, native, external.url}
        assert rows[h.initial.url]["protected"] and not rows[native]["protected"]
        for row in rows.values():  # every engine is healthy, routed, in the group and holds recent weights
            assert row["healthy"] and row["routed"] and row["in_weight_sync_group"], row
            assert int(row["weight_version"]) >= int(op["message"].split(" v")[1]), row
        deadline = time.monotonic() + 30
        while not all(e["served"] > 0 for e in h.engines()):  # the new engines take traffic
            assert time.monotonic() < deadline, h.engines()
            time.sleep(0.1)

        # scale in to 2: last in, first out -> the external engine goes; it keeps running
        r = h.http.post("/v1/engines/scale_in", json={"num_engines": 2})
        assert r.status_code == 202, r.text
        op = h.wait_op(r.json()["request_id"])
        assert op["state"] == "completed" and op["engines"] == [external.url], op
        assert [s["state"] for s in op["history"]] == ["pending", "draining", "removing", "completed"]
        assert {e["url"] for e in h.engines()} == {h.initial.url, native}
        assert external.engine.is_alive()
        assert external.url not in h.manager.members
    finally:
        external.stop()
    r = h.http.post("/v1/engines/scale_in", json={"engine_urls": [native]})
    assert h.wait_op(r.json()["request_id"])["state"] == "completed"
    assert [e["url"] for e in h.engines()] == [h.initial.url]
    assert any(s.url == native for s in h.provider.stopped)  # the engine Relax started is stopped


def test_cancel_and_timeout_roll_back(harness):
    h = harness
    h.pushing.clear()  # no weight push comes: the scale-out waits in weight_syncing
    try:
        r = h.http.post("/v1/engines/scale_out", json={"mode": "ray_native", "num_engines": 2})
        op_id = r.json()["request_id"]
        deadline = time.monotonic() + 60
        while h.http.get(f"/v1/operations/{op_id}").json()["state"] != "weight_syncing":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        c = h.http.post(f"/v1/operations/{op_id}/cancel")
        assert c.status_code == 200 and c.json()["state"] == "cancelled", c.text
        assert h.http.post(f"/v1/operations/{op_id}/cancel").status_code == 409  # already ended
        assert [e["url"] for e in h.engines()] == [h.initial.url]
        assert h.provider.started[-1] in h.provider.stopped  # rolled back: the new engine is gone

        r = h.http.post(
            "/v1/engines/scale_out", json={"mode": "ray_native", "num_engines": 2, "timeout_s": 3}
        )
        op = h.wait_op(r.json()["request_id"])
        assert op["state"] == "failed" and "timed out after 3s while weight_syncing" in op["error"], op
        assert h.provider.started[-1] in h.provider.stopped
        assert h.manager.plan() is None  # nothing is left for the next push to add
    finally:
        h.pushing.set()
    assert [e["url"] for e in h.engines()] == [h.initial.url]

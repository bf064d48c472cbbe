"""The elastic rollout API during a real training run (Ray, Serve roles, embedded engines, gloo weight
sync), over real HTTP: scale out in `ray_native` mode and in `external` mode (a `relax engine serve`
process started here), 409 on a concurrent request, cancel, bad requests, scale in, `relax status`; the
run keeps training throughout and is stopped (like Ctrl-C) once the checks are done.

One training run carries every check; the checks run on a thread while the Controller runs here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback

import httpx
import pytest

from relax.config import load_config
from relax.orchestration.controller import Controller
from relax.utils.auth import auth_headers, engine_key, read_run_token
from relax.utils.net import free_port

pytestmark = pytest.mark.slow


def wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def last_step(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


class Checks:
    """The API checks, run on a thread against the live run."""

    def __init__(self, controller: Controller, run_dir, model_dir) -> None:
        self.controller, self.run_dir, self.model_dir = controller, run_dir, model_dir
        self.error: BaseException | None = None
        self.steps: dict[str, int] = {}  # check -> training step seen when it ended
        self.status_text = ""
        self.times: dict[str, float] = {}  # check -> seconds since the checks began (printed on failure)
        self._t0 = time.monotonic()

    def mark(self, name: str) -> None:
        self.steps[name] = last_step(self.run_dir)
        self.times[name] = round(time.monotonic() - self._t0, 1)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - re-raised by the test on the main thread
            self.error = e
            traceback.print_exc()
        finally:
            self.controller.stop.request()  # the run ends as on Ctrl-C

    def op(self, http, op_id: str, timeout: float = 180) -> dict:
        return wait(lambda: (o := http.get(f"/v1/operations/{op_id}").json())["done"] and o, timeout, op_id)

    def _run(self) -> None:
        port = free_port()
        ext_url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "relax.entrypoints.cli",
            "engine",
            "serve",
            "--model",
            str(self.model_dir),
        ]
        cmd += ["--port", str(port), "--threads", "1", "--max-running", "16"]
        token_file = self.run_dir / "secrets" / "run_token"
        token = wait(lambda: token_file.exists() and token_file.read_text().strip(), 180, "the run's token")
        # an external engine serves a run with its own key, derived from the run's token (an engine that
        # asks for another one answers the run's requests 401, and its scale-out fails); the run's token
        # itself is never sent to an engine (relax/utils/auth.py)
        env = {**os.environ, "RELAX_API_KEY": engine_key(token, ext_url)}
        external = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            self._checks(ext_url)
            assert external.poll() is None, "scale-in must not stop an engine Relax did not start"
        finally:
            external.terminate()
            external.wait(30)

    def _checks(self, ext_url: str) -> None:
        endpoints = self.run_dir / "endpoints.json"
        api = wait(
            lambda: endpoints.exists() and json.loads(endpoints.read_text()).get("elastic_api"), 180, "API"
        )
        assert httpx.get(f"{api}/v1/engines", timeout=60).status_code == 401  # the API asks for the token
        assert httpx.get(f"{api}/health", timeout=60).status_code == 200
        http = httpx.Client(base_url=api, timeout=60, headers=auth_headers(read_run_token(self.run_dir)))
        wait(lambda: last_step(self.run_dir) >= 1, 180, "the first training step")
        self.mark("start")
        (initial,) = [e["url"] for e in http.get("/v1/engines").json()["engines"]]

        # bad requests: 4xx with a message, nothing started
        r = http.post("/v1/engines/scale_out", json={"mode": "ray_native", "num_engines": -2})
        assert r.status_code == 400 and "num_engines" in r.json()["error"]["message"], r.text
        r = http.post(
            "/v1/engines/scale_in", content=b'{"num_engines": ', headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
        r = http.post("/v1/engines/scale_in", json={"engine_urls": ["http://127.0.0.1:1"]})
        assert r.status_code == 400 and "unknown engine" in r.json()["error"]["message"], r.text
        assert http.get("/v1/operations").json()["operations"] == []

        # ray_native scale-out; a second request meanwhile is refused
        r = http.post(
            "/v1/engines/scale_out", json={"mode": "ray_native", "num_engines": 2, "request_id": "o1"}
        )
        assert r.status_code == 202, r.text
        busy = http.post("/v1/engines/scale_out", json={"mode": "external", "engine_urls": [ext_url]})
        assert busy.status_code == 409, busy.text
        op = self.op(http, "o1")
        assert op["state"] == "active", op
        native = op["engines"][0]
        self.mark("native")

        # external scale-out: the engine process started above
        wait(lambda: _answers(ext_url), 120, "the external engine")
        r = http.post("/v1/engines/scale_out", json={"mode": "external", "engine_urls": [ext_url]})
        assert r.status_code == 202, r.text
        op = self.op(http, r.json()["request_id"])
        assert op["state"] == "active", op
        self.mark("external")
        rows = http.get("/v1/engines").json()["engines"]
        assert [e["url"] for e in rows] == [initial, native, ext_url]
        versions = [int(e["weight_version"]) for e in rows]
        assert all(e["healthy"] and e["in_weight_sync_group"] for e in rows), rows
        assert max(versions) - min(versions) <= 1, rows  # one group: all hold the trainer's weights
        wait(
            lambda: all(e["served"] > 0 for e in http.get("/v1/engines").json()["engines"]),
            120,
            "requests on the new engines",
        )

        # cancel a scale-out while it starts its engines
        r = http.post("/v1/engines/scale_out", json={"mode": "ray_native", "num_engines": 4})
        c = http.post(f"/v1/operations/{r.json()['request_id']}/cancel")
        assert c.status_code == 200 and c.json()["state"] == "cancelled", c.text
        assert len(http.get("/v1/engines").json()["engines"]) == 3
        self.mark("cancelled")

        # `relax status` while training runs
        done = subprocess.run(
            [sys.executable, "-m", "relax.entrypoints.cli", "status", str(self.run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        self.status_text = done.stdout
        self.mark("status")

        # scale in to 1: last in, first out
        r = http.post("/v1/engines/scale_in", json={"num_engines": 1})
        assert r.status_code == 202, r.text
        op = self.op(http, r.json()["request_id"])
        assert op["state"] == "completed" and op["engines"] == [ext_url, native], op
        assert [e["url"] for e in http.get("/v1/engines").json()["engines"]] == [initial]
        self.mark("scaled_in")
        step = self.steps["scaled_in"]
        wait(lambda: last_step(self.run_dir) >= step + 2, 120, "training after the scale-in")
        listing = http.get("/v1/engines").json()  # the version of the latest push, not the last scale-out's
        assert int(listing["weight_version"]) >= step + 1, (step, listing)
        self.mark("end")


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_elastic_scaling_during_training(ray_cluster, tiny_model_dir, arith_file, tmp_path):
    cfg = load_config(
        "tests/toy_arith.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            "run.name=elastic",
            "schedule.mode=hybrid",
            "schedule.max_staleness=1",
            "schedule.data_plane=ray",
            "trainer.num_steps=10000",
            "ops.checkpoint_interval=0",
            "ops.progress=false",
            "ops.tensorboard=false",
            "eval.sets=[]",
            "eval.before_train=false",
            "rollout.prompts_per_step=8",
            "rollout.n_samples_per_prompt=4",
            "rollout.engine_threads=1",
            "trainer.threads=1",
            "rollout.elastic.drain_timeout_s=30",
            "rollout.elastic.operation_timeout_s=240",
        ],
    )
    controller = Controller(cfg)
    checks = Checks(controller, cfg.run.run_dir, tiny_model_dir)
    thread = threading.Thread(target=checks.run, daemon=True)
    thread.start()
    final = controller.run()
    thread.join(60)
    if checks.error is not None:
        raise checks.error
    s = checks.steps
    print("elastic checks (step, seconds):", {k: (s[k], checks.times[k]) for k in s})
    # training went on through every operation
    assert s["start"] <= s["native"] <= s["external"] <= s["scaled_in"] < s["end"] <= final, s
    assert s["end"] - s["start"] >= 4, s
    rows = [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, final + 1))
    assert "step " in checks.status_text and "3 (3 healthy)" in checks.status_text, checks.status_text
    assert "ray_native" in checks.status_text and "external" in checks.status_text

"""Session-wide fixtures: one tiny model folder, one toy data file, one local Ray cluster, one engine server
the in-process runs attach to; and the `full`
tier: tests marked `full` (the rest of the fault matrix, the second cluster shape) are skipped unless
pytest runs with `--full` (`bash scripts/test.sh --full`, docs/testing.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# the engine tests' shared server and its companions (tests/backends/, tests/engine_api/ and others)
pytest_plugins = ["tests.engine_fixtures"]

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")  # deploys start sooner (service.py)
# One torch intra-op thread in the test processes and what they start without a thread count of their
# own (the roles and engines set theirs from the config): two queues share two cores (scripts/test.sh),
# and a second OpenMP thread spins for a core the other queue holds. The GenRM judge's fine-tune beside
# one busy process took 32 s and 40 CPU-seconds with two threads, 10.5 s and 10.4 with one
# (docs/testing.md). Set before torch is first imported, which reads it then.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    from tests.cpu_log import register

    register(config)  # RELAX_TEST_CPU_LOG: CPU-seconds per test (tests/cpu_log.py)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", help="also run the tests marked `full` (beyond CI's time budget)"
    )


# scripts/test.sh runs the suite as pytest processes side by side (docs/testing.md), each picking its
# tests by RELAX_TEST_QUEUE: "e2e" the end-to-end tests (marked slow) one after another, "unit" the
# component tests, and "cli", after the unit queue, the `relax train` children.
# (End-to-end files at the end of the unit queue, beside the e2e queue's learning runs, gained nothing:
# two learning runs at once each took about twice as long; docs/testing.md.) The e2e queue starts with
# the files whose in-process runs mostly wait (kills and replacements, eval), which overlap the component
# tests (they want the cores too); the runs that start a Ray cluster of their own come last and wait
# until the unit queue is done (RELAX_TEST_UNIT_DONE, a file scripts/test.sh writes when it ends): the
# simulated hosts and the wheel in the e2e queue, and beside them, in the "cli" queue, the `relax train`
# children of SIGTERM and Ctrl-C, which the unit queue's process starts once the e2e queue has reached its
# own-Ray part (RELAX_TEST_E2E_OWN_RAY, written below). Those runs leave part of the two cores idle alone
# (the cores 55-70% busy), and two of them side by side fill them; a Ray start beside a learning run
# or the component tests may miss Ray's fixed 15 s for its dashboard agent, which Relax's own start
# (relax/orchestration/local_ray.py) and the simulated hosts' (tests/cluster/netns.py) retry.
WAITING_FIRST = ("tests/ops/test_faults_e2e.py", "tests/e2e/test_eval_e2e.py")
OWN_RAY_LAST = (
    "tests/cluster/test_multi_host.py",
    "tests/cluster/test_cluster_shapes.py",
    "tests/e2e/test_interrupt.py",
    "tests/e2e/test_security_e2e.py",
    "tests/entrypoints/test_wheel_install.py",
    "tests/orchestration/test_ray_token.py",
)
# the files of the "cli" queue: their tests that start `relax train` as a child (those on the session's
# cluster, `ray_cluster`, stay in the e2e queue's in-process part), and the cluster Ray-token check, which
# starts one in a child process of its own. The wheel's run stays in the e2e
# queue, after the simulated hosts: there the two queues end about together (clean clones, 2026-12-06:
# the cli queue with it ran ~80 s past the e2e queue's end).
CLI_FILES = (
    "tests/e2e/test_interrupt.py",
    "tests/e2e/test_security_e2e.py",
    "tests/orchestration/test_ray_token.py",
)
UNIT_DONE_WAIT_S = 1800  # the unit queue takes ~10 minutes; a crashed one is waited for no longer


def _own_ray(item: pytest.Item) -> bool:
    return _file(item) in OWN_RAY_LAST and "ray_cluster" not in getattr(item, "fixturenames", ())


def _e2e_rank(item: pytest.Item) -> int:
    return 0 if _file(item) in WAITING_FIRST else 2 if _own_ray(item) else 1


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _queue_of(item: pytest.Item) -> str:
    if item.get_closest_marker("slow") is None:
        return "unit"
    return "cli" if _file(item) in CLI_FILES and _own_ray(item) else "e2e"


def _queue(config: pytest.Config, items: list[pytest.Item], queue: str) -> None:
    """Keep the tests of `queue` ("e2e", "unit" or "cli"), in the order described above; deselect the
    rest."""
    keep = [item for item in items if _queue_of(item) == queue]
    dropped = [item for item in items if _queue_of(item) != queue]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    if queue == "e2e":  # a stable sort: each file's tests stay together
        keep.sort(key=_e2e_rank)
    items[:] = keep


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The "cli" queue imports only its own test files and the "e2e" queue only the files that mark a
    test slow (collecting the ~110 component files costs its process ~9 CPU-seconds at its start, beside
    the unit queue's own collection); the unit queue collects everything."""
    name = collection_path.name
    queue = os.environ.get("RELAX_TEST_QUEUE")
    if queue not in ("cli", "e2e") or not (name.startswith("test_") and name.endswith(".py")):
        return None
    if queue == "e2e":  # a text test, not an import: a file without `mark.slow` has no e2e test
        return True if "mark.slow" not in collection_path.read_text() else None
    rel = collection_path.resolve().relative_to(Path(__file__).resolve().parents[1]).as_posix()
    return True if rel not in CLI_FILES else None


_unit_queue_waited = False
_own_ray_reached = False


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the e2e queue's first own-Ray run, wait for the unit queue to end (see above)."""
    global _unit_queue_waited
    done = os.environ.get("RELAX_TEST_UNIT_DONE")
    if _unit_queue_waited or not done or not _own_ray(item) or os.environ.get("RELAX_TEST_QUEUE") != "e2e":
        return
    _unit_queue_waited = True
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    start = time.monotonic()
    while not Path(done).exists() and time.monotonic() - start < UNIT_DONE_WAIT_S:
        time.sleep(1.0)
    capture = item.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:  # the test's setup is captured: write around it
        waited = time.monotonic() - start
        ended = "ended" if Path(done).exists() else f"not ended after {UNIT_DONE_WAIT_S} s; going on"
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"waited {waited:.0f} s for the unit queue ({ended})")


def pytest_runtest_call(item: pytest.Item) -> None:
    """Once the e2e queue's first own-Ray test has set up (the simulated hosts' Ray nodes are up), the
    "cli" queue may start: two Ray clusters starting at once on two cores miss Ray's start-up window."""
    global _own_ray_reached
    marker = os.environ.get("RELAX_TEST_E2E_OWN_RAY")
    if _own_ray_reached or not marker or not _own_ray(item) or os.environ.get("RELAX_TEST_QUEUE") != "e2e":
        return
    _own_ray_reached = True
    Path(marker).touch()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    queue = os.environ.get("RELAX_TEST_QUEUE")
    if queue in ("e2e", "unit", "cli"):
        _queue(config, items, queue)
    if config.getoption("--full"):
        return
    # skipped, not deselected: the summary lists what only the full run covers
    skip = pytest.mark.skip(reason="full tier: bash scripts/test.sh --full (docs/testing.md)")
    for item in items:
        if item.get_closest_marker("full"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from relax.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", family="qwen2")


@pytest.fixture(scope="session")
def arith_file(tmp_path_factory):
    from relax.data.toy import generate_arith

    return generate_arith(tmp_path_factory.mktemp("data") / "arith.jsonl", n=500)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster on 127.0.0.1 for the whole session (started once; roles share it), with Ray's
    token authentication as every cluster Relax starts (relax/orchestration/ray_token.py); processes the
    tests start inherit its token's path. Ray Serve runs in it for the session: a run leaves a Serve it
    did not start running (`service.shutdown`), so the in-process runs share one controller."""
    import ray
    from ray import serve

    from relax.orchestration.service import start_ray

    start_ray(None, num_cpus=8, object_store_mb=1024)
    serve.start(proxy_location="Disabled")  # not `service.start_serve`: this Serve is the session's
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def bare_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model's checkpoint without tokenizer files: the engine must serve token ids without one."""
    out = tmp_path_factory.mktemp("tiny_qwen2_bare")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def shared_engine(tiny_model_dir, tmp_path_factory):
    """One `relax engine serve` process over the session's tiny model, which the in-process runs whose
    subject is not the engine's launch attach to as an external engine (`rollout.engine=external`,
    `SharedEngine.overrides()`), as a user attaches runs to a long-lived server. A run that launches its
    own embedded engine pays its process start (imports and model load: ~3.5 s of a toy run's ~17 s on
    two cores, on the critical path of its start); the runs that test the embedded engine itself (kills
    and replacements, elastic scale-out, engine options, the default quickstart) still launch theirs.
    Each run pushes its weights before its first step (version 0), so a run never samples from the
    weights a previous run trained."""
    engine = SharedEngine(tiny_model_dir, tmp_path_factory.mktemp("shared_engine") / "engine.log")
    yield engine
    engine.stop()


class SharedEngine:
    def __init__(self, model_dir: Path, log: Path) -> None:
        self.model_dir, self.log = model_dir, log
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def overrides(self) -> list[str]:
        """The config overrides that attach a run to this engine (started again if it died)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        return ["rollout.engine=external", f"rollout.engine_urls=[{self.url}]"]

    def _start(self, timeout_s: float = 120.0) -> None:
        import httpx

        from tests.engine_helpers import free_port

        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "relax.entrypoints.cli",
            "engine",
            "serve",
            "--model",
            str(self.model_dir),
        ]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--device", "cpu"]
        cmd += ["--threads", "1", "--max-running", "256", "--seed", "0"]
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (
                "the shared engine did not come up:\n" + self.log.read_text()[-3000:]
            )
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

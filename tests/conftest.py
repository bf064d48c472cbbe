"""Session-wide fixtures: one tiny model folder, one toy data file, one local Ray cluster; and the `full`
tier: tests marked `full` (the rest of the fault matrix, the second cluster shape) are skipped unless
pytest runs with `--full` (`bash scripts/test.sh --full`, docs/testing.md)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# the engine tests' shared server and its companions (tests/backends/, tests/engine_api/ and others)
pytest_plugins = ["tests.engine_fixtures"]

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")  # deploys start sooner (service.py)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", help="also run the tests marked `full` (beyond CI's time budget)"
    )


# scripts/test.sh runs the suite as two pytest processes side by side (docs/testing.md), each picking its
# tests by RELAX_TEST_QUEUE: "e2e" the end-to-end tests (marked slow) one after another, "unit" the rest.
# The e2e queue starts with the files whose in-process runs mostly wait (kills and replacements, eval),
# which overlap the component tests (they want the cores too); the runs that start a Ray cluster of their
# own (a `relax train` child, the simulated hosts) come last, when the other queue is done: Ray gives a
# new node 30 s to register with its GCS, and beside a learning run and the component tests one did not.
WAITING_FIRST = ("tests/ops/test_faults_e2e.py", "tests/e2e/test_eval_e2e.py")
OWN_RAY_LAST = (
    "tests/cluster/test_multi_host.py",
    "tests/cluster/test_cluster_shapes.py",
    "tests/e2e/test_interrupt.py",
    "tests/e2e/test_security_e2e.py",
    "tests/entrypoints/test_wheel_install.py",
)


def _e2e_rank(item: pytest.Item) -> int:
    name = _file(item)
    return 0 if name in WAITING_FIRST else 2 if name in OWN_RAY_LAST else 1


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _queue(config: pytest.Config, items: list[pytest.Item], queue: str) -> None:
    """Keep the tests of `queue` ("e2e" or "unit"), in the order described above; deselect the rest."""
    e2e = [item.get_closest_marker("slow") is not None for item in items]
    keep = [item for item, mine in zip(items, e2e, strict=True) if mine == (queue == "e2e")]
    dropped = [item for item, mine in zip(items, e2e, strict=True) if mine != (queue == "e2e")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    if queue == "e2e":  # a stable sort: each file's tests stay together
        keep.sort(key=_e2e_rank)
    items[:] = keep


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    queue = os.environ.get("RELAX_TEST_QUEUE")
    if queue in ("e2e", "unit"):
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

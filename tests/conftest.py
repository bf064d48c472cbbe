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


# scripts/test.sh runs the end-to-end tests in a pytest process of their own (RELAX_TEST_QUEUE=e2e) beside
# the component tests: the files whose runs mostly wait (signals and grace periods, an install, eval,
# kills and replacements; 55-70% of two cores alone) go first, while the component tests also want
# the cores; the learning runs, CPU-bound from start-up to their last step, come after (docs/testing.md).
WAITING_FIRST = (
    "tests/e2e/test_interrupt.py",
    "tests/entrypoints/test_wheel_install.py",
    "tests/e2e/test_eval_e2e.py",
    "tests/ops/test_faults_e2e.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("RELAX_TEST_QUEUE") == "e2e":  # a stable sort: each file's tests stay together
        items.sort(key=lambda item: item.nodeid.split("::")[0] not in WAITING_FIRST)
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

"""A local Ray start whose node times out (Ray's dashboard agent later than the raylet's fixed 15 s, as on
a busy machine) is started again, and the failed attempt leaves nothing running
(relax/orchestration/local_ray.py).

The fault is real: a `sitecustomize` on the child's PYTHONPATH (tests/orchestration/slow_agent) makes the
first dashboard agent sleep 20 s, so Ray's own raylet aborts and `ray.init` raises; the second agent is
untouched. The test mostly waits (Ray's 15 s and then 30 s), so it runs in the component tests' queue."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

START = textwrap.dedent(
    """
    import logging, sys
    import psutil, ray
    from relax.orchestration.service import start_ray

    logging.basicConfig(level=logging.WARNING)
    start_ray(None, num_cpus=1, object_store_mb=80, secrets_dir=sys.argv[1])
    print("ANSWER", ray.get(ray.remote(lambda: 41 + 1).remote()), flush=True)
    names = [p.name() for p in psutil.Process().children(recursive=True)]
    print("GCS", names.count("gcs_server"), "RAYLETS", names.count("raylet"), flush=True)
    ray.shutdown()
    """
)


def test_a_node_that_times_out_at_start_is_started_again_and_leaves_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "agent-delayed"
    hook = Path(__file__).parent / "slow_agent"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hook), str(Path.cwd()), os.environ.get("PYTHONPATH", "")]),
        "RELAX_TEST_SLOW_AGENT": str(marker),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", START, str(tmp_path / "secrets")],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert marker.exists(), out[-4000:]  # the first agent was the slow one
    assert "timed out during startup (attempt 1 of 3" in out, out[-4000:]
    assert "ANSWER 42" in out, out[-4000:]
    # the failed attempt's GCS and raylet were stopped: one cluster's processes are left, the second's
    assert "GCS 1 RAYLETS 1" in out, out[-4000:]

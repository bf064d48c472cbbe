"""What a run prints and where its processes log: a role's INFO lines go to the run's log folder while its
warnings still reach the console; `resources.dashboard` starts Ray's dashboard on loopback only."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from relax.config import load_config
from relax.entrypoints.cli import main


@pytest.fixture
def role_logger(ray_cluster):
    import ray

    @ray.remote(num_cpus=0)
    class Role:
        def run(self) -> list[tuple[str, int, bool]]:
            from relax.utils.logging import setup_logging

            setup_logging()
            log = logging.getLogger("relax.test_role")
            log.info("an info line of the role")
            log.warning("a warning of the role")
            import warnings

            warnings.warn("a library's deprecation", FutureWarning, stacklevel=1)
            return [
                (type(h).__name__, h.level, getattr(h, "stream", None) is sys.__stderr__)
                for h in logging.getLogger().handlers
                if getattr(h, "_relax_role", False)
            ]

    return Role


def test_a_role_logs_info_to_the_run_folder_and_warnings_to_the_console(role_logger, tmp_path):
    import ray

    role = role_logger.options(runtime_env={"env_vars": {"RELAX_LOG_DIR": str(tmp_path)}}).remote()
    handlers = ray.get(role.run.remote(), timeout=120)
    ray.kill(role)
    assert sorted(handlers) == [
        ("FileHandler", logging.INFO, False),
        ("StreamHandler", logging.WARNING, True),
    ]
    (log,) = tmp_path.glob("*.log")
    text = log.read_text()
    assert "an info line of the role" in text and "a warning of the role" in text
    assert "a library's deprecation" in text  # Python warnings: the file, not the console


def test_the_driver_keeps_the_console_at_info(monkeypatch, tmp_path):
    from relax.utils.logging import _in_ray_actor

    monkeypatch.setenv("RELAX_LOG_DIR", str(tmp_path))
    assert not _in_ray_actor()  # the test process is a driver: `setup_logging` leaves it as it was


def test_dashboard_is_off_by_default_and_described(capsys):
    assert load_config("examples/quickstart.yaml", []).resources.dashboard is False
    assert main(["config", "--describe"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("resources.dashboard =")]
    assert "False" in line and "127.0.0.1" in line


START = textwrap.dedent(
    """
    import json, logging, re, sys
    import psutil, ray
    from relax.orchestration.service import start_ray

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("relax").addHandler(handler)
    logging.getLogger("relax").setLevel(logging.INFO)
    start_ray(None, num_cpus=1, object_store_mb=80, secrets_dir=sys.argv[1], dashboard=True)
    found = [m for line in said if (m := re.search(r"Ray dashboard at http://([0-9.]+):(\\d+)", line))]
    port = int(found[0].group(2)) if found else None
    listening = [
        c.laddr.ip for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    print("DASHBOARD", json.dumps({"host": found[0].group(1) if found else None, "listening": listening}))
    ray.shutdown()
    """
)


def test_dashboard_key_starts_it_on_loopback_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(HOME=str(tmp_path), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    done = subprocess.run(
        [sys.executable, "-c", START, str(tmp_path / "secrets")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("DASHBOARD ")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    seen = json.loads(lines[-1].split(" ", 1)[1])
    assert seen["host"] == "127.0.0.1", seen
    assert seen["listening"] and set(seen["listening"]) == {"127.0.0.1"}, seen  # never 0.0.0.0 or a NIC

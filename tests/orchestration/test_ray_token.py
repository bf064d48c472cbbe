"""The Ray cluster Relax starts itself asks for Ray's token: a local process without it cannot join.

The cluster is started the way `relax train` starts it (`service.start_ray` with the run's secrets
folder), in a process of its own whose environment has no Ray auth settings, as a user's shell would;
strangers then try `ray.init(address=...)` from other processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

START = textwrap.dedent(
    """
    import sys
    import ray
    from relax.orchestration.service import start_ray

    start_ray(None, num_cpus=1, object_store_mb=80, secrets_dir=sys.argv[1])
    print("GCS", ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the test closes it
    ray.shutdown()
    """
)

JOIN = textwrap.dedent(
    """
    import sys
    import ray

    try:
        ray.init(address=sys.argv[1], log_to_driver=False)
        print("JOINED", ray.get(ray.remote(lambda: 41 + 1).remote()), flush=True)
    except Exception as e:
        print("REFUSED", type(e).__name__, e, flush=True)
    """
)


def _env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no Ray auth settings or address inherited from the test session, a HOME of
    its own (no ~/.ray/auth_token)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **extra)
    return env


def _joins(address: str, home: Path, *extras: dict[str, str]) -> list[str]:
    """One process per environment in `extras`, all at once (each mostly waits on Ray's client), each
    trying to join the cluster at `address`; their JOINED/REFUSED lines, in order."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", JOIN, address],
            env=_env(home, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for extra in extras
    ]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
        lines = [ln for ln in out.splitlines() if ln.startswith(("JOINED", "REFUSED"))]
        assert lines, out[-2000:] + err[-3000:]
        results.append(lines[-1])
    return results


@pytest.fixture
def token_env(monkeypatch):
    """`enable_ray_token` as before a cluster starts: no Ray auth settings, Ray not running here (this
    process's Ray, if a test started one, is left alone)."""
    from relax.orchestration import ray_token

    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.setenv(k, "")  # recorded, so what the test sets is undone after it
        monkeypatch.delenv(k)
    monkeypatch.setattr(ray_token, "_ray_running", lambda: False)
    monkeypatch.setattr(ray_token, "_refresh_ray", lambda: None)
    monkeypatch.setattr(ray_token, "_ours", None)
    return ray_token


def test_a_run_gets_its_own_token_and_keeps_it_on_resume(token_env, tmp_path):
    first = token_env.enable_ray_token(tmp_path / "a" / "secrets")
    assert first == tmp_path / "a" / "secrets" / "ray_token" and first.stat().st_mode & 0o077 == 0
    assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN_PATH"] == str(first)
    token = first.read_text()
    first.chmod(0o644)
    assert token_env.enable_ray_token(tmp_path / "a" / "secrets") == first  # --resume
    assert first.read_text() == token and first.stat().st_mode & 0o077 == 0
    other = token_env.enable_ray_token(tmp_path / "b" / "secrets")  # the next run in this process
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(other) and other.read_text() != token


def test_the_users_environment_wins(token_env, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert token_env.enable_ray_token(tmp_path / "s") is None
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ and not (tmp_path / "s").exists()

    monkeypatch.delenv("RAY_AUTH_MODE")
    mine = tmp_path / "my_token"
    mine.write_text("f" * 64)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(mine))
    assert token_env.enable_ray_token(tmp_path / "s") is None
    assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN_PATH"] == str(mine)
    assert not (tmp_path / "s").exists()

    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="cannot be read"):  # Ray would abort the process instead
        token_env.enable_ray_token(tmp_path / "s")


@pytest.mark.slow
def test_a_process_without_the_token_cannot_join_the_cluster_relax_started(tmp_path):
    secrets = tmp_path / "run" / "secrets"
    owner, stranger = tmp_path / "owner", tmp_path / "stranger"
    owner.mkdir()
    stranger.mkdir()
    log = tmp_path / "start.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-c", START, str(secrets)],
            env=_env(owner),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=fh,
            text=True,
        )
    try:
        line = proc.stdout.readline()
        assert line.startswith("GCS "), line + log.read_text()[-3000:]
        address = line.split()[1]

        token_file = secrets / "ray_token"
        token = token_file.read_text().strip()
        assert len(token) == 64 and token_file.stat().st_mode & 0o077 == 0, oct(token_file.stat().st_mode)

        # Ray's defaults (no token sent), token mode with no token to send, a wrong token: the GCS refuses
        # them (Ray's client says ConnectionError or AuthenticationError); the join with the token, at the
        # same time, shows the cluster was up meanwhile
        # A refused client retries its GCS connection 20 times a second apart (Ray's
        # RAY_NUM_REDIS_GET_RETRIES) before it says so; two retries refuse it as surely, 18 s sooner.
        quick = {"RAY_NUM_REDIS_GET_RETRIES": "2"}
        strangers = [
            quick,
            {"RAY_AUTH_MODE": "token", **quick},
            {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64, **quick},
        ]
        owner_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
        *refused, joined = _joins(address, stranger, *strangers, owner_env)
        for extra, answer in zip(strangers, refused, strict=True):
            assert answer.startswith("REFUSED"), (extra, answer)
        assert joined == "JOINED 42"
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert token not in log.read_text()

"""A real `relax train` run, read as an attacker would: which sockets listen while it runs, and where the
secrets planted in its config end up. The run is ended by Ctrl-C (SIGINT to its process group, as a
terminal sends it), which must finish the step, leave a complete checkpoint and shut Ray and the engines
down (one run for both: a run's start-up costs more than its checks).

* No listener of the run or of the Ray cluster it starts is on all interfaces or on any address but
  loopback (single host): every process carrying the run's marker is read from /proc while it trains.
* The remote reward's credentials, the notification URL's password and the run's token appear in no
  file of the run folder (W&B's offline folder included) and nowhere in the captured log; the token's
  own file is readable by its owner only.
* Ctrl-C: exit code 0, the last checkpoint's step is the last step in metrics.jsonl, steps 1..N all
  there, and no process of the run left behind (resuming from it is as from any other checkpoint:
  tests/e2e/test_train_e2e.py, tests/cluster/test_multi_host.py).
* The Ray cluster the run starts asks for Ray's token (RAY_AUTH_MODE=token in its GCS and raylet), a
  token of the run's own in `secrets/ray_token` (owner only), which is in no other file and not in the
  log. The run starts from an environment without Ray auth settings, as a user's shell would.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from relax.orchestration import checkpoint as ckpt
from tests.faults.places import marked_pids

pytestmark = pytest.mark.slow

MARK = f"relax-security-{uuid.uuid4().hex}"
PLANTED = {
    "auth header": "PLANTED-AUTH-4f9a0c1d",
    "url token": "PLANTED-KEY-77c1e2b3",
    "notify password": "PLANTED-PW-3b2e9a7f",
    "run token": "PLANTED-RUN-TOKEN-9d0e6c5b",
}


def _marked_listeners(ray_auth: dict[str, str]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of the run's processes; `ray_auth`
    gets the RAY_AUTH_* settings of its Ray processes (GCS, raylet)."""
    found = set()
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
            if MARK.encode() not in environ:
                continue
            if proc.info["name"] in ("gcs_server", "raylet"):
                for item in environ.split(b"\0"):
                    k, _, v = item.decode(errors="replace").partition("=")
                    if k.startswith("RAY_AUTH"):
                        ray_auth[f"{proc.info['name']} {k}"] = v
            for conn in proc.net_connections("inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((proc.info["name"], conn.laddr.ip, conn.laddr.port))
        except (OSError, psutil.Error):  # ended meanwhile, or not ours to read
            continue
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_a_run_listens_on_loopback_only_keeps_its_secrets_and_stops_on_ctrl_c(
    tiny_model_dir, arith_file, tmp_path
):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "reward:\n"
        "  name: first_number\n"
        "  type_kwargs:\n"
        "    remote:\n"
        f"      url: http://127.0.0.1:9/score?token={PLANTED['url token']}\n"
        "      headers:\n"
        f"        Authorization: Bearer {PLANTED['auth header']}\n"
        "ops:\n"
        f"  notify_urls: ['json://relax:{PLANTED['notify password']}@127.0.0.1:9/notify']\n"
        "  wandb: {mode: offline}\n"
    )
    args = [
        str(cfg),
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{arith_file}]",
        f"run.output_dir={tmp_path}",
        "run.name=sec",
        "trainer.num_steps=1000",  # ended by Ctrl-C
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "ops.progress=false",
        "ops.checkpoint_interval=0",  # the checkpoint is Ctrl-C's
    ]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")},  # a user's shell
        "RELAX_TEST_MARK": MARK,
        "RELAX_RUN_TOKEN": PLANTED["run token"],
        "RELAX_LOG_LEVEL": "DEBUG",
        "WANDB_MODE": "offline",
    }
    log_file = tmp_path / "log.txt"
    run_dir = tmp_path / "sec"
    metrics = run_dir / "metrics.jsonl"
    listeners: set[tuple[str, str, int]] = set()
    ray_auth: dict[str, str] = {}
    with open(log_file, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relax.entrypoints.cli", "train", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 600
        try:
            stepped = 0.0  # when the first step was seen: listeners are read a little longer
            while proc.poll() is None and time.monotonic() < deadline:
                listeners |= _marked_listeners(ray_auth)
                if not stepped and metrics.exists() and metrics.read_text().strip():
                    stepped = time.monotonic()
                if stepped and time.monotonic() > stepped + 2:
                    break
                time.sleep(0.5)
            assert proc.poll() is None, log_file.read_text(errors="replace")[-4000:]
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=300)  # generous: a hang fails the test instead of blocking it
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    log_text = log_file.read_text(errors="replace")
    assert proc.returncode == 0, log_text[-4000:]

    assert listeners, "no listener of the run was seen: the marker did not reach its processes"
    open_ = sorted(x for x in listeners if not _loopback(x[1]))
    assert not open_, f"listeners not on loopback: {open_}"

    found = ckpt.latest_checkpoint(run_dir)
    assert found is not None, log_text[-4000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, found[0] + 1))
    deadline = time.monotonic() + 30
    while marked_pids(MARK) and time.monotonic() < deadline:
        time.sleep(1)
    assert not marked_pids(MARK), "processes of the run (Ray, engines) left behind after Ctrl-C"

    token_file = run_dir / "secrets" / "run_token"
    assert token_file.read_text().strip() == PLANTED["run token"]
    assert token_file.stat().st_mode & 0o077 == 0, oct(token_file.stat().st_mode)
    ray_token_file = run_dir / "secrets" / "ray_token"
    assert ray_token_file.stat().st_mode & 0o077 == 0, oct(ray_token_file.stat().st_mode)
    assert ray_auth == {
        "gcs_server RAY_AUTH_MODE": "token",
        "gcs_server RAY_AUTH_TOKEN_PATH": str(ray_token_file),
        "raylet RAY_AUTH_MODE": "token",
        "raylet RAY_AUTH_TOKEN_PATH": str(ray_token_file),
    }, ray_auth
    planted = {**PLANTED, "ray token": ray_token_file.read_text().strip()}
    files = [p for p in run_dir.rglob("*") if p.is_file() and p not in (token_file, ray_token_file)]
    assert any(p.name == "config.yaml" for p in files) and any("wandb" in p.parts for p in files), files
    for path in [*files, log_file]:
        data = path.read_bytes()
        for what, secret in planted.items():
            assert secret.encode() not in data, f"the {what} is in {path}"
    dumped = json.dumps(__import__("yaml").safe_load((run_dir / "config.yaml").read_text()))
    assert "***" in dumped  # the credentials are there, masked

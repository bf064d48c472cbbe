"""Inference servers as child processes: start a command, wait until its `/health` answers, stop it.

The same launcher runs SGLang (`python -m sglang.launch_server ...`, see `sglang.py`) and Relax's own
`relax engine serve` (`embedded_engine_command`), which is how the launch path is tested on machines
where SGLang cannot run. The child's output goes to a log file; a start that fails reports its tail.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


def server_url(host: str, port: int) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def embedded_engine_command(model_path: str, port: int, host: str = "127.0.0.1", *extra: str) -> list[str]:
    """`relax engine serve` for `model_path` on host:port, run with this Python."""
    cmd = [sys.executable, "-m", "relax.entrypoints.engine_cmd", "serve", "--model", str(model_path)]
    return [*cmd, "--host", host, "--port", str(port), *extra]


class ServerProcess:
    """One server child process and the URL it serves."""

    def __init__(
        self, cmd: list[str], url: str, env: dict[str, str] | None = None, log_path: str | Path | None = None
    ) -> None:
        self.cmd, self.url = list(cmd), url.rstrip("/")
        self.env = {**os.environ, **(env or {})}
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="relax-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 600.0) -> ServerProcess:
        """Launch the command and return once `/health` answers 200; raise `RuntimeError` (with the log's
        tail) if the process exits first or `timeout_s` passes."""
        logger.info("launching %s (log: %s)", " ".join(self.cmd), self.log_path)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_healthy(self.url, timeout_s, self)
        except BaseException:
            self.kill()
            raise
        logger.info("server %s is up (pid %d)", self.url, self.proc.pid)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("server %s ignored SIGTERM for %.0f s; killing it", self.url, timeout_s)
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the server at once (no cleanup, like a crashed host)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_healthy(url: str, timeout_s: float, process: ServerProcess | None = None) -> None:
    """Poll `url`/health until it answers 200."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and not process.alive():
            raise RuntimeError(
                f"server for {url} exited with code {process.proc.returncode} before it was healthy; "
                f"its log ({process.log_path}) ends with:\n{process.log_tail()}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            tail = f"; its log ends with:\n{process.log_tail()}" if process is not None else ""
            raise RuntimeError(f"server at {url} was not healthy after {timeout_s:.0f} s{tail}")
        time.sleep(0.25)

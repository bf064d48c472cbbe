"""`relax train`'s signal handling (relax/entrypoints/signals.py) in this process: the first SIGTERM or
Ctrl-C requests a stop and says what it does, the second raises KeyboardInterrupt and arms the hard exit;
the process's own handlers come back afterwards (for the command line, once a stop ended the run, a further
signal exits at once with 130), and starting Ray keeps a handler the process installed.
The whole run's behaviour is covered by tests/e2e/test_interrupt.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from relax.entrypoints import signals
from relax.orchestration.service import RunStopped, _keeping_sigterm_handler
from relax.orchestration.stop import StopRequest


class Timer:
    """Stands in for the hard-exit timer: records it, never fires (it would end the test process)."""

    armed: list[tuple] = []

    def __init__(self, interval: float, fn, args=()) -> None:
        Timer.armed.append((interval, fn, args))
        self.daemon = False

    def start(self) -> None:
        pass


@pytest.fixture
def no_hard_exit(monkeypatch):
    Timer.armed = []
    monkeypatch.setattr(signals.threading, "Timer", Timer)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_first_signal_requests_a_stop_and_the_second_stops_at_once(sig, no_hard_exit, caplog):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    with signals.stop_on_signals(stop):
        os.kill(os.getpid(), sig)
        assert stop.requested and Timer.armed == []
        assert "stopping the start" in caplog.text
        with pytest.raises(RunStopped, match="stop requested before the roles started"):
            stop.check("the roles started")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
        assert [(t, args) for t, _, args in Timer.armed] == [(signals.HARD_EXIT_S, (130,))]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


class Exited(Exception):
    pass


def test_after_a_run_the_command_line_stopped_a_further_signal_exits_at_once(no_hard_exit, monkeypatch):
    """`relax train`'s block ends on the first SIGTERM and the process heads for its exit (Ray's shutdown
    can take seconds): the operator's second signal there exits with 130, not by the default handler."""
    exits = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise Exited

    monkeypatch.setattr(signals.os, "_exit", fake_exit)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        with signals.stop_on_signals(StopRequest(), for_the_process=True):
            os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(Exited):
            os.kill(os.getpid(), signal.SIGTERM)
        assert exits == [130]
        with pytest.raises(Exited):
            os.kill(os.getpid(), signal.SIGINT)
        assert exits == [130, 130]
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    # a run that ended without a stop puts the process's handlers back, as in-process callers need
    with signals.stop_on_signals(StopRequest(), for_the_process=True):
        pass
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


# A process that stopped on SIGTERM and then exits. Its C-level exit hook blocks in pause() until a
# signal comes: it stands for Ray's C++ teardown, which runs after the interpreter's finalization has put
# the default handlers back (where a further SIGTERM killed `relax train` with -15 instead of 130).
EXITING = textwrap.dedent(
    """
    import atexit, ctypes, os, signal, sys
    from pathlib import Path
    from relax.entrypoints.signals import exit_after_stop, stop_on_signals
    from relax.orchestration.stop import StopRequest

    from concurrent.futures import ThreadPoolExecutor
    ThreadPoolExecutor(1).submit(int).result()  # an idle pool worker, as the run's clients leave them
    libc = ctypes.CDLL(None)
    libc.__cxa_atexit(libc.pause, None, None)
    atexit.register(Path(sys.argv[1]).write_text, "ran")  # Python's exit hooks (Ray's disconnect) still run
    with stop_on_signals(StopRequest(), for_the_process=True):
        os.kill(os.getpid(), signal.SIGTERM)
    exit_after_stop(130)
    """
)


def test_the_command_lines_exit_after_a_stop_runs_the_exit_hooks_and_skips_the_teardown(tmp_path):
    flag = tmp_path / "hooks"
    proc = subprocess.Popen([sys.executable, "-c", EXITING, str(flag)])
    try:  # a process that reached the C-level hook would wait there for a signal: a timeout here
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert flag.read_text() == "ran"


def test_a_stop_once_steps_run_says_the_step_finishes_first(no_hard_exit, caplog):
    stop = StopRequest()
    stop.steps_begin(5.0)
    with signals.stop_on_signals(stop):
        os.kill(os.getpid(), signal.SIGTERM)
    assert "SIGTERM: finishing the current step (at most ops.stop_grace_s=5s)" in caplog.text
    assert not stop.request()  # already requested: the first request's time stands


def test_starting_ray_keeps_the_sigterm_handler_the_process_installed():
    def mine(signum, frame) -> None:
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        with _keeping_sigterm_handler():
            signal.signal(signal.SIGTERM, lambda s, f: None)  # what ray.init does
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)

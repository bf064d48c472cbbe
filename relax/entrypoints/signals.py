"""SIGTERM and Ctrl-C (SIGINT) during `relax train`: the first asks the run to stop (a `StopRequest`,
relax/orchestration/stop.py: the start ends, or the step in flight finishes within `ops.stop_grace_s`
and its checkpoint is saved); the second stops at once (`KeyboardInterrupt` in the main thread, and the
process exits after `HARD_EXIT_S` even if the clean-up hangs in a call to Ray). For the command line
also after the run has ended on the first, while the process is on its way out.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

from relax.orchestration.stop import StopRequest

# After a second stop signal, the most the clean-up may take before the process exits anyway (a thread
# stuck in a call to Ray must not keep it alive); within the ops.stop_grace_s + 10 s a stop promises.
HARD_EXIT_S = 10.0
EXIT_CODE = 130

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest, for_the_process: bool = False) -> Iterator[StopRequest]:
    """While inside: SIGINT and SIGTERM request `stop`, a second one stops at once. The handlers the
    process had are put back on the way out. Starting Ray keeps them (`service.start_ray`).

    `for_the_process`: for a process that ends with this block (the command line). Once a stop was
    requested, the process is on its way out, maybe for seconds in Ray's shutdown at exit: from the way
    out on, a further signal exits at once with `EXIT_CODE`, as the second signal promises, instead of
    meeting the process's old handler (the default one kills it: exit status -15, not 130)."""

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if not stop.request():  # the second signal: stop now; if clean-up hangs, exit anyway
            logger.warning("%s again: stopping now", name)
            hard_exit = threading.Timer(HARD_EXIT_S, os._exit, args=(EXIT_CODE,))
            hard_exit.daemon = True
            hard_exit.start()
            raise KeyboardInterrupt
        logger.warning("%s: %s", name, stop.effect)

    old = signal.signal(signal.SIGINT, handler), signal.signal(signal.SIGTERM, handler)
    try:
        yield stop
    finally:
        if for_the_process and stop.requested:
            signal.signal(signal.SIGINT, _exit_at_once)
            signal.signal(signal.SIGTERM, _exit_at_once)
        else:
            signal.signal(signal.SIGINT, old[0])
            signal.signal(signal.SIGTERM, old[1])


def _exit_at_once(signum: int, frame: object) -> None:
    os.write(2, f"relax train: {signal.Signals(signum).name} again: stopped at once\n".encode())
    os._exit(EXIT_CODE)


def exit_after_stop(code: int) -> NoReturn:
    """The command line's exit after a stop signal: what the interpreter's exit would do (join the
    threads, run the exit hooks: Ray's disconnect, the run's secrets folder), with the stop handlers
    still installed, then end the process without the rest. The interpreter's finalization puts the
    default signal handlers back, and Ray's C++ teardown runs after it: a further signal in that stretch
    killed the process (exit -15) where a second signal promises 130."""
    # the interpreter's own first step at exit: stop the thread pools' idle workers (their exit hooks),
    # then join the threads that are not daemons; joining alone would wait on the idle workers forever
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

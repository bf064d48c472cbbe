"""SIGTERM and Ctrl-C (SIGINT) during `relax train`: the first asks the run to stop (a `StopRequest`,
relax/orchestration/stop.py: the start ends, or the step in flight finishes within `ops.stop_grace_s`
and its checkpoint is saved); the second stops at once (`KeyboardInterrupt` in the main thread, and the
process exits after `HARD_EXIT_S` even if the clean-up hangs in a call to Ray).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

from relax.orchestration.stop import StopRequest

# After a second stop signal, the most the clean-up may take before the process exits anyway (a thread
# stuck in a call to Ray must not keep it alive); within the ops.stop_grace_s + 10 s a stop promises.
HARD_EXIT_S = 10.0
EXIT_CODE = 130

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest) -> Iterator[StopRequest]:
    """While inside: SIGINT and SIGTERM request `stop`, a second one stops at once. The handlers the
    process had are put back on the way out. Starting Ray keeps them (`service.start_ray`)."""

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
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])

"""asyncio helpers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has ended; its cancellation or failure is not raised
    (the owner is shutting it down; a failure that matters was raised where the task is checked)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def in_daemon_thread(fn: Any, *args: Any) -> Any:
    """`fn(*args)` on a thread of its own, awaited. Weight calls can block for as long as a rendezvous
    waits for its peers: on the default executor (a handful of threads on a small host) a few of them
    stalled every other route that uses it, and its threads, joined at exit, kept SIGTERM from ending
    the process. A daemon thread holds neither."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
            result, error = None, e
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name=f"relax-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await done

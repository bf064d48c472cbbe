"""One-line causes of errors (relax/utils/errors.py): a Ray task error's remote traceback gives its last
line, colour codes removed; any other error its type and message."""

from __future__ import annotations

import traceback

from ray.exceptions import RayTaskError

from relax.utils.errors import cause_of


def test_a_ray_task_error_gives_the_remote_error_line():
    try:
        raise RuntimeError("http://127.0.0.1:1 answered 400: no weight-sync group for you")
    except RuntimeError as e:  # as Ray builds it on the worker: the traceback text and the cause
        remote = RayTaskError("ServeReplica:actor:actor.handle_request", traceback.format_exc(), e)
    wrapped = remote.as_instanceof_cause()
    assert "\x1b[" in str(wrapped) or "Traceback" in str(wrapped)  # what the driver gets
    assert cause_of(wrapped) == "RuntimeError: http://127.0.0.1:1 answered 400: no weight-sync group for you"


def test_other_errors_give_type_and_message():
    assert cause_of(ValueError("bad row")) == "ValueError: bad row"
    assert cause_of(KeyError()) == "KeyError"

"""Relax's errors with fields of their own cross process boundaries (Ray pickles a raised exception to
send it to the caller). Rebuilt from their text alone they fail to unpickle, and the caller sees Ray's
"Failed to deserialize exception" instead of the cause (a refused weight-group join showed exactly that)."""

from __future__ import annotations

import pickle

import pytest

from relax.engine_api.client import EngineRequestError
from relax.orchestration.health import GlobalRestart
from relax.orchestration.service import RoleStartError
from relax.orchestration.watchdog import StepStalled


@pytest.mark.parametrize(
    "error",
    [
        EngineRequestError("http://127.0.0.1:1", 400, "refused"),
        GlobalRestart("actor", "a replica died"),
        StepStalled("actor", "the update", 3, 8.0),
        RoleStartError("rollout", "no GPU", node="198.18.0.2"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_error_survives_pickling_with_its_message_and_fields(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert vars(again) == vars(error)

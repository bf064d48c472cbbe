"""The scale operations' state machine and the operation book: transitions, one operation at a time,
idempotency, history bound. Pure Python."""

from __future__ import annotations

import pytest

from relax.fleet.elastic_ops import (
    Conflict,
    IdempotencyMismatch,
    InvalidTransition,
    NotFound,
    Operation,
    OperationBook,
    OpState,
)

S = OpState


def test_scale_out_path_and_history():
    op = Operation("scale_out", {"mode": "external"}, timeout_s=5)
    for state in (S.CONNECTING, S.HEALTH_CHECKING, S.WEIGHT_SYNCING, S.ACTIVE):
        assert not op.done
        op.advance(state, f"now {state.value}")
    assert op.done
    assert [h["state"] for h in op.history] == [
        "pending",
        "connecting",
        "health_checking",
        "weight_syncing",
        "active",
    ]
    view = op.to_dict()
    assert view["state"] == "active" and view["done"] and not view["cancellable"]
    with pytest.raises(InvalidTransition, match="has ended"):
        op.advance(S.FAILED)


@pytest.mark.parametrize(
    "kind, path, bad",
    [
        ("scale_out", [S.CREATING], S.ACTIVE),  # skipping health check and weight sync
        ("scale_out", [], S.DRAINING),  # a scale-in state
        ("scale_in", [S.DRAINING, S.REMOVING], S.CANCELLED),  # out of the group: no undo
        ("scale_in", [], S.COMPLETED),  # not drained
    ],
)
def test_forbidden_transitions(kind, path, bad):
    op = Operation(kind, {}, timeout_s=5)
    for state in path:
        op.advance(state)
    with pytest.raises(InvalidTransition):
        op.advance(bad)
    assert op.state == (path[-1] if path else S.PENDING)


def test_failure_keeps_the_error():
    op = Operation("scale_in", {"num_engines": 1}, timeout_s=5)
    op.advance(S.DRAINING)
    op.advance(S.FAILED, "timed out; rolled back", error="timed out")
    assert op.to_dict()["error"] == "timed out" and op.done


def test_book_one_at_a_time_and_idempotency():
    book = OperationBook()
    first, created = book.submit("scale_out", {"mode": "ray_native", "num_engines": 2}, 5, key="k1")
    assert created and first.id == "k1"
    again, created = book.submit("scale_out", {"mode": "ray_native", "num_engines": 2}, 5, key="k1")
    assert again is first and not created  # replay: same operation, nothing new started
    with pytest.raises(IdempotencyMismatch, match="different request"):
        book.submit("scale_out", {"mode": "ray_native", "num_engines": 3}, 5, key="k1")
    with pytest.raises(Conflict, match="one operation runs at a time") as e:
        book.submit("scale_in", {"num_engines": 1}, 5)
    assert e.value.status == 409
    first.advance(S.CREATING)
    first.advance(S.FAILED, error="boom")
    second, created = book.submit("scale_in", {"num_engines": 1}, 5)
    assert created and second.id != first.id
    assert book.get("k1") is first and book.get(second.id) is second
    with pytest.raises(NotFound):
        book.get("nope")
    # a replay of the finished request still answers with its (failed) operation
    assert book.submit("scale_out", {"mode": "ray_native", "num_engines": 2}, 5, key="k1")[0] is first


def test_book_forgets_oldest_finished():
    book = OperationBook(keep=2)
    ids = []
    for i in range(4):
        op, _ = book.submit("scale_in", {"num_engines": i + 1}, 5, key=f"k{i}")
        op.advance(S.CANCELLED)
        ids.append(op.id)
    book.submit("scale_in", {"num_engines": 9}, 5)  # forgetting happens on submission
    assert ids[0] not in book.ops and ids[1] not in book.ops
    assert ids[2] in book.ops and ids[3] in book.ops
    assert "k0" not in book._keys and "k3" in book._keys  # keys go with their operations


def test_committed_openapi_is_current():
    """docs/elastic_openapi.json is what the API serves (regenerate: python -m relax.fleet.elastic_api)."""
    import json
    from pathlib import Path

    from relax.fleet.elastic_api import openapi_document

    committed = json.loads((Path(__file__).parents[2] / "docs" / "elastic_openapi.json").read_text())
    assert committed == json.loads(json.dumps(openapi_document()))

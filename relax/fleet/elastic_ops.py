"""Elastic scale operations as state machines, and the book that keeps them: one operation at a time,
idempotent submission, a bounded history. Pure Python (no asyncio, no Ray, no HTTP), so the rules are
unit-tested on their own; `relax.fleet.elastic_manager` drives the operations.

Scale out:  pending -> creating (ray_native) | connecting (external) -> health_checking
            -> weight_syncing -> active
Scale in:   pending -> draining -> removing -> completed
Any state before the last one may end in `failed` (after a rollback) or `cancelled` (on request, after the
same rollback); `removing` may only fail, since the engines have then left the weight-sync group.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class OpState(str, Enum):
    PENDING = "pending"
    CREATING = "creating"
    CONNECTING = "connecting"
    HEALTH_CHECKING = "health_checking"
    WEIGHT_SYNCING = "weight_syncing"
    ACTIVE = "active"
    DRAINING = "draining"
    REMOVING = "removing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = OpState
TERMINAL = frozenset({S.ACTIVE, S.COMPLETED, S.FAILED, S.CANCELLED})
_ENDS = {S.FAILED, S.CANCELLED}
TRANSITIONS: dict[str, dict[OpState, set[OpState]]] = {
    "scale_out": {
        S.PENDING: {S.CREATING, S.CONNECTING, *_ENDS},
        S.CREATING: {S.HEALTH_CHECKING, *_ENDS},
        S.CONNECTING: {S.HEALTH_CHECKING, *_ENDS},
        S.HEALTH_CHECKING: {S.WEIGHT_SYNCING, *_ENDS},
        S.WEIGHT_SYNCING: {S.ACTIVE, *_ENDS},
    },
    "scale_in": {
        S.PENDING: {S.DRAINING, *_ENDS},
        S.DRAINING: {S.REMOVING, *_ENDS},
        S.REMOVING: {S.COMPLETED, S.FAILED},
    },
}


class ElasticError(Exception):
    """A request the API refuses; `status` is the HTTP status it is answered with."""

    status = 400

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class BadRequest(ElasticError):
    status = 400


class NotFound(ElasticError):
    status = 404


class Conflict(ElasticError):
    status = 409


class IdempotencyMismatch(ElasticError):
    status = 422


class InvalidTransition(RuntimeError):
    """A bug: the manager tried a move the state machine does not allow."""


@dataclass
class Operation:
    kind: str  # "scale_out" | "scale_in"
    request: dict[str, Any]  # the validated request body (what idempotency compares)
    timeout_s: float  # deadline of the whole operation, from its submission
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    state: OpState = OpState.PENDING
    engines: list[str] = field(default_factory=list)  # URLs the operation adds or removes
    error: str | None = None  # why it failed (after rollback)
    message: str = "queued"  # what it is doing now, for people
    cancellable: bool = True  # False once the change can no longer be undone
    cancel_requested: bool = False
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    history: list[dict[str, Any]] = field(default_factory=list)  # [{"state", "at", "message"}]

    def __post_init__(self) -> None:
        if self.kind not in TRANSITIONS:
            raise ValueError(f"unknown operation kind {self.kind!r}; valid: {', '.join(TRANSITIONS)}")
        self.history.append({"state": self.state.value, "at": self.created_at, "message": self.message})

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    def advance(self, state: OpState, message: str = "", error: str | None = None) -> None:
        allowed = TRANSITIONS[self.kind].get(self.state, set())
        if state not in allowed:
            raise InvalidTransition(
                f"{self.kind} {self.id}: {self.state.value} -> {state.value} is not allowed "
                f"(allowed: {sorted(s.value for s in allowed) or 'none, it has ended'})"
            )
        self.state, self.message, self.updated_at = state, message or state.value, time.time()
        if error is not None:
            self.error = error
        self.history.append({"state": state.value, "at": self.updated_at, "message": self.message})

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.id,
            "kind": self.kind,
            "state": self.state.value,
            "done": self.done,
            "engines": list(self.engines),
            "error": self.error,
            "message": self.message,
            "cancellable": self.cancellable and not self.done,
            "request": self.request,
            "timeout_s": self.timeout_s,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "history": list(self.history),
        }


class OperationBook:
    """Every operation by id, idempotency keys, and the rule of one running operation at a time."""

    def __init__(self, keep: int = 100) -> None:
        self.keep = keep  # finished operations remembered (oldest forgotten first)
        self.ops: dict[str, Operation] = {}
        self._keys: dict[str, str] = {}  # idempotency key -> operation id

    def running(self) -> Operation | None:
        return next((op for op in self.ops.values() if not op.done), None)

    def submit(
        self, kind: str, request: dict[str, Any], timeout_s: float, key: str | None = None
    ) -> tuple[Operation, bool]:
        """The operation for this request: (existing one, False) when `key` was seen with the same
        request, else (a new pending one, True). Raises `IdempotencyMismatch` when `key` came with a
        different request and `Conflict` while another operation runs."""
        if key is not None and key in self._keys and self._keys[key] in self.ops:
            op = self.ops[self._keys[key]]
            if op.kind != kind or op.request != request:
                raise IdempotencyMismatch(
                    f"idempotency key {key!r} was used for a different request (operation {op.id}, "
                    f"{op.kind} {op.request}); use a new key for a new request"
                )
            return op, False
        running = self.running()
        if running is not None:
            raise Conflict(
                f"operation {running.id} ({running.kind}) is still {running.state.value}; one operation "
                f"runs at a time: wait for it (GET /v1/operations/{running.id}) or cancel it"
            )
        op = Operation(kind, request, timeout_s, id=key or uuid.uuid4().hex[:16])
        if op.id in self.ops:  # a key equal to an old generated id: keep ids unique
            op.id = uuid.uuid4().hex[:16]
        self.ops[op.id] = op
        if key is not None:
            self._keys[key] = op.id
        self._forget_old()
        return op, True

    def get(self, op_id: str) -> Operation:
        op = self.ops.get(op_id) or self.ops.get(self._keys.get(op_id, ""))
        if op is None:
            raise NotFound(f"no operation {op_id!r}; GET /v1/operations lists the known ones")
        return op

    def _forget_old(self) -> None:
        finished = [op for op in self.ops.values() if op.done]
        for op in finished[: max(0, len(finished) - self.keep)]:
            del self.ops[op.id]
            for k in [k for k, v in self._keys.items() if v == op.id]:
                del self._keys[k]

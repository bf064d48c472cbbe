"""Start-up failures of roles, reported where the driver sees them at once.

Ray Serve retries a replica whose constructor raises, again and again: a missing file or a bad model
would keep a run waiting with its error buried in the replica's log. `with_startup_report` wraps a role
class so that a constructor that raises records the role, its node and the error in Ray's key-value store
(in the cluster's GCS, visible to every process of the cluster) before the exception propagates;
`relax.orchestration.service.deploy_roles` reads it while it waits and stops the run with it.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from typing import Any

logger = logging.getLogger(__name__)

KV_NAMESPACE = "relax"
ERROR_LINES = 12  # the end of the traceback kept in the report


def _key(role: str) -> bytes:
    return f"start_failure/{role}".encode()


def report_start_failure(role: str, error: BaseException) -> None:
    """Record that role `role` failed to start with `error` (best effort: outside Ray it only logs)."""
    from relax.utils.net import node_ip

    lines = traceback.format_exception(type(error), error, error.__traceback__)
    text = "".join(lines[-ERROR_LINES:]).strip()
    record = {
        "node": node_ip(),
        "pid": os.getpid(),
        "error": f"{type(error).__name__}: {error}",
        "trace": text,
    }
    logger.error("role %s failed to start on node %s: %s", role, record["node"], record["error"])
    try:
        from ray.experimental import internal_kv

        if internal_kv._internal_kv_initialized():  # noqa: SLF001 - Ray's cluster KV, the public way in
            internal_kv._internal_kv_put(
                _key(role), json.dumps(record), overwrite=True, namespace=KV_NAMESPACE
            )  # noqa: SLF001
    except Exception:  # noqa: BLE001 - reporting must not hide the constructor's own error
        logger.exception("could not report the start-up failure of %s", role)


def start_failure(role: str) -> dict[str, Any] | None:
    """The recorded start-up failure of `role`, if any: {node, pid, error, trace}."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_key(role), namespace=KV_NAMESPACE)  # noqa: SLF001
    return json.loads(raw) if raw else None


def clear_start_failures(roles: list[str]) -> None:
    """Forget earlier reports of `roles` (a role deployed again starts with a clean record)."""
    from ray.experimental import internal_kv

    for role in roles:
        internal_kv._internal_kv_del(_key(role), namespace=KV_NAMESPACE)  # noqa: SLF001


def bind_serve_grpc(bind: str) -> None:
    """Make this Serve replica's inter-deployment gRPC server listen on `resources.bind`'s address
    (127.0.0.1 on one machine, the node's address on a cluster) instead of every interface.

    Serve starts that server once the replica's constructor has returned, on the hard-coded address
    `[::]:0`, through `add_port_to_grpc_server` of its replica module; this wraps that function in this
    process only (the role's constructor runs first, so the wrap is in place when Serve calls it).
    Without the module or the function (another Ray version) the replica keeps Serve's default, and
    tests/security/test_listeners.py says so."""
    from relax.utils.net import bind_address

    try:
        from ray.serve._private import replica
    except ImportError:
        return
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "_relax_bound", False):
        return
    host = bind_address(bind)
    host = f"[{host}]" if ":" in host else host

    def bound(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = f"{host}:{address[len('[::]:') :]}"
        return original(server, address)

    bound._relax_bound = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = bound


def with_startup_report(cls: type, role: str) -> type:
    """A subclass of role class `cls` whose constructor reports its failure (`report_start_failure`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            for arg in args:  # the role's config: its secrets are masked in this process's logs
                if hasattr(arg, "run") and hasattr(arg, "model_dump"):
                    from relax.config import register_config_secrets
                    from relax.utils.auth import set_process_token

                    register_config_secrets(arg)
                    set_process_token(arg.run.token_value())  # what its servers ask, its clients send
                    bind_serve_grpc(arg.resources.bind)
            cls.__init__(self, *args, **kwargs)
        except BaseException as e:
            report_start_failure(role, e)
            raise

    # `__module__` is this module: Ray pickles the subclass by value (see relax/utils/gc_freeze.py)
    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__})

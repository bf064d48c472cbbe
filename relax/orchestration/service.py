"""Starting and stopping the Ray cluster, Ray Serve, and one Serve application per role.

Each role is its own Serve application, so a failed replica is restarted by Serve without touching the
other roles. Role classes are plain Python classes; `deploy_role` wraps them with `serve.deployment`.

The console shows Relax's progress, not Ray's internals. On a cluster Relax starts with a run's log folder
(`start_ray(log_dir=...)`, the run's `logs/`): Serve's controller and replicas log to files there
(`logs/serve/`, Serve's `LoggingConfig` and `RAY_SERVE_LOG_TO_STDERR=0`, which also sends what a replica
prints to its file), Relax's own INFO lines from role processes go to `logs/<process>.log`
(relax/utils/logging.py) while their warnings and errors still reach the console through Ray's
`log_to_driver`, and Ray's driver-side INFO lines are off. A clean exit deletes the roles' applications
and then stops the whole cluster, so no Serve actor is killed while the driver still waits on it (which
Ray reports as a warning).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEPLOY_TIMEOUT_S = 600.0  # a role not running by then is reported with what it asks for
DEPLOY_POLL_S = 0.2
ROLE_STOP_TIMEOUT_S = 5.0  # Serve's graceful_shutdown_timeout_s for a role (`_application`)

# A cluster Relax starts on this machine: every Ray port on loopback (node address 127.0.0.1), with Ray's
# own token authentication (relax/orchestration/ray_token.py: loopback is no boundary on a shared
# machine). Never for a cluster Relax joins: its nodes must advertise the addresses the other nodes reach
# them on, and its auth is the cluster's (docs/cluster.md). The user's own environment wins.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Where the processes of a cluster Relax starts write their logs (the run's `logs/`); read by
# relax/utils/logging.py in each role's process, which inherits it.
LOG_DIR_ENV = "RELAX_LOG_DIR"
_serve_logs_dir: str | None = None  # Serve's log folder of this process's run (start_serve), else Ray's
# Serve as this process found it: a run shuts Serve down only when it started it (`shutdown`), so a
# cluster's other Serve applications (and a test session's shared Serve) outlive the run.
_serve_started = False
_deployed: set[str] = set()  # the Serve applications this process deployed and has not deleted


def cluster_address(configured: str | None) -> str | None:
    """The Ray cluster to join: `resources.ray_address` (`auto` included), else `RAY_ADDRESS` (what
    `ray job submit` sets for the job's driver); None = start a local cluster."""
    return configured or os.environ.get("RAY_ADDRESS") or None


def set_ray_env_defaults(local: bool = True, secrets_dir: Any = None, log_dir: Any = None) -> None:
    """Set before Ray starts, so every worker it spawns inherits them; `local`: Relax starts the cluster
    on this machine (loopback only), with Ray's token authentication, its token kept in `secrets_dir`
    (the run's `secrets/`; None: a private temporary folder); `log_dir` (a local cluster only): where its
    processes log instead of the console (module docstring)."""
    if local:
        from relax.orchestration.ray_token import enable_ray_token

        for k, v in LOCAL_RAY_ENV.items():
            os.environ.setdefault(k, v)
        enable_ray_token(secrets_dir)
        if log_dir is not None:
            os.environ[LOG_DIR_ENV] = str(log_dir)
            os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
            # transformers' "Loading weights" bars of every process that loads a model (engines, ranks)
            os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Serve replicas export their cached request metrics every 100 ms by default, a steady cost per idle
    # replica on a small host (docs/measurements.md). Relax's own metrics do not come from there.
    os.environ.setdefault("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "1000")
    # Serve's controller runs its control loop every 100 ms by default, which costs CPU with nothing to do
    # (docs/measurements.md). The cost of 0.5 s: a deploy or a replica replacement may start up to 0.4 s
    # later. The test suite, which deploys hundreds of roles, keeps Serve's 0.1 s (tests/conftest.py).
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    # TransferQueue asks for 8 torch threads per put/get and logs a warning on every call when the host
    # has fewer physical cores; ask for what is there.
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        cores = os.cpu_count() or 1
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, cores)))


def start_ray(
    address: str | None,
    num_cpus: int,
    object_store_mb: int,
    num_gpus: int | None = None,
    secrets_dir: Any = None,
    log_dir: Any = None,
    dashboard: bool = False,
) -> bool:
    """Join the cluster at `address` or `RAY_ADDRESS` (`cluster_address`), or start a local single-node
    Ray bound to 127.0.0.1 with `num_cpus`, `num_gpus` and the object store size (those describe only a
    cluster Relax starts), with Ray's token authentication, the token kept in `secrets_dir`
    (`set_ray_env_defaults`), its processes logging to `log_dir` rather than the console (module
    docstring) and, with `dashboard`, Ray's dashboard on 127.0.0.1. Returns whether this call connected
    (False when Ray was already initialised in this process, e.g. by a test session)."""
    address = cluster_address(address)
    set_ray_env_defaults(local=address is None, secrets_dir=secrets_dir, log_dir=log_dir)
    import ray

    if ray.is_initialized():
        return False
    with _keeping_sigterm_handler():
        _init_ray(address, num_cpus, object_store_mb, num_gpus, dashboard)
    logger.info("ray resources: %s", ray.cluster_resources())
    return True


@contextlib.contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """`ray.init` puts its own SIGTERM handler in (one that exits at once); a handler the process had
    installed (the command line's stop request, relax/entrypoints/signals.py) is put back after it."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(before):
            signal.signal(signal.SIGTERM, before)


def _init_ray(
    address: str | None, num_cpus: int, object_store_mb: int, num_gpus: int | None, dashboard: bool
) -> None:
    import ray

    if address:
        ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
        nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
        logger.info("joined the Ray cluster at %s: %d node(s) %s", address, len(nodes), nodes)
    else:
        from relax.orchestration.local_ray import init_local_ray

        # started again when a busy machine makes Ray's node time out during startup (local_ray.py)
        context = init_local_ray(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            object_store_memory=object_store_mb * 1024 * 1024,
            # never all interfaces: the dashboard runs code on the cluster for whoever reaches it
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            _node_ip_address="127.0.0.1",
            logging_level=logging.WARNING,  # Ray's own driver-side INFO lines ("Started a local Ray instance")
        )
        # where an operator reaches it (`ray status --address`, with the token: docs/cluster.md)
        logger.info(
            "started a local Ray cluster at %s (token authentication: %s)",
            ray.get_runtime_context().gcs_address,
            os.environ.get("RAY_AUTH_MODE", "Ray's default"),
        )
        if dashboard:
            logger.info("Ray dashboard at http://%s (loopback only)", context.dashboard_url)


def start_run_ray(cfg: Any) -> bool:
    """`start_ray` for a run of `cfg` (a RelaxConfig): its resources, its secrets and logs folders."""
    r, run_dir = cfg.resources, cfg.run.run_dir
    return start_ray(
        r.ray_address,
        r.num_cpus,
        r.object_store_mb,
        r.num_gpus,
        secrets_dir=run_dir / "secrets",
        log_dir=run_dir / "logs",
        dashboard=r.dashboard,
    )


def set_run_token(cfg: Any) -> None:
    """The run's secret: RELAX_RUN_TOKEN, else a fresh one; every server the run starts requires it.
    Operators find it in <run_dir>/secrets/run_token (readable by its owner only)."""
    import secrets

    from pydantic import SecretStr

    from relax.config import register_config_secrets
    from relax.utils.auth import set_process_token
    from relax.utils.redact import write_secret_file

    token = os.environ.get("RELAX_RUN_TOKEN") or secrets.token_urlsafe(32)
    cfg.run.token = SecretStr(token)
    register_config_secrets(cfg)
    set_process_token(token)
    write_secret_file(cfg.run.run_dir / "secrets" / "run_token", token)


def start_serve(log_dir: Path | None = None) -> None:
    """Start Ray Serve (no HTTP proxy: roles are reached through handles), its controller and replicas
    logging to `log_dir/serve` when given; Serve's driver-side INFO lines are kept off the console."""
    global _serve_logs_dir
    from ray import serve

    global _serve_started
    _serve_logs_dir = str(Path(log_dir) / "serve") if log_dir is not None else None
    # `import ray.serve` gives its logger a console handler at INFO ("Started Serve in namespace ...")
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    _serve_started = _serve_started or not serve_running()  # a later attempt finds the Serve it started
    serve.start(proxy_location="Disabled", logging_config=_logging_config())


def serve_running() -> bool:
    """Whether Ray Serve's controller runs in the connected cluster."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def _logging_config() -> Any:
    from ray.serve.schema import LoggingConfig

    return LoggingConfig(logs_dir=_serve_logs_dir, enable_access_log=False)


class RoleStartError(RuntimeError):
    """A role did not start: its constructor raised (`node`, `error`), its deployment failed, or it was
    not running within the deadline."""

    def __init__(self, role: str, reason: str, node: str | None = None) -> None:
        where = f" on node {node}" if node else ""
        super().__init__(f"role {role} could not start{where}: {reason}")
        self.role, self.node, self.reason = role, node, reason
        logger.error("%s", self)

    def __reduce__(self) -> tuple:  # Ray sends it between processes: rebuilt from its fields, not its text
        return type(self), (self.role, self.reason, self.node)


class RunStopped(RuntimeError):
    """A stop was requested (SIGTERM, Ctrl-C) before the run's roles were up."""


@dataclass
class RoleDeployment:
    """One role for `deploy_roles`: the Serve application `name` running `cls(*args, **kwargs)`."""

    name: str
    cls: type
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 16
    heartbeat_s: float | None = None
    cpus: str | None = None  # pin the replica's process to these CPUs (relax/utils/cpu_affinity.py)
    placement: dict[str, Any] = field(default_factory=dict)  # Ray `resources` / `label_selector`


def _application(r: RoleDeployment):
    from ray import serve

    from relax.ops.startup import with_startup_report
    from relax.utils.cpu_affinity import with_cpu_affinity
    from relax.utils.gc_freeze import with_frozen_startup

    cls = with_cpu_affinity(r.cls, r.cpus, f"CPU budget of role {r.name}")  # before the role starts threads
    cls = with_frozen_startup(cls)  # a replica is its own process: keep the collector off its start-up
    if r.heartbeat_s is not None:
        from relax.ops.heartbeat import with_heartbeat

        cls = with_heartbeat(cls, r.name, r.heartbeat_s)
    cls = with_startup_report(cls, r.name)  # outermost: a failure anywhere in start-up is reported
    deployment = serve.deployment(
        cls,
        name=r.name,
        num_replicas=1,
        max_ongoing_requests=r.max_ongoing_requests,
        ray_actor_options={"num_cpus": r.num_cpus, "num_gpus": r.num_gpus, **r.placement},
        health_check_period_s=10,
        health_check_timeout_s=60,
        # The Controller deletes a role once it has no call of its own running (the step's calls returned,
        # the checkpoint written, the engines stopped): a request still running then is one that hangs (a
        # stuck update after a stop, a step the watchdog gave up on), and waiting for it only delays the
        # stop. 5 s lets a request finishing on a busy machine end; Serve then kills the replica.
        graceful_shutdown_timeout_s=ROLE_STOP_TIMEOUT_S,
        # A role is deleted once the Controller no longer calls it; Serve's default 2 s between looks for
        # requests still running made every run's stop (and every restart in place) 2 s longer.
        graceful_shutdown_wait_loop_s=0.2,
        logging_config=_logging_config(),
    )
    return deployment.bind(*r.args, **r.kwargs)


def deploy_role(name: str, cls: type, *args: Any, **options: Any):
    """Deploy `cls(*args)` as the Serve application `name` with one replica (keyword `options` are
    `RoleDeployment` fields) and wait until it runs; return its handle."""
    return deploy_roles([RoleDeployment(name, cls, args, **options)])[name]


def deploy_roles(
    roles: list[RoleDeployment],
    *,
    should_stop: Callable[[], bool] = lambda: False,
    timeout_s: float = DEPLOY_TIMEOUT_S,
) -> dict[str, Any]:
    """Deploy every role at once and wait until all are running; return their handles by name.

    The replicas start in parallel (each imports torch and loads its model), which takes a run's start-up
    from the sum of the roles' start times to about the longest one. Roles must not call each other in
    their constructors (none does: they meet through the data plane and the Controller).

    Fails fast instead of letting Serve retry: a constructor that raises (a missing file, a bad model, an
    import error) raises `RoleStartError` naming the role, its node and the error as soon as it is
    reported; so does a deployment Serve gives up on, and one still not running after `timeout_s` (not
    placed: the cluster lacks what it asks for). `should_stop()` true (SIGTERM, Ctrl-C) raises
    `RunStopped`.
    """
    from ray import serve

    from relax.ops.startup import clear_start_failures, start_failure

    names = [r.name for r in roles]
    logger.info("starting roles %s", ", ".join(names))
    clear_start_failures(names)
    targets = [serve.RunTarget(_application(r), name=r.name, route_prefix=None) for r in roles]
    handles = serve.run_many(targets, wait_for_applications_running=False)
    _deployed.update(names)
    deadline = time.monotonic() + timeout_s
    pending = set(names)
    while pending:
        for name in sorted(pending):
            if (failure := start_failure(name)) is not None:
                raise RoleStartError(name, failure["error"], failure["node"])
        apps = app_statuses()
        for name in sorted(pending):
            app = apps.get(name)
            status = app.status if app else ""
            if status == "RUNNING":
                pending.discard(name)
            elif status in ("DEPLOY_FAILED", "UNHEALTHY"):
                # the constructor's own report says more than Serve's status; it may lag the status a little
                failure = _await_report(name, start_failure)
                if failure is not None:
                    raise RoleStartError(name, failure["error"], failure["node"])
                raise RoleStartError(name, f"Serve reports {status}: {app.message}".strip())
        if not pending:
            break
        if should_stop():
            raise RunStopped(f"stop requested while roles {sorted(pending)} were starting")
        if time.monotonic() > deadline:
            demand = {r.name: {"CPU": r.num_cpus, "GPU": r.num_gpus, **r.placement} for r in roles}
            raise RoleStartError(
                ", ".join(sorted(pending)),
                f"not running after {timeout_s:.0f}s (asks for {[demand[n] for n in sorted(pending)]}; the "
                "cluster may lack those resources or labels: see resources.placement and `ray status`)",
            )
        time.sleep(DEPLOY_POLL_S)
    logger.info("roles %s are up", ", ".join(names))
    return dict(zip(names, handles, strict=True))


@dataclass(frozen=True)
class AppStatus:
    status: str  # Serve's ApplicationStatus name: DEPLOYING, RUNNING, DEPLOY_FAILED, UNHEALTHY, DELETING
    message: str  # the application's message and its deployments' ("name: message; ...")


def app_statuses() -> dict[str, AppStatus]:
    """The status of every Serve application in the cluster, by name.

    `serve.status()` validates the controller's whole report into pydantic models, and each deployment's
    `RequestRouterConfig` cloudpickles its router class by value on the way: about 50 ms of CPU a call with
    four applications on an idle core, far more on a busy one. Polled every `DEPLOY_POLL_S` while a run's
    roles import torch, that was a quarter of the driver's CPU at start-up, taken from the replicas it
    waits for. The controller's report as a plain dict (what `serve.status()` itself parses) costs about
    1 ms; `serve.status()` stays the fallback for a Ray without that method."""
    from ray import serve

    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        if client is None:
            return {}
        details = client.get_serve_details()
    except (ImportError, AttributeError, TypeError):
        return {
            name: AppStatus(
                str(app.status).rsplit(".", 1)[-1],
                "; ".join(
                    [app.message, *(f"{d}: {st.message}" for d, st in app.deployments.items() if st.message)]
                ),
            )
            for name, app in serve.status().applications.items()
        }
    out = {}
    for name, app in (details.get("applications") or {}).items():
        deployments = app.get("deployments") or {}
        messages = [app.get("message") or ""]
        messages += [f"{d}: {dep['message']}" for d, dep in deployments.items() if dep.get("message")]
        out[name] = AppStatus(
            str(app.get("status", "")).rsplit(".", 1)[-1], "; ".join(m for m in messages if m)
        )
    return out


def _await_report(name: str, start_failure: Callable[[str], Any], wait_s: float = 3.0) -> Any:
    deadline = time.monotonic() + wait_s
    while (failure := start_failure(name)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return failure


def delete_role(name: str) -> None:
    """Remove the Serve application `name` (its replica is stopped)."""
    from ray import serve

    serve.delete(name)
    _deployed.discard(name)
    logger.info("role %s removed", name)


def delete_roles(timeout_s: float = 60.0) -> None:
    """Stop every role: delete the Serve applications this process deployed at once (each replica shuts
    down gracefully; other applications in the cluster are not the run's) and wait until they are gone,
    keeping Serve's controller for the next attempt or `shutdown`."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        names = sorted(_deployed & set(app_statuses()))
        _deployed.clear()
        for name in names:
            serve.delete(name, _blocking=False)
        deadline = time.monotonic() + timeout_s
        while names and time.monotonic() < deadline:
            names = [n for n in names if n in app_statuses()]
            time.sleep(DEPLOY_POLL_S)
        if names:
            logger.warning("roles %s were still stopping after %.0fs", ", ".join(names), timeout_s)
    except Exception:  # noqa: BLE001 - stopping; Serve or the cluster may already be gone
        logger.exception("stopping the roles failed")


def end_run(stop_ray: bool) -> None:
    """The end of a run, however it ends: its token is forgotten (a process may run several), the
    heartbeat board closed (the next run in this cluster starts a fresh one), then `shutdown`."""
    from relax.ops.heartbeat import close_board
    from relax.utils.auth import set_process_token

    set_process_token(None)
    try:
        close_board()
    except Exception:  # noqa: BLE001 - best effort on the way out
        logger.exception("closing the heartbeat board failed")
    shutdown(stop_ray)


def shutdown(stop_ray: bool) -> None:
    """The end of a run. `stop_ray` (Relax started the cluster): stop the cluster, Serve with it; the
    roles were deleted before (`delete_roles`), and `serve.shutdown()` here would have Serve's controller
    kill itself under the driver's pending calls, which Ray reports as warnings on a clean exit. A cluster
    Relax joined keeps running: Serve is shut down in it when this run started it, and left as found
    otherwise (the cluster's own Serve applications, or a test session's Serve shared by its runs)."""
    global _serve_started
    import ray
    from ray import serve

    started, _serve_started = _serve_started, False
    if not ray.is_initialized():
        return
    if stop_ray:
        ray.shutdown()
        return
    if not started:
        return
    try:
        serve.shutdown()
    except Exception:  # noqa: BLE001 - shutting down; the cluster may already be gone
        logger.exception("serve shutdown failed")

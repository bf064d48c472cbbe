"""The SGLang backend: SGLang servers as Relax's inference engines on GPU clusters.

Two modes, one client (`EngineClient` speaks SGLang's native API, which the embedded engine copies):

* `ray_native`: Relax launches `python -m sglang.launch_server` inside a Ray actor that holds the GPUs
  (`num_gpus = tp_size`; Ray sets `CUDA_VISIBLE_DEVICES`, the server inherits it) and waits for
  `/health`. `SGLangServer` is the plain class; `launch_ray_native` wraps it in an actor.
* `external`: the servers already run; `attach_external(url)` checks `/health` and reads
  `/get_model_info`.

Weights reach SGLang exactly as they reach the embedded engine: `init_weights_update_group` then
`update_weights_from_distributed` per bucket (`relax.weights.sync_group.init_weight_sync` /
`push_weights`), or `update_weights_from_disk`. SGLang itself is an optional dependency, needed only
on the machines that run the servers; everything up to the process launch works without it, and
`launch_command=embedded_launch_command` runs `relax engine serve` in its place (tests do).

A run reaches this module through its registry entry (`rollout.engine = sglang`,
`relax.backends.inference.registry`): `start_sglang_engines(cfg)` starts `rollout.num_engines` servers as
an `SGLangGroup`, which the fleet's supervisor replaces one by one like embedded engines.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relax.backends.inference.engine_actors import EngineGroup
from relax.backends.inference.launcher import ServerProcess, embedded_engine_command, server_url
from relax.config import RelaxConfig
from relax.engine_api.client import EngineClient
from relax.utils.auth import API_KEY_ENV, engine_key, process_token, set_process_token
from relax.utils.net import bind_address, free_port, node_ip
from relax.utils.placement import bundle_options, ray_placement

logger = logging.getLogger(__name__)


class SGLangServerConfig(BaseModel):
    """How to launch one SGLang server (the flags of `sglang.launch_server` that RL needs)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(description="Hugging Face model folder or hub id, as SGLang takes it.")
    host: str = Field("127.0.0.1", description="Address the server listens on (0.0.0.0: all interfaces).")
    port: int = Field(0, ge=0, description="Port; 0 picks a free one on the node at launch.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel GPUs per server (the actor holds as many).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="Weight dtype.")
    mem_fraction_static: float | None = Field(
        None, gt=0.0, lt=1.0, description="GPU memory share for weights + KV cache (SGLang's default: None)."
    )
    context_length: int | None = Field(None, ge=1, description="Cap on prompt + output tokens.")
    weight_version: str = Field("0", description="Weight version reported until the first update.")
    random_seed: int | None = Field(None, description="Seed of the server's sampler.")
    log_level: str = Field("warning", description="SGLang's log level.")
    extra_args: list[str] = Field(default_factory=list, description="More flags, passed verbatim.")
    python: str = Field(default_factory=lambda: sys.executable, description="Interpreter with sglang.")
    startup_timeout_s: float = Field(900.0, gt=0, description="Seconds to wait for /health after launch.")


def build_launch_command(cfg: SGLangServerConfig, port: int | None = None) -> list[str]:
    """`python -m sglang.launch_server ...` for `cfg` (on `port` when given, else cfg.port)."""
    port = cfg.port if port is None else port
    cmd = [cfg.python, "-m", "sglang.launch_server", "--model-path", cfg.model_path]
    cmd += ["--host", cfg.host, "--port", str(port), "--tp-size", str(cfg.tp_size), "--dtype", cfg.dtype]
    cmd += ["--weight-version", cfg.weight_version, "--log-level", cfg.log_level]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.context_length is not None:
        cmd += ["--context-length", str(cfg.context_length)]
    if cfg.random_seed is not None:
        cmd += ["--random-seed", str(cfg.random_seed)]
    if token := process_token():  # SGLang asks every route but /health for the engine's own key
        cmd += ["--api-key", engine_key(token, advertised_url(cfg, port))]
    return [*cmd, *cfg.extra_args]


def advertised_url(cfg: SGLangServerConfig, port: int) -> str:
    """The URL the server at `port` is known by (clients derive its key from it)."""
    # reachable from other nodes: advertise this node's address
    return server_url(node_ip() if cfg.host == "0.0.0.0" else cfg.host, port)


def embedded_launch_command(cfg: SGLangServerConfig, port: int | None = None) -> list[str]:
    """`relax engine serve` under the same launcher, from the flags both servers share (model, host,
    port, dtype, context length, seed, weight version; `extra_args` verbatim). Tests use it where SGLang
    cannot run; it also runs the embedded engine on the GPUs a Ray actor holds."""
    port = cfg.port if port is None else port
    extra = ["--dtype", cfg.dtype, "--weight-version", cfg.weight_version]
    if cfg.context_length is not None:
        extra += ["--max-context-len", str(cfg.context_length)]
    if cfg.random_seed is not None:
        extra += ["--seed", str(cfg.random_seed)]
    return embedded_engine_command(cfg.model_path, port, cfg.host, *extra, *cfg.extra_args)


LaunchCommand = Callable[[SGLangServerConfig, int], list[str]]  # module-level, so Ray can ship it


class SGLangServer:
    """One SGLang server process: `start()` launches it and returns its URL once healthy."""

    def __init__(
        self,
        cfg: SGLangServerConfig,
        launch_command: LaunchCommand = build_launch_command,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the run's token, which the server will require (None: this process's)."""
        if api_key:  # inside the Ray actor that hosts the server: the token arrives as an argument
            set_process_token(api_key)
        self.cfg = cfg
        self.launch_command = launch_command  # tests pass one that runs `relax engine serve`
        self.process: ServerProcess | None = None

    @property
    def url(self) -> str | None:
        return self.process.url if self.process is not None else None

    def start(self) -> str:
        port = self.cfg.port or free_port(self.cfg.host if self.cfg.host != "0.0.0.0" else "127.0.0.1")
        url = advertised_url(self.cfg, port)
        # the engine's own key, never the run's token: `relax engine serve` reads it here (SGLang from
        # --api-key)
        token = process_token()
        env = {API_KEY_ENV: engine_key(token, url)} if token else None
        self.process = ServerProcess(self.launch_command(self.cfg, port), url, env=env)
        self.process.start(timeout_s=self.cfg.startup_timeout_s)
        return self.process.url

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def stop(self) -> int | None:
        return self.process.stop() if self.process is not None else None


def launch_ray_native(
    configs: list[SGLangServerConfig],
    launch_command: LaunchCommand = build_launch_command,
    num_gpus: float | None = None,
) -> tuple[list[Any], list[str]]:
    """Start one Ray actor per config, each holding `tp_size` GPUs (or `num_gpus`) and running one
    server; returns (actor handles, URLs) once every server is healthy. Kill the actors (or call
    `stop` on them) to end the servers."""
    import ray

    actor_cls = ray.remote(SGLangServer)
    actors = [
        actor_cls.options(num_gpus=cfg.tp_size if num_gpus is None else num_gpus, num_cpus=1).remote(
            cfg, launch_command, process_token()
        )
        for cfg in configs
    ]
    try:
        urls = ray.get([a.start.remote() for a in actors])
    except Exception:
        for a in actors:
            ray.kill(a)
        raise
    logger.info("ray_native: %d SGLang servers up: %s", len(urls), urls)
    return actors, urls


async def attach_external(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Check that the server at `url` answers `/health` and return its `/get_model_info`; raises
    `EngineUnavailableError` naming the URL when it does not answer."""
    async with EngineClient(url, timeout_s=timeout_s) as client:
        await client.health(timeout_s=timeout_s)
        info = await client.model_info()
    logger.info("external engine %s serves %s", url, info.get("model_path"))
    return info


def server_config(cfg: RelaxConfig) -> SGLangServerConfig:
    """One engine's server config from the run's config: its model, dtype and seed; `tp_size` from
    `resources.engine_gpus` (a whole number of GPUs per engine; a fraction shares one GPU)."""
    gpus = cfg.resources.engine_gpus or 0.0
    return SGLangServerConfig(
        model_path=str(cfg.model.path),
        dtype=cfg.model.dtype,
        random_seed=cfg.run.seed,
        tp_size=max(1, int(gpus)),
    )


class SGLangActor:
    """Hosts one SGLang server in a Ray actor (the same face as `EngineActor`: `url()`, `stop()`), so
    the fleet's supervisor pings and replaces it like an embedded engine."""

    def __init__(
        self, cfg: SGLangServerConfig, launch_command: LaunchCommand, bind: str, api_key: str | None
    ) -> None:
        # the node's own address, decided on the node the actor landed on
        cfg = cfg.model_copy(update={"host": bind_address(bind)})
        self.server = SGLangServer(cfg, launch_command, api_key)
        self._url = self.server.start()

    def url(self) -> str:
        return self._url

    def stop(self) -> None:
        self.server.stop()


class SGLangGroup(EngineGroup):
    """`n` SGLang servers, each in an `SGLangActor` with `num_gpus` GPUs (in the run's colocate GPU
    group when there is one, else at `placement`); `launch(i)` starts a replacement in slot `i`."""

    def __init__(
        self,
        server: SGLangServerConfig,
        n: int,
        launch_command: LaunchCommand = build_launch_command,
        num_gpus: float = 0.0,
        gpu_group: str | None = None,
        bind: str = "auto",
        placement: dict[str, Any] | None = None,
    ) -> None:
        self.server, self.launch_command = server, launch_command
        super().__init__(
            server.model_path, n, {}, num_gpus=num_gpus, gpu_group=gpu_group, bind=bind, placement=placement
        )

    def launch(self, i: int) -> Any:
        import ray

        bundle = bundle_options(self.gpu_group if self.num_gpus else None, i)
        options = bundle or self.placement
        actor_cls = ray.remote(SGLangActor)
        return actor_cls.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, **options).remote(
            self.server, self.launch_command, self.bind, process_token()
        )


def start_sglang_engines(
    cfg: RelaxConfig, launch_command: LaunchCommand = build_launch_command
) -> SGLangGroup:
    """The run's SGLang engines (`rollout.engine = sglang`), started in its Ray cluster."""
    r = cfg.resources
    return SGLangGroup(
        server_config(cfg),
        cfg.rollout.num_engines,
        launch_command,
        num_gpus=r.engine_gpus or 0.0,
        gpu_group=r.gpu_group,
        bind=r.bind,
        placement=ray_placement(cfg, "engines"),
    )

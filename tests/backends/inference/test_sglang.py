"""The SGLang backend up to the process launch: the command line built from the config, its registry
entry (`rollout.engine = sglang`), and the launcher, the Ray actor, the run's engine group and the
external attach run for real with `relax engine serve` standing in for `sglang.launch_server` (SGLang
cannot run on CPU hosts).
"""

from __future__ import annotations

import asyncio
import sys

import pytest
from pydantic import ValidationError

from relax.backends.inference.registry import ENGINES, engine_backend
from relax.backends.inference.sglang import (
    SGLangServer,
    SGLangServerConfig,
    attach_external,
    build_launch_command,
    embedded_launch_command,
    launch_ray_native,
    server_config,
    start_sglang_engines,
)
from relax.config import load_config
from relax.engine_api.client import EngineClient, EngineUnavailableError
from relax.utils.net import free_port


def fake_config(model_dir, **kw) -> SGLangServerConfig:
    """A config that `embedded_launch_command` turns into `relax engine serve` in place of SGLang."""
    return SGLangServerConfig(model_path=str(model_dir), dtype="float32", extra_args=["--threads", "1"], **kw)


def test_launch_command_from_config():
    cfg = SGLangServerConfig(
        model_path="/models/qwen",
        port=31000,
        tp_size=2,
        dtype="bfloat16",
        mem_fraction_static=0.8,
        context_length=4096,
        weight_version="7",
        random_seed=1,
        extra_args=["--enable-metrics"],
        python="/venv/bin/python",
    )
    cmd = build_launch_command(cfg)
    assert cmd[:5] == ["/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/qwen"]
    flags = dict(zip(cmd[3:-1:2], cmd[4::2], strict=True))
    assert flags == {
        "--model-path": "/models/qwen",
        "--host": "127.0.0.1",
        "--port": "31000",
        "--tp-size": "2",
        "--dtype": "bfloat16",
        "--weight-version": "7",
        "--log-level": "warning",
        "--mem-fraction-static": "0.8",
        "--context-length": "4096",
        "--random-seed": "1",
    }
    assert cmd[-1] == "--enable-metrics"
    assert "--mem-fraction-static" not in build_launch_command(SGLangServerConfig(model_path="m"), port=1)
    with pytest.raises(ValidationError, match="tp_sizes"):
        SGLangServerConfig(model_path="m", tp_sizes=2)
    with pytest.raises(ValidationError):
        SGLangServerConfig(model_path="m", mem_fraction_static=1.5)


def test_launch_attach_and_update_weights(tiny_model_dir, tmp_path):
    server = SGLangServer(fake_config(tiny_model_dir, weight_version="3"), embedded_launch_command)
    url = server.start()
    try:
        assert server.alive() and url.startswith("http://127.0.0.1:")

        async def main() -> None:
            info = await attach_external(url)
            assert info["weight_version"] == "3" and info["model_path"] == str(tiny_model_dir)
            async with EngineClient(url) as client:  # the client every backend shares
                await client.update_weights_from_disk(str(tiny_model_dir), weight_version="4")
                out = await client.generate([1, 2, 3], {"max_new_tokens": 2, "ignore_eos": True})
            assert out.weight_version == "4" and len(out.output_ids) == 2

        asyncio.run(main())
    finally:
        assert server.stop() == 0
    assert not server.alive()


def test_failed_launch_reports_the_log():
    def crashing(cfg: SGLangServerConfig, port: int) -> list[str]:
        return [sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)"]

    server = SGLangServer(SGLangServerConfig(model_path="m"), crashing)
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*CUDA out of memory"):
        server.start()


def test_attach_to_nothing_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineUnavailableError, match=url):
        asyncio.run(attach_external(url, timeout_s=2))


@pytest.mark.timeout(300)
def test_ray_native_launch_in_an_actor(ray_cluster, tiny_model_dir):
    import ray

    actors, urls = launch_ray_native([fake_config(tiny_model_dir)], embedded_launch_command, num_gpus=0)
    try:
        info = asyncio.run(attach_external(urls[0]))
        assert info["weight_version"] == "0"
    finally:
        assert ray.get(actors[0].stop.remote()) == 0
        ray.kill(actors[0])


def _run_config(model_path, *overrides: str):
    return load_config(
        "tests/toy_arith.yaml", [f"model.path={model_path}", "rollout.engine=sglang", *overrides]
    )


def test_the_registry_entry_launches_sglang_from_the_run_config():
    """What `rollout.engine = sglang` starts: one server per engine, on the run's model, dtype and seed,
    with as many tensor-parallel GPUs as each engine holds; it takes weights per tensor or from disk."""
    cfg = _run_config("/models/qwen", "model.dtype=bfloat16", "run.seed=7", "resources.engine_gpus=2")
    cmd = build_launch_command(server_config(cfg), port=31000)
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert {k: flags[k] for k in ("--model-path", "--port", "--tp-size", "--dtype", "--random-seed")} == {
        "--model-path": "/models/qwen",
        "--port": "31000",
        "--tp-size": "2",
        "--dtype": "bfloat16",
        "--random-seed": "7",
    }
    backend = engine_backend("sglang")
    assert backend.in_cluster and backend.package == "sglang"
    assert [f for f in ("flat", "per_tensor", "cuda_ipc", "disk") if backend.accepts(f)] == [
        "per_tensor",
        "disk",
    ]
    assert server_config(_run_config("m", "resources.engine_gpus=0.5")).tp_size == 1  # a shared GPU


@pytest.mark.timeout(300)
def test_the_run_starts_sglang_engines_through_the_fleet(ray_cluster, tiny_model_dir, monkeypatch):
    """The fleet starts `rollout.engine = sglang` through its registry entry; here the entry's launch runs
    `relax engine serve` in SGLang's place, and no package check (SGLang is not installed)."""
    import dataclasses

    import ray

    from relax.fleet.fleet import EngineFleet

    standin = dataclasses.replace(
        ENGINES["sglang"], start=lambda cfg: start_sglang_engines(cfg, embedded_launch_command), package=None
    )
    monkeypatch.setitem(ENGINES, "sglang", standin)
    cfg = _run_config(tiny_model_dir, "resources.engine_gpus=0")

    async def main() -> None:
        fleet = EngineFleet(cfg)
        actor = fleet.group.actors[0]
        try:
            assert fleet.supervisor is not None  # replaced like an embedded engine when it fails
            (url,) = fleet.urls()
            assert (await attach_external(url))["model_path"] == str(tiny_model_dir)
            out = await fleet.router.generate([1, 2, 3], {"max_new_tokens": 2, "ignore_eos": True})
            assert len(out.output_ids) == 2
        finally:
            await fleet.close()
        with pytest.raises(ray.exceptions.RayActorError):  # closing the fleet ended the server's actor
            ray.get(actor.url.remote(), timeout=60)

    asyncio.run(main())

"""The Actor publishes through the weight sender its config names: over a broadcast group (gloo) or, with
`trainer.weight_sync_backend: disk`, as files the engine loads; either way a real engine server then
generates with the trainer's weights and reports the version."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.backends.inference.embedded.http.server import EngineServer
from relax.config import load_config
from relax.engine_api.client import EngineClient
from relax.roles.actor import ActorRole
from tests.engine_helpers import greedy_reference

PROMPT = [5, 6, 7, 8]


@pytest.fixture
def engine(tiny_model_dir):
    server = EngineServer(str(tiny_model_dir), port=0, seed=0, dtype="float32")
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("backend", ["gloo", "disk"])
def test_actor_publishes_through_the_configured_sender(backend, engine, tiny_model_dir, arith_file, tmp_path):
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            f"trainer.weight_sync_backend={backend}",
            "trainer.device=cpu",
        ],
    )
    actor = ActorRole(cfg)
    torch.manual_seed(3)
    for p in actor.trainer.model.parameters():  # weights the engine does not have yet
        p.data.add_(torch.randn_like(p) * 0.2)
    expected = greedy_reference(actor.trainer.model.eval(), PROMPT, 8)

    async def go():
        greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        client = EngineClient(engine.url, timeout_s=60)
        assert (await client.generate(PROMPT, greedy)).output_ids != expected  # the check below can fail
        await actor.connect_engines([engine.url])
        actor.trainer.step = 4
        version = await actor.push_weights()
        try:
            return version, await client.model_info(), await client.generate(PROMPT, greedy)
        finally:
            await client.close()
            await actor.sender.close()

    version, info, out = asyncio.run(go())
    assert version == 4 and info["weight_version"] == "4"
    assert actor.sync_stats["perf/weight_sync_bytes"] > 0
    if backend == "disk":
        assert (tmp_path / "relax-run" / "weights" / "v000004" / "model.safetensors").is_file()
    assert out.output_ids == expected

"""Weight sync: the standalone gloo group, bucketing, and pushing new weights into a real engine server
over the group (the trainer side runs here) and from disk."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.backends.inference.embedded.http.server import EngineServer
from relax.engine_api.client import EngineClient, EngineRequestError
from relax.weights.disk import DiskPublisher, save_weights
from relax.weights.publisher import WeightPublisher
from relax.weights.sender import send_weights, stream_buckets
from relax.weights.sync_group import create_group, without_tied
from tests.engine_helpers import free_port, greedy_reference, perturbed_model, run, trainer_logprobs

PROMPT = [5, 6, 7, 8]


def test_buckets_keep_order_and_bounds():
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 1])]
    buckets = list(stream_buckets(named, bucket_bytes=80))  # 20 floats
    assert [[n for n, _ in b] for b, _ in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [last for _, last in buckets] == [False, False, True]


def test_group_broadcast_and_receive_without_a_default_group():
    port = free_port()
    sent = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1, 2], dtype=torch.bfloat16),
    }
    got: dict = {}

    def receiver():
        g = create_group("127.0.0.1", port, rank=1, world_size=2, timeout_s=30)
        got.update(g.receive([("a", "float32", [2, 3]), ("b", "bfloat16", [2])]))
        g.destroy()

    t = threading.Thread(target=receiver)
    t.start()
    g = create_group("127.0.0.1", port, rank=0, world_size=2, timeout_s=30)
    g.broadcast(sent.values())
    t.join(timeout=30)
    g.destroy()
    assert not torch.distributed.is_initialized()
    assert torch.equal(got["a"], sent["a"]) and torch.equal(got["b"], sent["b"])


@pytest.fixture(scope="module")
def bare_server(bare_model_dir):
    server = EngineServer(str(bare_model_dir), port=0, seed=0, dtype="float32")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def new_model(bare_model_dir):
    """Different weights of the same architecture (what the trainer would push)."""
    return perturbed_model(bare_model_dir, seed=7)


def test_push_weights_over_the_group_changes_outputs_and_version(bare_server, new_model):
    client = EngineClient(bare_server.url, timeout_s=60)
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    before = run(client.generate(PROMPT, greedy))
    assert before.weight_version == "0"

    async def sync():
        # one broadcast per tensor (SGLang's protocol), as to an engine that takes no flat buckets
        publisher = WeightPublisher(64 << 10, backend="gloo", flatten=False, ipc=False)
        await publisher.connect([bare_server.url])
        try:
            # the tied LM head is not sent: the engine's head is its embedding, updated with it
            named = without_tied(new_model.state_dict().items())
            assert "lm_head.weight" not in dict(named) and "model.embed_tokens.weight" in dict(named)
            assert len(named) == len(new_model.state_dict()) - 1
            await send_weights(publisher, named, version=3)
            # an unknown name is refused after the bucket was received, and the group stays usable
            with pytest.raises(EngineRequestError, match="unknown weight"):
                await send_weights(publisher, [("no.such.weight", torch.zeros(2))], version=4)
            await send_weights(publisher, named[:1], version=5)
        finally:
            await publisher.close()
        return await client.generate(PROMPT, greedy), await client.model_info()

    after, info = run(sync())
    assert after.weight_version == "5" and info["weight_version"] == "5"
    assert after.output_ids == greedy_reference(new_model, PROMPT, 8) != before.output_ids
    sampled = run(client.generate(PROMPT, {"max_new_tokens": 8, "ignore_eos": True}))
    ref = trainer_logprobs(new_model, PROMPT, sampled.output_ids)
    assert torch.allclose(torch.tensor(sampled.output_log_probs), ref, atol=1e-4)


def test_update_weights_from_disk(bare_server, bare_model_dir, new_model, tmp_path):
    client = EngineClient(bare_server.url, timeout_s=60)
    original = AutoModelForCausalLM.from_pretrained(bare_model_dir, dtype=torch.float32).eval()
    path = save_weights(original.state_dict().items(), tmp_path / "v10")
    run(client.update_weights_from_disk(str(path), weight_version="10"))
    out = run(client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}))
    assert out.weight_version == "10"
    assert out.output_ids == greedy_reference(original, PROMPT, 8)
    with pytest.raises(EngineRequestError, match="no \\*.safetensors"):
        run(client.update_weights_from_disk(str(tmp_path / "missing"), weight_version="11"))


def test_disk_sender_loads_each_version_and_keeps_the_two_newest(bare_server, new_model, tmp_path):
    """`trainer.weight_sync_backend: disk`: each push is a version folder the engine loads."""
    client = EngineClient(bare_server.url, timeout_s=60)
    publisher = DiskPublisher(tmp_path / "weights")

    async def sync():
        await publisher.connect([bare_server.url])
        try:
            for version in (31, 32, 33):
                await send_weights(publisher, without_tied(new_model.state_dict().items()), version)
        finally:
            await publisher.close()
        return await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})

    out = run(sync())
    assert out.weight_version == "33"
    assert out.output_ids == greedy_reference(new_model, PROMPT, 8)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000032", "v000033"]
    assert not list((tmp_path / "weights").rglob("*.tmp"))


def test_update_without_a_group_is_a_clear_error(bare_server):
    client = EngineClient(bare_server.url, timeout_s=60)
    with pytest.raises(EngineRequestError, match="init_weights_update_group"):
        run(client.update_weights_from_distributed(["x"], ["float32"], [[1]], group_name="nope"))


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (trainer on cuda:0, engine on cuda:1)"
)
def test_push_weights_over_nccl(bare_model_dir, new_model):
    server = EngineServer(str(bare_model_dir), port=0, device="cuda:1", dtype="float32")
    server.start()
    try:
        client = EngineClient(server.url, timeout_s=120)

        async def sync():
            publisher = WeightPublisher(64 << 10, backend="nccl", flatten=False, ipc=False)
            await publisher.connect([server.url])
            try:
                named = [(n, t.to("cuda:0")) for n, t in new_model.state_dict().items()]
                await send_weights(publisher, named, version=7)
            finally:
                await publisher.close()
            return await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})

        out = run(sync())
        assert out.weight_version == "7"
        assert out.output_ids == greedy_reference(new_model, PROMPT, 8)
    finally:
        server.stop()


def test_an_update_during_an_in_place_pause_keeps_requests_and_reports_both_versions(
    bare_server, bare_model_dir, new_model, tmp_path
):
    """The in-flight update of `rollout.partial_rollout_mode=in_place`: the request keeps running across
    the update and reports which tokens came from which weights."""
    client = EngineClient(bare_server.url, timeout_s=60)
    original = AutoModelForCausalLM.from_pretrained(bare_model_dir, dtype=torch.float32).eval()
    run(
        client.update_weights_from_disk(
            str(save_weights(original.state_dict().items(), tmp_path / "a")), "20"
        )
    )
    new_path = save_weights(new_model.state_dict().items(), tmp_path / "b")
    greedy = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}

    async def go():
        await client.slow_down(0.01)
        try:
            task = asyncio.create_task(client.generate(PROMPT, greedy))
            for _ in range(500):  # until it has some tokens
                await asyncio.sleep(0.01)
                if _tokens(await client.metrics_text()) > 5:
                    break
            await client.pause("in_place")
            await client.update_weights_from_disk(str(new_path), weight_version="21")
            await client.resume()
            return await task
        finally:
            await client.slow_down(None)

    out = run(go())
    assert out.finish_reason == "length" and len(out.output_ids) == 60
    assert out.weight_version == "21" and out.weight_versions == ["20", "21"]
    start = out.weight_version_starts[1]
    assert out.weight_version_starts[0] == 0 and 0 < start < 60
    assert out.output_ids[:start] == greedy_reference(original, PROMPT, start)  # before: the old weights
    plain = run(client.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True}))
    assert plain.weight_versions == [] and plain.weight_version == "21"


def _tokens(metrics_text: str) -> float:
    import re

    return float(re.search(r"^sglang:generation_tokens_total\{[^}]*\} (\S+)$", metrics_text, re.M).group(1))

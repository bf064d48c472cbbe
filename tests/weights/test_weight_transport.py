"""Weight-sync transports: flat buckets (one broadcast per bucket) and CUDA IPC for receivers on the
trainer's GPU, through `WeightPublisher` into a real engine server and a real ActorFwd-style receiver."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.backends.inference.embedded.http.server import EngineServer
from relax.engine_api.client import EngineClient, EngineRequestError
from relax.weights import ipc as weight_ipc
from relax.weights.publisher import WeightPublisher, assign
from relax.weights.receiver import ModelWeightReceiver, ReceiverServer
from relax.weights.sender import send_weights, stream_buckets
from tests.engine_helpers import engine_process, greedy_reference, perturbed_model, run

PROMPT = [5, 6, 7, 8]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")


def test_pack_aligns_every_tensor_and_unpacks_to_equal_views():
    bucket = [
        ("a", torch.arange(3, dtype=torch.bfloat16)),
        ("b", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("c", torch.tensor([7], dtype=torch.int64)),
    ]
    offsets, total = weight_ipc.layout([(n, t.dtype, t.shape) for n, t in bucket])
    assert offsets == [0, 256, 512] and total == 520
    buf = weight_ipc.pack(bucket, torch.device("cpu"))
    views = weight_ipc.unpack(buf, [(n, t.dtype, list(t.shape)) for n, t in bucket])
    for name, t in bucket:
        assert views[name].dtype == t.dtype and torch.equal(views[name], t)
    with pytest.raises(ValueError, match="need 520"):
        weight_ipc.unpack(buf[:100], [(n, t.dtype, list(t.shape)) for n, t in bucket])


def test_receivers_on_a_ranks_gpu_go_to_that_rank_the_rest_to_the_group():
    group, ipc = assign(["g0", None, "g1", "g9", "g0"], ["g0", "g1"])
    assert group == [1, 3] and ipc == [[0, 4], [2]]
    assert assign(["x", None], [None]) == ([0, 1], [[]])  # CPU trainer: everything through the group


@pytest.mark.parametrize(("device", "backend"), [("cpu", "gloo"), ("cuda", "nccl"), (None, "nccl")])
def test_auto_backend_follows_where_the_weights_are(monkeypatch, device, backend):
    """On a GPU host, `auto` takes NCCL only for weights on a GPU: a trainer pinned to the CPU sends its
    host tensors through gloo (NCCL cannot), and offers no GPU for CUDA IPC."""
    from relax.weights import publisher as weight_publisher

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(weight_publisher, "local_uuid", lambda: "gpu-0")
    seen = {}

    async def uuid_of(client):
        return "gpu-1"  # a receiver on another GPU: it joins the group, whatever the rank's device

    async def init(clients, host, port, backend, group_name):
        seen["backend"] = backend
        return type("Group", (), {"backend": backend})()

    monkeypatch.setattr(weight_publisher, "_uuid_of", uuid_of)
    monkeypatch.setattr(weight_publisher.weight_sync, "init_weight_sync", init)
    pub = WeightPublisher(device=None if device is None else torch.device(device))
    run(pub.connect(["http://127.0.0.1:1"]))
    assert seen["backend"] == backend and len(pub.clients) == 1 and not pub.ipc_clients
    pub.group = None  # nothing to destroy
    run(pub.close())


def test_the_version_rides_on_the_last_bucket_only():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5])]
    out = [([n for n, _ in b], last) for b, last in stream_buckets(named, bucket_bytes=80)]
    assert out == [(["t0", "t1"], False), (["t2"], False), (["t3"], True)]


@pytest.fixture(scope="module")
def new_model(bare_model_dir):
    return perturbed_model(bare_model_dir, seed=11)


def _publish(urls: list[str], named, version: int, **kw) -> None:
    async def go():
        pub = WeightPublisher(bucket_bytes=48 << 10, group_name="t_flat", **kw)
        await pub.connect(urls)
        try:
            await send_weights(pub, named, version)
        finally:
            await pub.close()

    run(go())


def test_flat_buckets_reach_an_engine_and_a_receiver(bare_model_dir, new_model):
    server = EngineServer(str(bare_model_dir), port=0, seed=0, dtype="float32", device="cpu")
    server.start()
    target = AutoModelForCausalLM.from_pretrained(bare_model_dir, dtype=torch.float32).eval()
    receiver = ReceiverServer(ModelWeightReceiver(target))
    try:
        client = EngineClient(server.url, timeout_s=60)
        assert run(client.model_info())["device_uuid"] is None  # CPU: no IPC
        named = list(new_model.state_dict().items())
        _publish(
            [server.url, receiver.start()], named, version=4, backend="gloo", flatten=True, force_flat=True
        )
        out = run(client.generate(PROMPT, GREEDY))
        assert out.weight_version == "4"
        assert out.output_ids == greedy_reference(new_model, PROMPT, 8)
        assert receiver.receiver.version == "4"
        for name, t in new_model.state_dict().items():
            assert torch.equal(target.state_dict()[name], t), name
        # an engine that is not on a GPU refuses a CUDA IPC handle with a message
        with pytest.raises(EngineRequestError, match="GPU"):
            run(client.update_weights_from_ipc(["x"], ["float32"], [[1]], {"uuid": "GPU-0"}))
    finally:
        receiver.stop()
        server.stop()


@needs_gpu
def test_cuda_ipc_into_an_engine_process_on_the_same_gpu(bare_model_dir, new_model):
    proc, url = engine_process(bare_model_dir, "--device", "cuda:0")
    try:
        torch.cuda.set_device(0)
        named = [(n, t.to("cuda:0")) for n, t in new_model.state_dict().items()]
        for version in (5, 6):  # the second push maps the sender's recycled blocks again
            _publish([url], named, version=version)
        out = run(EngineClient(url, timeout_s=60).generate(PROMPT, GREEDY))
        assert out.weight_version == "6"
        assert out.output_ids == greedy_reference(new_model, PROMPT, 8)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@needs_gpu
def test_cuda_ipc_into_an_engine_and_a_receiver_on_the_same_gpu(bare_model_dir, new_model):
    server = EngineServer(str(bare_model_dir), port=0, device="cuda:0", dtype="float32")
    server.start()
    target = AutoModelForCausalLM.from_pretrained(bare_model_dir, dtype=torch.float32).to("cuda:0").eval()
    receiver = ReceiverServer(ModelWeightReceiver(target))
    try:
        torch.cuda.set_device(0)
        client = EngineClient(server.url, timeout_s=60)
        assert run(client.model_info())["device_uuid"] == weight_ipc.device_uuid("cuda:0")
        named = [(n, t.to("cuda:0")) for n, t in new_model.state_dict().items()]
        for version in (5, 6):  # a second push reuses the mapped handles
            _publish([server.url, receiver.start() if version == 5 else receiver.url], named, version=version)
        out = run(client.generate(PROMPT, GREEDY))
        assert out.weight_version == "6"
        assert out.output_ids == greedy_reference(new_model, PROMPT, 8)
        assert receiver.receiver.version == "6"
        for name, t in new_model.state_dict().items():
            assert torch.equal(target.state_dict()[name].cpu(), t), name
    finally:
        receiver.stop()
        server.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (trainer cuda:0, engine cuda:1)")
def test_flat_buckets_over_nccl(bare_model_dir, new_model):
    server = EngineServer(str(bare_model_dir), port=0, device="cuda:1", dtype="float32")
    server.start()
    try:
        torch.cuda.set_device(0)
        named = [(n, t.to("cuda:0")) for n, t in new_model.state_dict().items()]
        _publish([server.url], named, version=9, backend="nccl")
        out = run(EngineClient(server.url, timeout_s=60).generate(PROMPT, GREEDY))
        assert out.weight_version == "9"
        assert out.output_ids == greedy_reference(new_model, PROMPT, 8)
    finally:
        server.stop()

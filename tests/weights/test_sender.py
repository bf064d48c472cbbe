"""One place builds every trainer's weight sender (`relax.weights.sender`): the transports come from
`trainer.weight_sync_backend` through `TRANSPORTS`, and a rank of the FSDP group builds its sender from
the same settings, so its rendezvous listens where `resources.bind` says (not on the node's IP)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.backends.training.fsdp import FSDPWorker
from relax.config import TrainerConfig
from relax.weights import publisher as weight_publisher
from relax.weights.disk import DiskPublisher
from relax.weights.publisher import WeightPublisher
from relax.weights.sender import TRANSPORTS, SenderSettings, build_sender, send_weights


def test_each_backend_value_names_a_transport_and_a_bad_one_lists_them():
    for backend in TRANSPORTS:
        sender = build_sender(SenderSettings(backend=backend), torch.device("cpu"))
        assert isinstance(sender, DiskPublisher if backend == "disk" else WeightPublisher)
    with pytest.raises(ValueError, match=r"weight_sync_backend 'carrier-pigeon'.*'disk'"):
        build_sender(SenderSettings(backend="carrier-pigeon"))


def test_settings_come_from_the_trainer_section_and_resources_bind():
    t = TrainerConfig(weight_sync_backend="gloo", publish_bucket_mb=3, weight_sync_ipc=False)
    s = SenderSettings.from_config(t, "node", disk_root="/runs/x/weights")
    assert (s.backend, s.bucket_bytes, s.flatten, s.ipc, s.bind) == ("gloo", 3 << 20, True, False, "node")


@pytest.mark.parametrize(("bind", "host"), [("loopback", "127.0.0.1"), ("node", "10.1.2.3")])
def test_a_ranks_rendezvous_listens_on_resources_bind(monkeypatch, bind, host):
    """Rank 0 of the FSDP group forms the group on `resources.bind`'s address: loopback stays loopback
    even where the node's IP (the old fallback) is another address."""
    from relax.utils import net

    monkeypatch.setattr(net, "node_ip", lambda: "10.1.2.3")  # what `bind: node` resolves to
    monkeypatch.setattr(weight_publisher, "node_ip", lambda: "10.9.9.9")  # the sender's fallback
    monkeypatch.setattr(weight_publisher, "free_port", lambda address: 29500)  # not this host's
    seen = {}

    async def init(clients, address, port, backend, group_name):
        seen["address"] = address
        return type("Group", (), {"backend": backend, "name": group_name, "destroy": lambda self: None})()

    monkeypatch.setattr(weight_publisher.weight_sync, "init_weight_sync", init)
    worker = FSDPWorker.__new__(FSDPWorker)  # the weight-sending parts only: no model, no process group
    worker.cfg = TrainerConfig(weight_sync_backend="gloo", device="cpu")
    worker.rank, worker.device = 0, torch.device("cpu")
    worker.connect_engines(["http://127.0.0.1:1"], rank_uuids=[None], bind=bind)
    try:
        assert seen["address"] == host
    finally:
        worker._sender.sender.group = None  # nothing to destroy
        worker._sender.close()


def test_send_weights_before_connect_names_the_fix():
    sender = WeightPublisher(ipc=False)
    with pytest.raises(RuntimeError, match="before connect"):
        asyncio.run(send_weights(sender, [("w", torch.zeros(1))], 1))


def test_the_disk_sender_writes_every_bucket_of_a_push_once_at_its_last(tmp_path):
    from safetensors.torch import load_file

    loads = []

    class Engine:  # records what it was asked to load
        async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
            loads.append((path, weight_version))

    sender = DiskPublisher(tmp_path, bucket_bytes=8)  # two 4-byte tensors a bucket
    sender.clients = [Engine()]
    named = [(f"w{i}", torch.full((1,), float(i))) for i in range(5)]
    stats = asyncio.run(send_weights(sender, named, 3))
    assert loads == [(str(tmp_path / "v000003"), "3")]  # one load, after the last of three buckets
    saved = load_file(str(tmp_path / "v000003" / "model.safetensors"))
    assert {n: float(t) for n, t in saved.items()} == {f"w{i}": float(i) for i in range(5)}
    assert stats["perf/weight_sync_bytes"] == 20

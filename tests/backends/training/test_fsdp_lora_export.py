"""LoRA on 2 FSDP ranks: only adapters train, weight sync sends adapter (or adapted-module) bytes and the
engine then matches the trainer; `relax export` writes folders that `from_pretrained` loads."""

from __future__ import annotations

import pytest
import torch
import yaml
from test_fsdp_group import assert_engine_matches, fsdp_cfg, train_step
from test_torch_backend import make_batch
from transformers import AutoModelForCausalLM

from relax.backends.inference.embedded.http.server import EngineServer
from relax.backends.training.export import export_checkpoint
from relax.backends.training.rank_group import TrainerGroup
from relax.backends.training.torch_backend import TorchTrainer
from relax.config import LoraConfig, TrainerConfig, load_config

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])


@pytest.fixture(scope="module")
def lora_group(tiny_model_dir, ray_cluster):
    group = TrainerGroup(str(tiny_model_dir), fsdp_cfg(num_ranks=2, lora=LORA), with_reference=True)
    yield group
    group.shutdown()


def _bytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def test_lora_trains_adapters_only_and_syncs_only_their_bytes(tiny_model_dir, lora_group):
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())
    batch = make_batch()
    ref_before = lora_group.compute_log_probs(batch, reference=True)
    for _ in range(2):  # LoRA B starts at zero: the first step moves B, the second also A's effect
        train_step(lora_group, make_batch())
    merged = dict(lora_group.named_weights("merged"))
    adapters = dict(lora_group.named_weights("adapter"))
    full = dict(lora_group.named_weights("full"))
    assert merged and all(n.split(".")[-2] in LORA.target_modules for n in merged)
    assert all("lora_A" in n or "lora_B" in n for n in adapters)
    for name, w in full.items():
        if name in merged:
            assert not torch.equal(w, base[name]), name  # adapted modules moved
        else:
            torch.testing.assert_close(w, base[name], atol=0, rtol=0)  # frozen
    # the reference (adapters disabled) is still the base model
    for a, b in zip(lora_group.compute_log_probs(batch, reference=True), ref_before, strict=True):
        torch.testing.assert_close(a, b)

    stats = {mode: lora_group.send_from_ranks(version=2, mode=mode) for mode in ("adapter", "merged", "full")}
    assert stats["adapter"]["perf/weight_sync_bytes"] == _bytes(adapters.items())
    assert stats["merged"]["perf/weight_sync_bytes"] == _bytes(merged.items())
    assert stats["adapter"]["perf/weight_sync_bytes"] < stats["merged"]["perf/weight_sync_bytes"] / 3
    assert stats["merged"]["perf/weight_sync_bytes"] < stats["full"]["perf/weight_sync_bytes"]


def test_merged_lora_sync_reaches_the_engine(tiny_model_dir, lora_group):
    server = EngineServer(str(tiny_model_dir), port=0, seed=0, dtype="float32")
    server.start()
    try:
        lora_group.connect_engines([server.url])
        stats = lora_group.send_from_ranks(version=lora_group.step, mode="merged")
        assert stats["perf/weight_sync_bytes"] > 0
        assert_engine_matches(lora_group, server.url)
    finally:
        server.stop()


def _config_file(tmp_path, model_dir, lora: LoraConfig | None):
    trainer = {"backend": "fsdp", **({"lora": lora.model_dump()} if lora else {})}
    cfg = {"model": {"path": str(model_dir)}, "data": {"train_files": ["unused.jsonl"]}, "trainer": trainer}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def test_export_merged_and_adapter_only(tiny_model_dir, lora_group, tmp_path):
    from peft import PeftModel

    lora_group.save(tmp_path / "ckpt" / "actor")
    want = dict(lora_group.named_weights("full"))
    cfg = _config_file(tmp_path, tiny_model_dir, LORA)
    merged_dir = export_checkpoint(tmp_path / "ckpt", cfg, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    for name, w in merged.state_dict().items():
        torch.testing.assert_close(w, want[name], atol=1e-6, rtol=1e-5)
    adapter_dir = export_checkpoint(tmp_path / "ckpt", cfg, tmp_path / "adapter", adapter_only=True)
    assert (adapter_dir / "adapter_config.json").exists()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter_dir)
    for name, w in peft_model.merge_and_unload().state_dict().items():
        torch.testing.assert_close(w, want[name], atol=1e-6, rtol=1e-5)


def test_export_full_model_checkpoint(tiny_model_dir, tmp_path):
    trainer = TorchTrainer(str(tiny_model_dir), TrainerConfig(lr=1e-2, threads=1))
    train_step(trainer, make_batch())
    trainer.save(tmp_path)  # the same DCP layout as the FSDP backend
    out = export_checkpoint(tmp_path, _config_file(tmp_path, tiny_model_dir, None), tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, w in trainer.model.state_dict().items():  # the trainer is on CUDA on a GPU host
        torch.testing.assert_close(loaded[name], w.cpu())

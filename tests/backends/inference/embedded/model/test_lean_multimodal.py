"""The lean decoder on the text decoders of multimodal models: its rotary table at position p is the
model's own mrope rotary at t = h = w = p, which is 1-D rotary (closed form below); decode steps after a
multimodal prefill give the `transformers` forward's logits; the decode graphs take each row's rope delta
(on the CPU with an eager stand-in for the capture, on a GPU captured)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from relax.backends.inference.embedded.model.cuda_graphs import DecodeGraphs
from relax.backends.inference.embedded.model.lean_decoder import LeanDecoder
from relax.backends.inference.embedded.model.runner import ModelRunner
from relax.data.multimodal import MultimodalProcessor
from relax.models.multimodal_model import load_causal_lm
from relax.models.tiny import write_tiny_model

LEAN_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm-lean")
    return {f: write_tiny_model(root / f, family=f) for f in [*LEAN_FAMILIES, "qwen3_omni"]}


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "img.png"
    Image.fromarray((np.random.default_rng(0).random((56, 56, 3)) * 255).astype(np.uint8)).save(path)
    return str(path)


def test_supported_families(model_dirs):
    for family in LEAN_FAMILIES:
        assert LeanDecoder.supports(load_causal_lm(model_dirs[family])), family
    assert not LeanDecoder.supports(load_causal_lm(model_dirs["qwen3_omni"]))  # a mixture-of-experts MLP


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_rotary_table_is_mrope_at_equal_components(family, model_dirs):
    """cos / sin at position p, from the lean decoder's table and its direct path, equal the model's mrope
    rotary at (p, p, p) and the 1-D rotary cos(p * theta^(-2i/D)), each frequency twice."""
    model = load_causal_lm(model_dirs[family]).eval()
    lean = LeanDecoder(model)
    rotary = model.get_decoder().rotary_emb
    cfg = model.config.get_text_config()
    D = lean.head_dim
    pos_NT = torch.tensor([[0, 1, 7], [300, 1000, 2047]])
    h = torch.zeros(2, 3, cfg.hidden_size)
    cos_table, sin_signed_table = lean._cos_sin(h, pos_NT, 2048)  # [N, T, 1, D]
    assert lean._rope_table is not None and lean._rope_table.shape[0] >= 2048
    lean._rope_static = False  # the direct path: the model's rotary at these positions
    cos_direct, sin_signed_direct = lean._cos_sin(h, pos_NT, 2048)
    with torch.no_grad():
        cos_mrope, sin_mrope = rotary(h, pos_NT.expand(3, 2, 3))  # t = h = w = p
    theta = cfg.rope_parameters["rope_theta"]
    angle = pos_NT[..., None].double() * theta ** (-torch.arange(0, D, 2).double() / D)  # [N, T, D / 2]
    cos_1d = torch.cat([angle.cos(), angle.cos()], dim=-1).float()
    sin_1d = torch.cat([angle.sin(), angle.sin()], dim=-1).float()
    sin_signed_1d = torch.cat([-sin_1d[..., : D // 2], sin_1d[..., D // 2 :]], dim=-1)
    for cos, sin_signed in ((cos_table, sin_signed_table), (cos_direct, sin_signed_direct)):
        torch.testing.assert_close(cos[:, :, 0], cos_mrope, atol=1e-6, rtol=0)
        torch.testing.assert_close(cos[:, :, 0], cos_1d, atol=1e-5, rtol=0)
        torch.testing.assert_close(sin_signed[:, :, 0], sin_signed_1d, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin_mrope, sin_1d, atol=1e-5, rtol=0)
    with torch.no_grad():  # unequal components rotate differently: the sections are real
        cos_apart, _ = rotary(h, torch.stack([pos_NT, pos_NT + 1, pos_NT + 2]))
    assert (cos_apart - cos_mrope).abs().max() > 1e-3


def prompts(path: str, image: str) -> tuple[list[list[int]], list[dict | None]]:
    """An image prompt and a text-only one, as the engine receives them."""
    proc = MultimodalProcessor(path)
    items = [proc.process("look <image> now", {"image": [image]}), proc.process("plain text here", {})]
    return [it.prompt_ids for it in items], [it.multimodal_inputs for it in items]


def decode_steps(runner: ModelRunner, ids: list[list[int]], media: list, n: int) -> list[torch.Tensor]:
    """Multimodal prefill into rows 0..U-1 (8 rows reserved), then n greedy steps at column + delta."""
    runner.cache.reserve(len(ids), 128, 8)
    logits, deltas = runner.prefill_multimodal(ids, list(range(len(ids))), media)
    out = [logits]
    pos_B = torch.tensor([len(p) for p in ids], device=runner.device)
    delta_B = torch.tensor(deltas, device=runner.device)
    for _ in range(n):
        out.append(runner.decode(out[-1].argmax(-1), pos_B, int(pos_B.max()) + 1, delta_B).clone())
        pos_B = pos_B + 1
    return out


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_lean_decode_after_multimodal_prefill_matches_transformers(family, model_dirs, image):
    path = str(model_dirs[family])
    ids, media = prompts(path, image)
    lean = ModelRunner(path, dtype="float32")
    plain = ModelRunner(path, dtype="float32", use_lean=False)
    assert lean.lean is not None and lean.lean.mrope and plain.lean is None
    for a, b in zip(decode_steps(lean, ids, media, 4), decode_steps(plain, ids, media, 4), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class EagerGraph:
    """A captured graph's stand-in on the CPU: replay runs the forward again on the static inputs and
    writes its logits where the first run's are (what a graph's replay does)."""

    def __init__(self, forward, args: tuple) -> None:
        self.forward, self.args = forward, args
        self.logits = forward(*args).clone()

    def replay(self) -> None:
        self.logits.copy_(self.forward(*self.args))


def eager_record(graphs: DecodeGraphs, args: tuple):
    graph = EagerGraph(graphs.forward, args)
    return graph, graph.logits


def test_decode_graphs_take_the_rope_delta(model_dirs, image, monkeypatch):
    """The graphs' static inputs, padding rows and the delta buffer, everything but the capture: steps of
    2 rows through the graph of 8 equal eager steps, and a wider rope margin drops the graphs."""
    monkeypatch.setattr(DecodeGraphs, "_record", eager_record)
    path = str(model_dirs["qwen2_5_vl"])
    ids, media = prompts(path, image)
    graphed = ModelRunner(path, dtype="float32")
    eager = ModelRunner(path, dtype="float32")
    graphed.graphs = DecodeGraphs(graphed._decode_forward, graphed.cache, graphed.device, rope_delta=True)
    got = decode_steps(graphed, ids, media, 4)
    for a, b in zip(got, decode_steps(eager, ids, media, 4), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert list(graphed.graphs.graphs) == [(8, 128)]
    assert graphed.graphs.delta is not None and graphed.graphs.delta[2:8].eq(0).all()  # padding rows
    graphed._widen_rope_margin(10)
    assert graphed.rope_margin == 256
    graphed.decode(got[-1].argmax(-1), torch.tensor([70, 20]), 71, torch.tensor([-2, 0]))
    assert graphed.graphs.generation == graphed.cache.generation and len(graphed.graphs.graphs) == 1


def test_text_model_graphs_take_no_delta(tmp_path, monkeypatch):
    monkeypatch.setattr(DecodeGraphs, "_record", eager_record)
    runner = ModelRunner(str(write_tiny_model(tmp_path / "qwen2", family="qwen2")), dtype="float32")
    graphs = DecodeGraphs(runner._decode_forward, runner.cache, runner.device)
    runner.cache.reserve(1, 16, 8)
    runner.prefill([[1, 2, 3]], [0])
    with torch.inference_mode():  # as `ModelRunner.decode` runs it
        graphs.run(torch.tensor([4]), torch.tensor([3]), 4)
        assert graphs.delta is None
        with pytest.raises(ValueError, match="no rope delta"):
            graphs.run(torch.tensor([4]), torch.tensor([3]), 4, torch.tensor([0]))


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the Triton decode kernels, captured
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vl_graph_decode_matches_eager(family, dtype, model_dirs, image):
    path = str(model_dirs[family])
    ids, media = prompts(path, image)
    graphed = ModelRunner(path, device="cuda", dtype=dtype)
    eager = ModelRunner(path, device="cuda", dtype=dtype, cuda_graphs=False)
    assert graphed.graphs is not None and graphed.graphs.rope_delta and eager.graphs is None
    tol = 1e-4 if dtype == "float32" else 2e-2
    for a, b in zip(decode_steps(graphed, ids, media, 12), decode_steps(eager, ids, media, 12), strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert graphed.graphs.graphs

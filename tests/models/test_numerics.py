"""The engine's and the trainer's products reduce their partial sums in float32 (relax/models/numerics.py):
on a GPU an image's vision-tower output is then the same whichever batch it was encoded in, as the
engine (a request group's images) and the trainer (a micro-batch's) batch differently."""

from __future__ import annotations

import pytest
import torch

from relax.models.numerics import use_float32_reductions

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's reductions need a GPU")
FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


@pytest.fixture
def default_reductions():
    """PyTorch's defaults during the test, whatever the process had, and back afterwards."""
    matmul = torch.backends.cuda.matmul
    before = {f: getattr(matmul, f) for f in FLAGS}
    for f in FLAGS:
        setattr(matmul, f, True)
    yield
    for f, v in before.items():
        setattr(matmul, f, v)


def test_the_setting_turns_off_both_reduced_precision_reductions(default_reductions):
    use_float32_reductions()
    assert not any(getattr(torch.backends.cuda.matmul, f) for f in FLAGS)


@cuda
def test_the_engine_and_the_trainer_set_it_on_a_gpu(default_reductions, tiny_model_dir):
    from relax.backends.inference.embedded.model.runner import ModelRunner
    from relax.backends.training.loading import resolve_device

    ModelRunner(tiny_model_dir, device="cuda", dtype="bfloat16", cuda_graphs=False)
    assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    resolve_device("cuda")
    assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction


@cuda
def test_an_images_vision_output_does_not_depend_on_its_batch(default_reductions):
    """Qwen2.5-VL-3B's vision tower (random weights, bf16): one 448-pixel image alone and first of eight."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from benchmarks.vl_gpu import VISION_3B

    torch.manual_seed(0)
    with torch.device("cuda"):
        tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**VISION_3B))
    tower = tower.to(torch.bfloat16).eval()
    patches = torch.randn(8 * 1024, 1176, device="cuda", dtype=torch.bfloat16)  # 32 x 32 patches an image

    def first_image(n: int) -> torch.Tensor:
        out = tower(patches[: n * 1024], grid_thw=torch.tensor([[1, 32, 32]] * n, device="cuda"))
        out = getattr(out, "pooler_output", out)
        return (out[0] if isinstance(out, tuple) else out)[:256]  # 1,024 patches merge 2 x 2

    with torch.no_grad():
        if torch.equal(first_image(1), first_image(8)):
            pytest.skip("this GPU's default reductions already give one image the same output")
        use_float32_reductions()
        assert torch.equal(first_image(1), first_image(8))

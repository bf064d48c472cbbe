"""How much the engine's and the trainer's bf16 numbers can differ only because they batch differently.

Qwen2.5-VL-3B's shape with random bf16 weights on a GPU: one image's vision-tower output alone against
first of eight, one text row's log-probs alone against first of eight, and a row's log-probs cut to 256
tokens against the whole 512, with PyTorch's default reductions and with split-K partial sums reduced in
float32 (`relax.models.numerics`). docs/measurements.md has an H200's table.

    python benchmarks/vl_batch_invariance.py
"""

from __future__ import annotations

import json

import torch


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("vl_batch_invariance.py measures cuBLAS's reductions: it needs a CUDA GPU")
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from benchmarks.vl_gpu import TEXT_3B, VISION_3B

    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    text = {**TEXT_3B, "rope_parameters": rope, "rms_norm_eps": 1e-6}
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=VISION_3B, tie_word_embeddings=True)
    with torch.device("cuda"):
        model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    visual, lm, head = model.model.visual, model.model.language_model, model.lm_head
    patches = torch.randn(8 * 1024, 1176, device="cuda", dtype=torch.bfloat16)  # 448-pixel images
    ids = torch.randint(0, 150_000, (8, 512), device="cuda")

    def first_image(n: int) -> torch.Tensor:
        out = visual(patches[: n * 1024], grid_thw=torch.tensor([[1, 32, 32]] * n, device="cuda"))
        out = getattr(out, "pooler_output", out)
        return (out[0] if isinstance(out, tuple) else out)[:256].float()

    def logps(rows: torch.Tensor) -> torch.Tensor:
        logits = head(lm(input_ids=rows).last_hidden_state[:1]).float()
        return torch.log_softmax(logits, -1)[:, :-1].gather(-1, rows[:1, 1:, None])[..., 0]

    print(torch.cuda.get_device_name(), torch.__version__)
    matmul = torch.backends.cuda.matmul
    for reduced in (True, False):
        matmul.allow_bf16_reduced_precision_reduction = reduced
        with torch.no_grad():
            one = first_image(1)
            whole = logps(ids[:1])
            row = {
                "bf16_reduced_precision_reduction": reduced,
                "vision_1_vs_8_max": (one - first_image(8)).abs().max().item(),
                "vision_mean_abs": one.abs().mean().item(),
                "text_1_vs_8_rows_max": (whole - logps(ids)).abs().max().item(),
                "text_256_vs_512_tokens_max": (whole[:, :255] - logps(ids[:1, :256])).abs().max().item(),
            }
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()

"""A few GRPO steps and generation with a randomly initialised Qwen2.5-VL-3B-shaped model on images.

Writes the random model (its config shaped like Qwen2.5-VL-3B-Instruct: 36 layers, hidden 2048, 16 heads
/ 2 KV heads, MLP 11008, vocab 151936; a 32-block, 1280-wide vision tower) with the tiny in-process
tokenizer and the processor config, generates synthetic colour images, then per step: processes the
prompts with `MultimodalProcessor`, generates `--n` responses per prompt on the embedded engine (with
the vision encoder in its prefill) and takes an optimizer step on one FSDP2 rank (the trainer Relax runs;
bf16 compute over fp32 master weights, activation checkpointing through the vision tower and the
decoder, the chunked log-prob head, each distinct image encoded once per micro-batch) with the same pixel
values, pi_old taken from the update's forward as an on-policy Actor does (`--separate-forward`: a
forward pass of its own first), and streams the new weights into the engine.

    python benchmarks/vl_gpu.py                       # CUDA, bf16 engine, fp32 master weights
    python benchmarks/vl_gpu.py --tiny --device cpu   # a CPU smoke run on the tiny Qwen2.5-VL
    python benchmarks/vl_gpu.py --gen-only [--no-lean]  # the engine alone (lean + graphs, or transformers)
    python benchmarks/vl_gpu.py --text-only --steps 1  # the same language model on text prompts

The last line printed is one JSON object: step time, generation time and tokens/s (over all steps, and
steady: steps 2.., after the first step's CUDA-graph captures), peak GPU memory, and the engine-trainer
log-prob gap.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

logger = logging.getLogger("relax.benchmarks.vl_gpu")

TEXT_3B = dict(
    hidden_size=2048,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    intermediate_size=11008,
    vocab_size=151936,
    max_position_embeddings=32768,
)
VISION_3B = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=2048,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
)


def write_model(out: Path, tiny: bool) -> Path:
    """A random Qwen2.5-VL folder: 3B-shaped, or the tiny test model."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from relax.models.tiny import write_tiny_model
    from relax.models.tiny_multimodal import image_processor_config, media_token_ids
    from relax.models.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tiny_tokenizer

    if tiny:
        return write_tiny_model(out, family="qwen2_5_vl")
    tok = train_tiny_tokenizer(512)
    ids = media_token_ids(tok)
    pad, eos = tok.convert_tokens_to_ids(PAD_TOKEN), tok.convert_tokens_to_ids(EOS_TOKEN)
    text = {
        **TEXT_3B,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        "bos_token_id": pad,
        "pad_token_id": pad,
        "eos_token_id": eos,
        "rms_norm_eps": 1e-6,
    }
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=VISION_3B,
        tie_word_embeddings=True,
        **{
            k: ids[k]
            for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        },
    )
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = [eos, pad]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps(image_processor_config(cfg) | {"max_pixels": 448 * 448})
    )
    del model
    return out


def _gap_stats(gaps: list[torch.Tensor]) -> dict | None:
    """Mean, 99th percentile and max of the engine-vs-trainer log-prob gaps, and how many tokens."""
    if not gaps:
        return None
    g = torch.cat(gaps).float()
    q = float(torch.quantile(g, 0.99)) if g.numel() <= 16_000_000 else float("nan")
    return {
        "mean": round(float(g.mean()), 5),
        "p99": round(q, 4),
        "max": round(float(g.max()), 4),
        "n": g.numel(),
    }


def _as_text(item: Any, media_ids: set[int], vocab: int, rng: Any) -> SimpleNamespace:
    """`item`'s prompt with each image or vision token replaced by a random text token, and no media:
    a text prompt of the same length for the same language model (`--text-only`)."""
    ids = list(item.prompt_ids)
    for i in range(len(ids)):
        while ids[i] in media_ids:
            ids[i] = int(rng.integers(vocab // 2, vocab))
    return SimpleNamespace(prompt_ids=ids, multimodal_inputs=None)


def _mean(xs: list[float]) -> float | None:
    """The mean to 3 decimals, None for no values (`--gen-only` has no train or sync times)."""
    return round(statistics.fmean(xs), 3) if xs else None


def _profiler() -> torch.profiler.profile:
    """The torch profiler over one step's generation (`--profile-step`): where a decode step's time goes."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen2.5-VL instead of the 3B shape")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="prompts (images) per step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--image-size", type=int, default=448, help="image side in pixels (448 -> 256 tokens)")
    p.add_argument("--micro-tokens", type=int, default=8192, help="trainer tokens per micro-batch")
    p.add_argument("--kv-tokens", type=int, default=65536, help="engine KV-cache capacity in tokens")
    p.add_argument(
        "--no-grad-ckpt", action="store_true", help="keep activations (the 3B shape then needs >139 GB)"
    )
    p.add_argument(
        "--separate-forward",
        action="store_true",
        help="pi_old from a forward pass of its own (as before trainer.pi_old_from_update)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder and vision layers")
    p.add_argument("--gen-only", action="store_true", help="generation only: no trainer, no weight sync")
    p.add_argument(
        "--text-only",
        action="store_true",
        help="the prompts' image and vision tokens replaced by random text tokens, no image: the same "
        "language model's engine-vs-trainer gap on text",
    )
    p.add_argument(
        "--profile-step", type=int, default=0, help="print the torch profile of this step's generation"
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="log where each generation's engine time goes (benchmarks/engine.py's --timeline)",
    )
    p.add_argument(
        "--no-lean",
        action="store_true",
        help="decode through the transformers forward (no lean decoder or graphs)",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from relax.algorithms.config import AlgorithmConfig
    from relax.algorithms.pipeline import make_policy_loss
    from relax.backends.inference.embedded.engine import EmbeddedEngine
    from relax.backends.training.fsdp import FSDPWorker
    from relax.backends.training.update import gather_rows, merge_partials
    from relax.config import TrainerConfig
    from relax.data.batch import TrainBatch
    from relax.data.config import MediaConfig
    from relax.data.multimodal import MultimodalProcessor
    from relax.data.toy_media import COLOR_PROMPT, COLORS, color_image
    from relax.utils.gc_freeze import freeze_startup_objects

    cuda = args.device == "cuda"
    work = Path(tempfile.mkdtemp(prefix="relax-vl-bench-"))
    t0 = time.perf_counter()
    path = write_model(work / "model", args.tiny)
    write_s = time.perf_counter() - t0
    px = args.image_size * args.image_size
    proc = MultimodalProcessor(str(path), MediaConfig(image_max_pixels=px, image_min_pixels=min(px, 3136)))
    rng = __import__("numpy").random.default_rng(0)
    for i in range(args.prompts * args.steps):
        color_image(random.Random(i).choice(list(COLORS)), rng, args.image_size).save(work / f"{i}.png")

    cfg = json.loads((path / "config.json").read_text())
    media_ids = {
        cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    }
    vocab = cfg.get("text_config", cfg).get("vocab_size", cfg.get("vocab_size"))
    engine_dtype = "bfloat16" if cuda else "float32"
    engine = EmbeddedEngine(
        str(path),
        device=args.device,
        dtype=engine_dtype,
        seed=0,
        max_total_tokens=args.kv_tokens,
        use_lean=not args.no_lean,
    ).start()
    freeze_startup_objects()  # as the engine's Ray actor does
    timeline = None
    if args.timeline:
        sys.path.insert(0, str(Path(__file__).parent))
        from engine import StepTimeline  # benchmarks/engine.py

        timeline = StepTimeline(engine.scheduler)
    engine_gb = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    tcfg = TrainerConfig(
        backend="fsdp",
        device=args.device,
        lr=1e-6,
        max_tokens_per_micro_batch=args.micro_tokens,
        threads=2,
        gradient_checkpointing=not args.no_grad_ckpt,
        compile_layers=args.compile,
        mixed_precision="bf16" if cuda else "none",
    )
    trainer = None
    if not args.gen_only:
        trainer = FSDPWorker(str(path), tcfg, dtype="float32", total_steps=args.steps)
        trainer.setup("127.0.0.1", _free_port())
    trainer_gb = torch.cuda.memory_allocated() / 2**30 - engine_gb if cuda else 0.0
    loss_fn = make_policy_loss(AlgorithmConfig())
    params = {"n": args.n, "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    step_s, gen_s, train_s, sync_s, gen_tokens, diffs = [], [], [], [], [], []
    first_gap: list[float] = []
    later_gap: list[torch.Tensor] = []
    for step in range(args.steps):
        t_step = time.perf_counter()
        items = [
            proc.process(COLOR_PROMPT, {"image": [str(work / f"{step * args.prompts + j}.png")]})
            for j in range(args.prompts)
        ]
        if args.text_only:
            items = [_as_text(it, media_ids, vocab, rng) for it in items]
        t = time.perf_counter()
        prof = _profiler() if step + 1 == args.profile_step else contextlib.nullcontext()
        if timeline is not None:
            timeline.steps, timeline.recording = [], step > 0  # the first step captures the graphs
            timeline.spent = dict.fromkeys(timeline.spent, 0.0)
        with prof:
            futures = [
                engine.submit(it.prompt_ids, params, multimodal_inputs=it.multimodal_inputs) for it in items
            ]
            results = [f.result() for f in futures]
        gen_s.append(time.perf_counter() - t)
        if timeline is not None and timeline.recording:
            logger.info(
                "engine timeline, step %d: %s", step + 1, json.dumps(timeline.summary(t, t + gen_s[-1]))
            )
        if step + 1 == args.profile_step:
            print(
                prof.key_averages().table(
                    sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=25
                )
            )
        prompts, responses, lps, media, groups = [], [], [], [], []
        for g, (it, rs) in enumerate(zip(items, results, strict=True)):
            for r in rs:
                prompts.append(it.prompt_ids)
                responses.append(r.output_ids)
                lps.append(r.output_logprobs)
                media.append(it.multimodal_inputs)
                groups.append(g)
        gen_tokens.append(sum(len(r) for r in responses))
        if trainer is None:
            step_s.append(time.perf_counter() - t_step)
            logger.info("step %d: gen %.1f s, %d tokens", step + 1, gen_s[-1], gen_tokens[-1])
            continue
        N = len(prompts)
        batch = TrainBatch(
            prompt_ids=prompts,
            response_ids=responses,
            loss_mask=[[1.0] * len(r) for r in responses],
            rollout_log_probs=lps,
            rewards=[float(random.Random(step * 1000 + i).random() < 0.5) for i in range(N)],
            group_index=groups,
            weight_versions=[step] * N,
            multimodal_inputs=media,
        )
        t = time.perf_counter()
        if args.separate_forward:
            batch.old_log_probs = trainer.compute_log_probs(batch)
        batch.advantages = [
            torch.full((len(r),), 1.0 if batch.rewards[i] else -1.0) for i, r in enumerate(responses)
        ]
        # as the Actor does on-policy: pi_old from the update's own forward (trainer.pi_old_from_update)
        partials = trainer.train_minibatches([batch], loss_fn, pi_old_from_forward=not args.separate_forward)
        metrics = merge_partials([partials])
        if not args.separate_forward:
            batch.old_log_probs = gather_rows(N, [(list(range(N)), partials[0]["old_log_probs"])])
        gap = [(o - torch.tensor(lp)).abs() for o, lp in zip(batch.old_log_probs, lps, strict=True)]
        diffs.append(max(float(d.max()) for d in gap))
        # the first response token comes from the engine's prefill (the transformers forward, with the
        # vision tower), the others from its decode steps: where the two sides part is told by which
        first_gap.append(max(float(d[0]) for d in gap))
        later_gap += [d[1:] for d in gap]
        logger.info("step %d: engine-vs-trainer log-prob gap max %.4f (first token %.4f)", step + 1, diffs[-1],
                    first_gap[-1])  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
        train_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.update_weights(trainer.weight_stream("full", getattr(torch, engine_dtype)), str(step + 1))
        if cuda:
            torch.cuda.synchronize()
        sync_s.append(time.perf_counter() - t)
        step_s.append(time.perf_counter() - t_step)
        logger.info(
            "step %d: %.1f s (gen %.1f, train %.1f), loss %.4f, peak %.1f GB",
            step + 1,
            step_s[-1],
            gen_s[-1],
            train_s[-1],
            metrics["train/loss"],
            torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        )
    engine.shutdown()
    if trainer is not None:
        trainer.shutdown()
    steady = step_s[1:] or step_s
    out = {
        "model": "qwen2.5-vl-3b-shape (random)" if not args.tiny else "tiny-qwen2.5-vl",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "steps": args.steps,
        "samples_per_step": args.prompts * args.n,
        "text_only": args.text_only,
        "image_tokens_per_prompt": 0
        if args.text_only
        else int(items[0].multimodal_inputs["image_grid_thw"].prod()) // 4,
        "prompt_tokens": len(items[0].prompt_ids),
        "step_time_s": round(statistics.fmean(steady), 3),
        "gen_time_s": round(statistics.fmean(gen_s[1:] or gen_s), 3),
        "gen_tokens_per_s": round(sum(gen_tokens) / sum(gen_s), 1),
        "gen_tokens_per_s_steady": round(sum(gen_tokens[1:] or gen_tokens) / sum(gen_s[1:] or gen_s), 1),
        "lean_decode": not args.no_lean,
        "train_time_s": _mean(train_s[1:] or train_s),
        "weight_sync_s": _mean(sync_s),
        "first_step_s": round(step_s[0], 3),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "engine_memory_gb": round(engine_gb, 2),
        "trainer_memory_gb": round(trainer_gb, 2),
        "kv_tokens": args.kv_tokens,
        "gradient_checkpointing": not args.no_grad_ckpt,
        "micro_tokens": args.micro_tokens,
        "separate_forward": args.separate_forward,
        "compile": args.compile,
        "engine_trainer_logp_max_diff": round(max(diffs), 4) if diffs else None,
        "logp_gap_first_token_max": round(max(first_gap), 4) if first_gap else None,
        "logp_gap_later_tokens": _gap_stats(later_gap),
        "model_write_s": round(write_s, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Throughput of the embedded engine against plain `transformers` `generate`, on a random-initialised
model of a given shape (no download). Not a test: run it by hand, on CPU or GPU.

    python tests/backends/bench_engine.py --preset qwen2.5-0.5b --prompts 64 --new-tokens 256

Both sides sample (temperature 1, ignore EOS) the same prompts. `generate` runs the whole batch at once
(its best case: equal lengths); the engine gets every request at once through `submit`, and a second
workload with mixed output lengths shows what continuous batching buys.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from relax.backends.inference.embedded.engine import EmbeddedEngine

logger = logging.getLogger("bench_engine")

PRESETS = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
    ),
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype)

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Qwen2Config(
            vocab_size=args.vocab,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            **PRESETS[args.preset],
        )
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).to(dtype).save_pretrained(tmp)
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=gen)
        total = args.prompts * args.new_tokens

        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(args.device).eval()
        kw = dict(
            max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True, temperature=1.0
        )
        ids = prompts.to(args.device)
        with torch.inference_mode():
            model.generate(ids[:2], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
            sync(args.device)
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            sync(args.device)
        hf_s = time.perf_counter() - t0
        logger.info("transformers generate: %.2f s, %.0f tok/s", hf_s, total / hf_s)
        del model

        engine = EmbeddedEngine(tmp, device=args.device, dtype=args.dtype, max_running=args.prompts).start()
        params = {"max_new_tokens": args.new_tokens, "ignore_eos": True, "temperature": 1.0}
        engine.generate(prompts[0, :8].tolist(), {**params, "max_new_tokens": 4})  # warm-up
        t0 = time.perf_counter()
        futures = [engine.submit(p.tolist(), params) for p in prompts]
        outs = [f.result()[0] for f in futures]
        eng_s = time.perf_counter() - t0
        assert all(len(o.output_ids) == args.new_tokens for o in outs)
        logger.info("embedded engine:       %.2f s, %.0f tok/s", eng_s, total / eng_s)

        lengths = [args.new_tokens // 4 + (i * 37) % (args.new_tokens * 3 // 4) for i in range(args.prompts)]
        t0 = time.perf_counter()
        futures = [
            engine.submit(p.tolist(), {**params, "max_new_tokens": n})
            for p, n in zip(prompts, lengths, strict=True)
        ]
        [f.result() for f in futures]
        mixed_s = time.perf_counter() - t0
        logger.info("engine, mixed lengths: %.2f s, %.0f tok/s", mixed_s, sum(lengths) / mixed_s)
        engine.shutdown()


if __name__ == "__main__":
    main()

"""The engine step in which a whole batch of long rows finishes, against the pass's median decode step.

In an RL rollout the rows of a step's batch run to the same length (or near it), so they finish
together: that step caches every row's blocks in the prefix cache, decodes every text and resolves every
request, host work the overlap of the next decode step cannot hide. The pass runs on the engine thread
(as `engine.py --profile` does, no submission overhead); `--profile` prints cProfile's view of the last
two steps.

    python benchmarks/finish_step.py                                  # tiny model, CPU
    python benchmarks/finish_step.py --preset qwen2.5-0.5b --device cuda --dtype bfloat16 --new-tokens 2048

docs/engines.md (Prefix cache) has the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import PRESETS, sync, write_model  # noqa: E402  (benchmarks/engine.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", *PRESETS])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--new-tokens", type=int, default=1792, help="every row's length (the tiny model's context is 2,048)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--profile", action="store_true", help="cProfile the last two steps")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from relax.backends.inference.embedded.engine import EmbeddedEngine
    from relax.utils.gc_freeze import freeze_startup_objects

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(args.preset, args.dtype, Path(tmp) / "model")
        engine = EmbeddedEngine(
            str(model_dir),
            device=args.device,
            dtype=args.dtype,
            max_running=args.rows,
            seed=0,
            max_total_tokens=args.rows * (args.prompt_len + args.new_tokens + 32),
        ).start()
        freeze_startup_objects()  # as the engine's Ray actor does
        engine.pause()
        rng = random.Random(0)
        vocab = engine.runner.vocab_size
        params = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": args.new_tokens}
        futures = [
            engine.submit([rng.randrange(vocab) for _ in range(args.prompt_len)], params)
            for _ in range(args.rows)
        ]
        prof = cProfile.Profile()

        def work() -> list[float]:
            s, times = engine.scheduler, []
            while s.waiting or s.running or s.inflight is not None:
                last = len(times) >= args.new_tokens - 2
                if last and args.profile:
                    prof.enable()
                sync(args.device)
                t = time.perf_counter()
                s.step()
                sync(args.device)
                times.append(time.perf_counter() - t)
                if last and args.profile:
                    prof.disable()
            return times

        try:
            times = engine._call(work)
            assert all(len(f.result(timeout=60)[0].output_ids) == args.new_tokens for f in futures)
        finally:
            engine.shutdown()
    if args.profile:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(20)
    median = statistics.median(times[len(times) // 2 : -2])
    last2 = times[-2:]
    print(
        json.dumps(
            {
                "preset": args.preset,
                "device": args.device,
                "rows": args.rows,
                "tokens": args.prompt_len + args.new_tokens,
                "steps": len(times),
                "median_decode_step_ms": round(1e3 * median, 2),
                "last_two_steps_ms": [round(1e3 * t, 1) for t in last2],
                "last_two_steps_over_median": round(sum(last2) / median, 1),
            }
        )
    )


if __name__ == "__main__":
    main()

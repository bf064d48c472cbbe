"""CPU cost of a `/generate` reply on the Rollout's side, at the response lengths of reasoning RL. Not a test.

When every row of a step is capped at the same length (a random model, or a policy that always runs to
`max_new_tokens`), the engine's last step finishes every group at once, and the Rollout then reads all
of the step's replies on its event loop while the engine waits for the next step: that time is on the
step's critical path (`perf/rollout_s` minus `rollout/engine_busy_s`). Three costs are measured:

1. Writing one GRPO group's reply on the engine (its HTTP thread): the items built by `final_item` and
   serialized by pydantic-core, as FastAPI did with the route's return value, against `reply_body`
   (the same, with the cyclic collector paused).
2. Reading it (`--n` samples; SGLang's shape, built by the embedded engine's own
   `final_item` and serialized as its route does) into `GenerateOutput`s, in a process whose start-up
   objects are frozen as a role's are: the standard library's `json.loads` (the client before), msgspec
   (`Reply.json`), and the client's `read_outputs` (msgspec, the cyclic collector paused for the read);
   and the packed reply a Relax engine sends Relax's client (`relax.engine_api.packed`), written and read.
3. A full collection of Python's cyclic collector in a process that imported the data plane's client
   (TransferQueue: tensordict, torch._dynamo) after the role froze its start-up objects, against one
   that imported it before (what `PlaneClient._use_plane` does; relax/utils/gc_freeze.py). A 2k-token
   step's replies allocate enough to trigger several full collections.

    python benchmarks/engine_reply.py                       # 8 samples x 256, 2048, 8192 tokens
    python benchmarks/engine_reply.py --lengths 2048 --n 16

Prints milliseconds per group and per step of `--groups` groups (the engine's and the Rollout's shares
are on different processes; both are serial at a step's end), and the ratios; the last line is JSON.
`--no-freeze` leaves this process's start-up objects to the collector, as a process that has made many
objects since its start-up is (an engine's sequences and prefix-cache nodes).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import replace

from pydantic_core import to_json

from relax.backends.inference.embedded.http.sglang_format import Job, final_item, reply_body
from relax.backends.inference.embedded.scheduling.sequence import GenerationResult
from relax.engine_api import packed
from relax.engine_api.client import GenerateOutput, Reply, read_outputs
from relax.engine_api.protocol import SamplingParams

GC_PROBE = """
import gc, sys, time
import torch, transformers  # what every role has loaded at start-up
before = sys.argv[1] == "before"
if before:
    import relax.dataplane.transferqueue
gc.collect(); gc.freeze()
if not before:
    import relax.dataplane.transferqueue  # the first write's import
times = []
for _ in range(5):
    t = time.perf_counter(); gc.collect(); times.append(time.perf_counter() - t)
print(sorted(times)[2], len(gc.get_objects()))
"""


def group_results(n: int, length: int, vocab: int, seed: int) -> tuple[list[GenerationResult], Job]:
    """One group's finished samples as the engine's scheduler hands them to `/generate`, and its job."""
    rng = random.Random(seed)
    job = Job([1, 2, 3], SamplingParams(max_new_tokens=length, n=n), "r", True, -1, 0, None, None)
    results = []
    for j in range(n):
        ids = [rng.randrange(vocab) for _ in range(length)]
        lps = [-rng.random() * 12 for _ in ids]
        text = " ".join(f"w{t % 997}" for t in ids)
        results.append(
            GenerationResult(f"r-{j}", ids, lps, {"type": "length", "length": length}, 3, "1", text, 1.0)
        )
    return results, job


WRITERS = {  # name -> (results, job) -> the reply's body
    "plain": lambda rs, job: to_json([final_item(r, job, None, False) for r in rs]),
    "reply_body": lambda rs, job: reply_body([rs], [job], None, False, True),
    "packed": lambda rs, job: reply_body([rs], [job], None, False, True, packed=True),
}


def per_group_ms(fn, *args: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


READERS = {  # name -> (the body it reads, body -> the group's outputs)
    "json.loads": ("json", lambda b: [GenerateOutput.from_json(d) for d in json.loads(b)]),
    "msgspec": ("json", lambda b: [GenerateOutput.from_json(d) for d in Reply(200, b, "OK").json()]),
    "read_outputs": ("json", lambda b: read_outputs(Reply(200, b, "OK"))),
    "packed": ("packed", lambda b: read_outputs(Reply(200, b, "OK", packed.MEDIA_TYPE))),
}


def gc_probe(where: str) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", GC_PROBE, where], capture_output=True, text=True, check=True)
    full_s, tracked = out.stdout.split()
    return float(full_s), int(tracked)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 2048, 8192], help="tokens per sample")
    p.add_argument("--n", type=int, default=8, help="samples per group (one /generate reply)")
    p.add_argument("--groups", type=int, default=32, help="groups per step, for the per-step figure")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--no-freeze", action="store_true", help="leave the start-up objects to the collector")
    args = p.parse_args()

    if not args.no_freeze:
        gc.collect()
        gc.freeze()  # as a role replica does after start-up (relax/utils/gc_freeze.py)
    result: dict = {"n": args.n, "groups": args.groups, "frozen": not args.no_freeze, "lengths": {}}
    for length in args.lengths:
        results, job = group_results(args.n, length, args.vocab, seed=length)
        body = WRITERS["plain"](results, job)
        assert WRITERS["reply_body"](results, job) == body, "reply_body must write what FastAPI wrote"
        bodies = {"json": body, "packed": WRITERS["packed"](results, job)}
        same = [replace(o, meta_info={}) for o in READERS["json.loads"][1](body)]
        unpacked = [replace(o, meta_info={}) for o in READERS["packed"][1](bodies["packed"])]
        assert unpacked == same, "the packed reply must read as the JSON one"
        write = {k: per_group_ms(fn, results, job, repeats=args.repeats) for k, fn in WRITERS.items()}
        read = {k: per_group_ms(fn, bodies[kind], repeats=args.repeats) for k, (kind, fn) in READERS.items()}
        both = {  # the engine's write and the Rollout's read of one group
            "before": write["plain"] + read["json.loads"],
            "json": write["reply_body"] + read["read_outputs"],
            "packed": write["packed"] + read["packed"],
        }
        print(
            f"{args.n} x {length:5d} tokens (JSON {len(body) / 1e6:5.2f} MB, packed "
            f"{len(bodies['packed']) / 1e6:5.2f} MB), ms a group: engine writes "
            + ", ".join(f"{k} {v:.2f}" for k, v in write.items())
            + "; rollout reads "
            + ", ".join(f"{k} {v:.2f}" for k, v in read.items())
            + "; both "
            + " -> ".join(f"{k} {v:.2f}" for k, v in both.items())
            + f" ({both['json'] / both['packed']:.1f}x JSON's), a step of {args.groups} groups "
            + " -> ".join(f"{v * args.groups / 1e3:.3f}" for v in both.values())
            + " s"
        )
        result["lengths"][length] = {
            "mb": len(body) / 1e6,
            "packed_mb": len(bodies["packed"]) / 1e6,
            **{f"write_{k}_ms": v for k, v in write.items()},
            **{f"read_{k}_ms": v for k, v in read.items()},
        }

    after, after_objs = gc_probe("after")
    before, before_objs = gc_probe("before")
    print(
        f"full collection, data plane imported after the freeze: {after * 1e3:.1f} ms ({after_objs} objects "
        f"tracked); before it: {before * 1e3:.1f} ms ({before_objs}); {after / max(before, 1e-9):.1f}x"
    )
    result["gc_full_ms"] = {"after_freeze": after * 1e3, "before_freeze": before * 1e3}
    result["gc_tracked"] = {"after_freeze": after_objs, "before_freeze": before_objs}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Sweep the quickstart's GRPO loop over seeds and settings, in process, without Ray.

`relax train examples/quickstart.yaml` takes ~6 minutes; to choose its model size and optimizer settings
we need the spread over many seeds, not one run. This script replays the same loop in one process --
sample `n` responses per prompt at temperature 1, score them with the `first_number` reward, GRPO
advantages (`relax.algorithms.pipeline.compute_advantages`), the same policy loss with its entropy bonus
(`make_policy_loss`), `num_mini_batches` AdamW steps per rollout -- on a fresh model of the given size
per seed, and prints the last-10 mean reward and the greedy eval score per setting (min and median over
seeds). The sampler is a plain full-sequence forward (responses are at most 4 tokens); the real run
differs only in the engine, which samples the same distribution.

    python benchmarks/toy_sweep.py --hidden 64,256 --mini-batches 1,4 --lr 3e-3,5e-4 --seeds 4 --workers 2

Measured on 16 CPU cores (one thread per run, 100 steps) with the first version of this loop, which
drew prompts and initialised the model slightly differently: hidden 64 / 1 mini-batch / lr 3e-3 (the
old quickstart) median 0.26, min 0.14 over 6 seeds; hidden 256 / 4 mini-batches / lr 5e-4 median 0.87,
min 0.76 over 14 seeds; hidden 256 / 4 / lr 3e-4 median 0.89, min 0.84 over 8 seeds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from relax.algorithms.config import AlgorithmConfig
from relax.algorithms.pipeline import PolicyLossInputs, compute_advantages, make_policy_loss
from relax.data.toy import generate_arith
from relax.models.tiny import write_tiny_model
from relax.rewards import extract


def _reward(text: str, label: str) -> float:
    value = extract.first_number(text)
    return 1.0 if value is not None and abs(value - float(label)) < 1e-9 else 0.0


@torch.no_grad()
def _sample(model, prompt_ids: torch.Tensor, max_new: int, stop: set[int], pad: int, greedy: bool):
    out = torch.full((len(prompt_ids), max_new), pad)
    lens = torch.zeros(len(prompt_ids), dtype=torch.long)
    done = torch.zeros(len(prompt_ids), dtype=torch.bool)
    for t in range(max_new):
        logits = model(torch.cat([prompt_ids, out[:, :t]], 1)).logits[:, -1].float()
        nxt = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        out[:, t] = nxt
        lens += (~done).long()
        done |= torch.isin(nxt, torch.tensor(sorted(stop)))
        if done.all():
            break
    return out, lens


def run_one(setting: dict) -> dict:
    """One seeded run of `setting`; returns it with `last10` (mean train reward) and `eval` (greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    s = setting
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(
            Path(tmp) / "m", hidden_size=s["hidden"], seed=s["seed"], init_std=s["init_std"] or None
        )
        train = [
            json.loads(x) for x in generate_arith(Path(tmp) / "t.jsonl", n=2000).read_text().splitlines()
        ]
        evals = [
            json.loads(x)
            for x in generate_arith(Path(tmp) / "e.jsonl", n=100, seed=1).read_text().splitlines()
        ]
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if s["lora"]:
        from relax.backends.training.lora import wrap_lora
        from relax.config import LoraConfig

        model = wrap_lora(model, LoraConfig(rank=s["lora"], alpha=2.0 * s["lora"]))
    torch.manual_seed(s["seed"])
    rng = random.Random(s["seed"])
    stop = {tok.eos_token_id, tok.pad_token_id}
    cfg = AlgorithmConfig(name="grpo", entropy_coef=s["entropy"])
    loss_fn = make_policy_loss(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s["lr"], weight_decay=0.0)
    n, max_new, history = s["n"], 4, []

    def decode(ids, length):
        return tok.decode([i for i in ids[:length].tolist() if i not in stop], skip_special_tokens=True)

    for _ in range(s["steps"]):
        rows = rng.sample(train, s["prompts"])
        prompts = torch.tensor([tok(r["prompt"])["input_ids"] for r in rows for _ in range(n)])
        labels = [r["label"] for r in rows for _ in range(n)]
        out, lens = _sample(model, prompts, max_new, stop, tok.pad_token_id, greedy=False)
        rewards = torch.tensor([_reward(decode(out[i], lens[i]), labels[i]) for i in range(len(labels))])
        history.append(rewards.mean().item())
        mask = (torch.arange(max_new)[None] < lens[:, None]).float()
        adv = compute_advantages(
            cfg, rewards, torch.arange(len(labels)) // n, mask, group_size=n
        ).advantages_NT
        full, P = torch.cat([prompts, out], 1), prompts.shape[1]
        with torch.no_grad():
            old = torch.log_softmax(model(full).logits[:, P - 1 : -1].float(), -1)
            old = old.gather(-1, out[..., None])[..., 0]
        for idx in torch.randperm(len(labels)).chunk(s["mini_batches"]):
            logp = torch.log_softmax(model(full[idx]).logits[:, P - 1 : -1].float(), -1)
            inputs = PolicyLossInputs(
                log_probs=logp.gather(-1, out[idx][..., None])[..., 0],
                old_log_probs=old[idx],
                advantages=adv[idx],
                loss_mask=mask[idx],
                rollout_log_probs=None,
                ref_log_probs=None,
                entropy=-(logp.exp() * logp).sum(-1),
                global_num_tokens=mask[idx].sum().item(),
                global_num_seqs=len(idx),
                max_response_len=max_new,
            )
            loss, _ = loss_fn(inputs)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
    prompts = torch.tensor([tok(r["prompt"])["input_ids"] for r in evals])
    out, lens = _sample(model, prompts, max_new, stop, tok.pad_token_id, greedy=True)
    score = statistics.fmean(_reward(decode(out[i], lens[i]), r["label"]) for i, r in enumerate(evals))
    return {**s, "last10": statistics.fmean(history[-10:]), "eval": score}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", default="256", help="comma-separated model hidden sizes")
    p.add_argument("--mini-batches", default="4", help="comma-separated optimizer steps per rollout")
    p.add_argument("--lr", default="5e-4", help="comma-separated learning rates")
    p.add_argument("--entropy", default="0.02", help="comma-separated entropy bonus coefficients")
    p.add_argument("--lora", default="0", help="comma-separated LoRA ranks (alpha = 2 r); 0 = all weights")
    p.add_argument("--init-std", default="0", help="comma-separated init stds of the model; 0 = default")
    p.add_argument("--seeds", type=int, default=4, help="seeds per setting (model init and sampling)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--workers", type=int, default=2, help="runs in parallel, one thread each")
    a = p.parse_args()
    settings = [
        {
            "hidden": int(h),
            "mini_batches": int(m),
            "lr": lr,
            "entropy": e,
            "lora": int(r),
            "init_std": sd,
            "seed": seed,
            "steps": a.steps,
            "prompts": a.prompts,
            "n": a.n,
        }
        for h, m, lr, e, r, sd, seed in itertools.product(
            _floats(a.hidden),
            _floats(a.mini_batches),
            _floats(a.lr),
            _floats(a.entropy),
            _floats(a.lora),
            _floats(a.init_std),
            range(a.seeds),
        )
    ]
    print(f"{len(settings)} runs of {a.steps} steps, {a.workers} at a time", file=sys.stderr)
    results: dict[tuple, list[dict]] = {}
    with ProcessPoolExecutor(a.workers) as pool:
        for done, r in enumerate(pool.map(run_one, settings), 1):
            key = (r["hidden"], r["mini_batches"], r["lr"], r["entropy"], r["lora"], r["init_std"])
            results.setdefault(key, []).append(r)
            print(f"[{done}/{len(settings)}] {json.dumps(r)}", file=sys.stderr)
    print("hidden  mini_batches  lr       entropy  lora  init_std  last10 min  last10 median  eval median")
    for (h, m, lr, e, lo, sd), rs in sorted(results.items()):
        last = [r["last10"] for r in rs]
        print(
            f"{h:<7} {m:<13} {lr:<8g} {e:<8g} {lo:<5} {sd:<9g} {min(last):<11.3f} {statistics.median(last):<14.3f} "
            f"{statistics.median(r['eval'] for r in rs):.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""lm-eval-harness (the real `lm_eval` CLI) against the engine's `/v1/completions`: a multiple-choice
task, scored through `echo` with prompt log-probs, and a generation task, both defined in local files
(`dataset_path: json`), offline. The log-likelihoods lm-eval logs are checked against the trainer's
forward over the same weights, so a wrong prompt log-prob (or an off-by-one in `echo`) fails here.
Kept short: a tiny model, a handful of documents, `--limit` (its time: docs/measurements.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is installed by scripts/test.sh (the lm-eval extra)")

MC_DOCS = [
    {"question": "Two plus two is", "choices": ["four", "five", "six"], "answer": 0},
    {"question": "The sky is", "choices": ["blue", "green"], "answer": 0},
    {"question": "Water is", "choices": ["wet", "dry"], "answer": 1},
]
GEN_DOCS = [{"question": "Say hi", "answer": "hi"}, {"question": "Count to two", "answer": "one two"}]


def _write_tasks(folder: Path) -> None:
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "relax_mc.yaml").write_text(
        f"task: relax_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "relax_gen.yaml").write_text(
        f"task: relax_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: 'Q: {{question}} A:'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )


def _loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """lm-eval's scoring of a causal model by hand: the context's trailing spaces move to the
    continuation, the pair is encoded whole and split at the context's length."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    n_ctx = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logp_TV = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(logp_TV[k - 1, whole[k]].item() for k in range(n_ctx, len(whole)))


def test_lm_eval_runs_multiple_choice_and_generation(
    engine_server, tiny_model_dir, reference_model, tmp_path
):
    tokenizer = engine_server.engine.tokenizer
    if tokenizer is None:
        pytest.skip("the tiny model has no tokenizer")
    _write_tasks(tmp_path)
    model = Path(engine_server.engine.runner.model_path).name
    model_args = (
        f"model={model},base_url={engine_server.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={tiny_model_dir},num_concurrent=1,max_retries=1"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
         "--tasks", "relax_mc,relax_gen", "--include_path", str(tmp_path), "--limit", "3",
         "--log_samples", "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=540,
    )  # fmt: skip
    print(proc.stdout)  # lm-eval's table
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("|relax_")]
    assert len(table) == 2 and "acc" in table[1] and "exact_match" in table[0], proc.stdout
    (mc_log,) = (tmp_path / "out").rglob("samples_relax_mc_*.jsonl")
    samples = [json.loads(line) for line in mc_log.read_text().splitlines()]
    assert len(samples) == len(MC_DOCS)
    right = 0
    for s in samples:
        args = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        got = [float(r[0]) for r in s["filtered_resps"]]
        want = [_loglikelihood(reference_model, tokenizer, c, x) for c, x in args]
        assert got == pytest.approx(want, abs=1e-3)
        right += int(max(range(len(want)), key=want.__getitem__) == s["doc"]["answer"])
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert results["relax_mc"]["acc,none"] == pytest.approx(right / len(MC_DOCS))
    (gen_log,) = (tmp_path / "out").rglob("samples_relax_gen_*.jsonl")
    assert len(gen_log.read_text().splitlines()) == len(GEN_DOCS)

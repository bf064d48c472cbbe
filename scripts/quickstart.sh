#!/usr/bin/env bash
# Set up a virtual environment, write the tiny model and the toy data, and train with GRPO on CPU.
# Extra arguments are config overrides, e.g.: bash scripts/quickstart.sh trainer.num_steps=20
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch is pinned to the CPU build on CPU-only hosts; an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0 -e .
# A 2 M-parameter Qwen2 (hidden 256): it learns the sums reliably; the 0.16 M default stalls on the most frequent one.
[ -f .relax/assets/quickstart-qwen2/config.json ] ||
  .venv/bin/relax tiny-model --family qwen2 --hidden-size 256 --out .relax/assets/quickstart-qwen2
[ -f .relax/assets/arith_train.jsonl ] || .venv/bin/relax data arith --out .relax/assets/arith_train.jsonl --n 2000
[ -f .relax/assets/arith_eval.jsonl ] || .venv/bin/relax data arith --out .relax/assets/arith_eval.jsonl --n 100 --seed 1
exec .venv/bin/relax train examples/quickstart.yaml "$@"

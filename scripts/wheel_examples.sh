#!/usr/bin/env bash
# Every shipped example from the wheel alone, as a new user gets it: build the wheel, install it into a
# fresh virtual environment outside the checkout (with the CPU build of torch), then for each example
# `relax examples prepare NAME` and `relax train NAME.yaml trainer.num_steps=2` in the prepared folder,
# and print a Markdown table of example / result / time (docs/examples.md holds the latest one).
#
#   bash scripts/wheel_examples.sh                    # every example that runs on a CPU host
#   bash scripts/wheel_examples.sh quickstart lora    # only these
#
# Slow (minutes a step of each example on 2 cores, plus the install): run it by hand, not in CI.
# The search_tool example is first trained before its extra is installed, to show that a missing
# `relax[agentic]` stops the run before Ray starts with the install command. Environment: PYTHON (the
# interpreter to build with), SRC (the source tree to build, default this checkout), WORK (a folder
# for the wheel, the venv and the runs; default a fresh temporary one).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=${SRC:-$ROOT}
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d /tmp/relax-wheel-examples.XXXXXX)}
STEPS=2
# cluster.yaml needs a Ray cluster with labelled nodes and shared storage: prepared, not trained
CPU_EXAMPLES=(quickstart calc_tool search_tool vl_colors audio_tones fsdp_2ranks lora)
PREPARE_ONLY=(cluster)
if [ $# -gt 0 ]; then CPU_EXAMPLES=("$@"); PREPARE_ONLY=(); fi
mkdir -p "$WORK"
echo "work folder: $WORK"

t0=$(date +%s)
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$SRC"
WHEEL=$(ls "$WORK"/dist/relax-*.whl)
"$PY" -m venv "$WORK/venv"
BIN=$WORK/venv/bin
# torch first and pinned: an unpinned one would pull a multi-GB CUDA build on a CPU host
"$BIN/pip" install -q torch==2.13.0
"$BIN/pip" install -q "$WHEEL"
echo "installed $(basename "$WHEEL") in $(($(date +%s) - t0))s"
export PATH="$BIN:$PATH"
cd "$WORK"

declare -a ROWS
row() { ROWS+=("| $1 | $2 | $3 |"); echo "== $1: $2 ($3)"; }

# A missing extra: the run must stop before Ray starts, naming it (bm25s is not installed yet).
if [[ " ${CPU_EXAMPLES[*]} " == *" search_tool "* ]]; then
  relax examples prepare search_tool --dir search_tool >"$WORK/search_tool.prepare.log" 2>&1
  s=$(date +%s)
  if (cd search_tool && relax train search_tool.yaml >"$WORK/search_tool.noextra.log" 2>&1); then
    row "search_tool without relax[agentic]" "FAILED: trained without bm25s" "$(($(date +%s) - s))s"
  elif grep -q "pip install 'relax\[agentic\]'" "$WORK/search_tool.noextra.log" &&
    ! grep -q "Started a local Ray instance\|started a local Ray cluster" "$WORK/search_tool.noextra.log"; then
    row "search_tool without relax[agentic]" "stopped before Ray, naming relax[agentic]" "$(($(date +%s) - s))s"
  else
    row "search_tool without relax[agentic]" "FAILED: $(tail -1 "$WORK/search_tool.noextra.log")" "$(($(date +%s) - s))s"
  fi
fi
"$BIN/pip" install -q "$WHEEL[agentic,lora]"

for name in "${CPU_EXAMPLES[@]}"; do
  s=$(date +%s)
  if ! relax examples prepare "$name" --dir "$name" >"$WORK/$name.prepare.log" 2>&1; then
    row "$name" "FAILED to prepare: $(tail -1 "$WORK/$name.prepare.log")" "$(($(date +%s) - s))s"
    continue
  fi
  p=$(($(date +%s) - s))
  if (cd "$name" && timeout 1200 relax train "$name.yaml" trainer.num_steps=$STEPS >"$WORK/$name.train.log" 2>&1); then
    # the steps of metrics.jsonl (an eval before training adds a row of step 0)
    steps=$(cat "$name"/runs/*/metrics.jsonl 2>/dev/null |
      python3 -c 'import json, sys; print(" ".join(str(json.loads(x)["step"]) for x in sys.stdin if x.strip()))')
    if [[ " $steps " == *" $STEPS " ]]; then
      row "$name" "trained $STEPS steps" "prepare ${p}s, train $(($(date +%s) - s - p))s"
    else
      row "$name" "FAILED: metric rows of steps [$steps], not up to $STEPS" "prepare ${p}s, train $(($(date +%s) - s - p))s"
    fi
  else
    why=$(grep -E "relax train:|Error" "$WORK/$name.train.log" | tail -1 | cut -c1-160)
    row "$name" "FAILED: ${why:-see $WORK/$name.train.log}" "prepare ${p}s, train $(($(date +%s) - s - p))s"
  fi
done
for name in "${PREPARE_ONLY[@]}"; do
  s=$(date +%s)
  if relax examples prepare "$name" --dir "$name" >"$WORK/$name.prepare.log" 2>&1; then
    row "$name" "prepared (needs a labelled Ray cluster and shared storage to train)" "$(($(date +%s) - s))s"
  else
    row "$name" "FAILED to prepare: $(tail -1 "$WORK/$name.prepare.log")" "$(($(date +%s) - s))s"
  fi
done

echo
echo "$(basename "$WHEEL"), torch==2.13.0 (CPU), $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo
echo "| example | result | time |"
echo "| --- | --- | --- |"
printf '%s\n' "${ROWS[@]}"
! printf '%s\n' "${ROWS[@]}" | grep -q FAILED

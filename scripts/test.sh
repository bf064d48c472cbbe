#!/usr/bin/env bash
# Set up a virtual environment with the test extras, lint, build the docs and run the test suite: what CI
# runs (.ci/run), the slow end-to-end tests included. docs/testing.md describes the tiers.
#
#   bash scripts/test.sh                    # CI's suite
#   bash scripts/test.sh -m "not slow"      # extra arguments go to pytest
#   bash scripts/test.sh --full             # everything: the tests marked `full`, the whole fault matrix
#                                           # (scripts/fault_matrix.py) and the cluster soak (needs root)
set -euo pipefail
cd "$(dirname "$0")/.."
FULL=0
if [ "${1:-}" = "--full" ]; then
  FULL=1
  shift
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv

# uv resolves and installs the same packages as pip several times faster; it reads no pip configuration,
# so the indexes, local wheel folders and constraints pip is set up with (pip.conf, PIP_* variables) are
# passed on, and `unsafe-best-match` picks the highest version over all of them as pip does (uv's default
# takes a package from the first index that has it). Without uv (no network to fetch it), pip installs.
uv_args=(--python .venv/bin/python --index-strategy unsafe-best-match)
while IFS= read -r line; do
  key=${line%%=*}
  key=${key#*.}
  val=${line#*=}
  val=${val#\'}
  val=${val%\'}
  case "$key" in
    index-url) uv_args+=(--index-url "$val") ;;
    extra-index-url) for v in $val; do uv_args+=(--extra-index-url "$v"); done ;;
    find-links) for v in $val; do uv_args+=(--find-links "$v"); done ;;
    constraint) for v in $val; do uv_args+=(--constraint "$v"); done ;;
    cert) export SSL_CERT_FILE="$val" ;;
  esac
done < <(.venv/bin/python -m pip config list 2>/dev/null || true)
# Bytecode is written as modules are first imported, not compiled for the whole environment at install:
# uv writes no .pyc (pip does) and CI's machines set PYTHONDONTWRITEBYTECODE, so without either every
# process (a run starts about ten) compiled torch, transformers and Ray from source on each import (the
# suite twice as long), while `uv pip install --compile-bytecode` compiles all ~25,000 files of the
# environment (37 s of a clean clone's install, 57 CPU-seconds) where the suite imports ~4,000
# (docs/testing.md). Ray's workers inherit the environment, so they write and read the same cache.
unset PYTHONDONTWRITEBYTECODE
if [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q uv 2>/dev/null; then
  .venv/bin/uv pip install -q "${uv_args[@]}" torch==2.13.0 -e '.[test,docs]'
else
  echo "uv is not available: installing with pip" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0 -e '.[test,docs]'
fi

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # Ray token auth stays on: Relax sets it up (docs/cluster.md)
.venv/bin/ruff check relax tests benchmarks
.venv/bin/ruff format --check relax tests benchmarks
# The docs site builds with no warning (broken links fail). With the two queues it is built at the end of
# the component tests' queue, where the end-to-end runs alone leave part of the cores idle, not before
# the tests: 16 s of a clean clone's start, on one core (docs/testing.md).
build_docs() { bash scripts/docs.sh 2>&1 | sed -u "s/^/[docs] /"; return "${PIPESTATUS[0]}"; }

# Two pytest processes side by side: the end-to-end tests (marked slow) one after another in the first,
# the component tests in the second (tests/conftest.py picks each queue's tests by RELAX_TEST_QUEUE). An
# end-to-end run leaves part of the two cores idle while it waits (deploys, health checks, the steps it
# paces, a child process's Ray starting), and the component tests fill that; two end-to-end runs at once
# would each take twice as long (they are CPU-bound while their roles start) and strain their deadlines
# (docs/testing.md). When the component tests (and the docs) are done, the second process's place runs
# a third queue, "cli": the `relax train` children of SIGTERM and Ctrl-C, once the first has reached its
# runs on simulated hosts; both kinds of runs leave a core partly idle alone, and side by
# side they fill the two. Each process has its own Ray clusters; their output lines are prefixed [e2e],
# [unit] and [cli]. One process runs where the arguments pick the tests (a path, -m, -k), or with
# RELAX_TEST_SPLIT=0; RELAX_TEST_WORKERS=N runs N pytest-xdist workers instead.
args=()
[ "$FULL" = 1 ] && args+=(--full)
split=${RELAX_TEST_SPLIT:-1}
for a in "$@"; do
  case "$a" in -m | -k | -n | tests* | *.py*) split=0 ;; esac
done
workers=${RELAX_TEST_WORKERS:-0}
if [ "$workers" != 0 ]; then
  args+=(-n "$workers")
  split=0
fi

run_pytest() { # NAME ARGS...: pytest, its lines prefixed with [NAME]; exit code 5 (no test) fails
  local name=$1 rc
  shift
  .venv/bin/pytest "$@" 2>&1 | sed -u "s/^/[$name] /"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 5 ]; then
    echo "[$name] pytest collected no tests: failing on purpose" >&2
    rc=1
  fi
  return "$rc"
}

# RELAX_TEST_CPU_LOG=FILE: each test appends its CPU-seconds to FILE (tests/cpu_log.py). Each pytest
# process and all it starts (Ray, engines, children) are counted in a cgroup of its own, made here when
# this script may (root, a writable cgroup tree); `python benchmarks/suite_cpu.py FILE` prints the tables.
cpu_cgroup() { # NAME: move this (sub)shell into a fresh cgroup NAME when RELAX_TEST_CPU_LOG asks for it
  [ -n "${RELAX_TEST_CPU_LOG:-}" ] || return 0
  local base=/sys/fs/cgroup dir
  [ -d $base/cpuacct ] && base=$base/cpuacct
  dir=$base/relax-test-$1-$$
  if mkdir -p "$dir" 2>/dev/null && echo "$BASHPID" >"$dir/cgroup.procs" 2>/dev/null; then
    export RELAX_TEST_CPU_CGROUP=$dir
  else
    echo "[$1] no cgroup of its own (not root?): $RELAX_TEST_CPU_LOG gets wall times only" >&2
  fi
}

status=0
set +e
if [ "$split" = 1 ]; then
  # the e2e queue's own-Ray runs wait for the first file, which the unit queue leaves when it ends; the
  # cli queue waits for the second, which the e2e queue leaves when it reaches them (or ends)
  export RELAX_TEST_UNIT_DONE RELAX_TEST_E2E_OWN_RAY
  RELAX_TEST_UNIT_DONE=$(mktemp -u "${TMPDIR:-/tmp}/relax-unit-done.XXXXXX")
  RELAX_TEST_E2E_OWN_RAY=$(mktemp -u "${TMPDIR:-/tmp}/relax-e2e-own-ray.XXXXXX")
  (
    cpu_cgroup e2e
    RELAX_TEST_QUEUE=e2e run_pytest e2e -ra -v --durations=20 "${args[@]}" "$@"
    rc=$?
    touch "$RELAX_TEST_E2E_OWN_RAY"
    exit "$rc"
  ) &
  e2e=$!
  (
    cpu_cgroup unit
    RELAX_TEST_QUEUE=unit run_pytest unit -ra --durations=20 "${args[@]}" "$@"
    rc=$?
    build_docs || rc=1
    touch "$RELAX_TEST_UNIT_DONE"
    while [ ! -e "$RELAX_TEST_E2E_OWN_RAY" ]; do sleep 1; done
    cpu_cgroup cli
    RELAX_TEST_QUEUE=cli run_pytest cli -ra -v --durations=20 "${args[@]}" "$@" || rc=1
    exit "$rc"
  ) &
  unit=$!
  wait "$e2e" || status=$?
  wait "$unit" || status=$?
  rm -f "$RELAX_TEST_UNIT_DONE" "$RELAX_TEST_E2E_OWN_RAY"
else
  build_docs || status=1
  (
    cpu_cgroup tests
    run_pytest tests -ra --durations=20 "${args[@]}" "$@"
  ) || status=$?
fi
[ -n "${RELAX_TEST_CPU_LOG:-}" ] && rmdir /sys/fs/cgroup/relax-test-*-$$ /sys/fs/cgroup/cpuacct/relax-test-*-$$ 2>/dev/null
set -e
if [ "$FULL" = 1 ]; then
  # every cell of the matrix, its table rewritten in docs/faults.md; then both cluster shapes ten times
  .venv/bin/python scripts/fault_matrix.py --budget-min 100000 || status=1
  .venv/bin/python scripts/cluster_soak.py --runs 10 || status=1
fi
exit "$status"

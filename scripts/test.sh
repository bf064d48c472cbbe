#!/usr/bin/env bash
# Set up a virtual environment with the test extras and run the whole test suite (slow tests included).
# Extra arguments go to pytest, e.g.: bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0 -e '.[test,docs]'
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # Ray token auth stays on: Relax sets it up (docs/cluster.md)
.venv/bin/ruff check relax tests benchmarks
.venv/bin/ruff format --check relax tests benchmarks
bash scripts/docs.sh  # the docs site builds with no warning (broken links fail)
set +e
.venv/bin/pytest -ra --durations=20 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"

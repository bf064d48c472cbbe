#!/usr/bin/env bash
# Build the docs site (docs/ as Markdown through Sphinx + MyST, an API reference from the docstrings,
# search) into docs/_build/html. Warnings are errors: a broken link, a page outside the table of contents
# or a reference to a symbol that no longer exists fails the build. CI runs it (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import sphinx, myst_parser, furo, relax" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0 -e '.[docs]'
fi
rm -rf docs/_build
.venv/bin/python -m sphinx -W --keep-going -b html -q docs docs/_build/html
echo "docs site: docs/_build/html/index.html"

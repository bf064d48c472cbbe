"""Sphinx configuration of the Relax docs site: the Markdown pages of docs/ (MyST) plus an API reference
from the docstrings. Built in CI with warnings as errors (scripts/docs.sh), so a broken link or a
reference to a symbol that no longer exists fails the build."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import relax  # noqa: E402 - the package must be importable from the checkout for autodoc

project = "Relax"
author = "The Relax authors"
release = relax.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"Relax {release}"
# `heading-anchors` lets pages link to each other's sections (`cluster.md#placement`) as GitHub does.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
suppress_warnings = ["myst.header"]  # pages start at level 2 under their title in a few places

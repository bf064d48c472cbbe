"""Relax: an asynchronous RL post-training engine for LLMs and omni-modal models.

`__version__` is the one version source: pyproject.toml reads it at build time (`dynamic = ["version"]`)
and `relax --version` prints it.
"""

__version__ = "0.1.0"

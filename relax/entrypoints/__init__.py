"""Entry points: the `relax` command line (train, config, doctor, engine serve, eval, export, status, data,
tiny-model): argument parsing, signals, config loading; the work itself lives below.

Layer: entrypoints (ARCHITECTURE.md), the top. May import anything.
"""

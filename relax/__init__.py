"""Relax: an asynchronous RL post-training engine for LLMs and omni-modal models.

`__version__` is the one version source: pyproject.toml reads it at build time (`dynamic = ["version"]`)
and `relax --version` prints it.
"""

__version__ = "0.1.0"


def _quiet_startup_in_ray_workers() -> None:
    # A Ray worker imports Relax first when it is about to become a role or an engine: its start-up
    # imports are the process's heaviest work, and the collector's passes over them a good part of it
    # (relax/utils/gc_freeze.py). Other processes that import Relax keep Python's defaults.
    from relax.utils.gc_freeze import quiet_startup, started_as_ray_worker

    if started_as_ray_worker():
        quiet_startup()


_quiet_startup_in_ray_workers()

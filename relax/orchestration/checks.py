"""The checks before a run starts, as one object: on the driver before Ray starts (`local`: packages,
paths, data rows; relax/orchestration/preflight.py), then on the connected cluster before any role
starts (`cluster`: whether the run's actors fit its nodes, relax/orchestration/fit.py, and whether every
node can use the config's paths and the run folder). A bad config stops the run in seconds with an error
that names the fix, instead of a role failing, or waiting for a node, after minutes.
"""

from __future__ import annotations

from relax.config import RelaxConfig
from relax.orchestration import fit, preflight
from relax.orchestration.registry import run_roles
from relax.orchestration.stop import StopRequest


class StartChecks:
    def __init__(self, cfg: RelaxConfig, stop: StopRequest) -> None:
        self.cfg, self.stop = cfg, stop

    def local(self) -> None:
        """Before Ray starts: raises `PreflightError` naming every problem the driver sees."""
        preflight.check_local(self.cfg)
        self.stop.check("Ray started")

    def cluster(self, cluster_gpus: int) -> None:
        """On the connected cluster, with the GPU plan made for its `cluster_gpus` GPUs
        (`gpus.plan_gpus`): raises `FitError` / `PreflightError`; a stop request ends the checks."""
        fit.check_cluster_fit(self.cfg, run_roles(self.cfg), cluster_gpus)
        self.stop.check("the cluster was checked")
        preflight.check_nodes(self.cfg)
        self.stop.check("the nodes were checked")

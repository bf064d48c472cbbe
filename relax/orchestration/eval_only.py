"""`relax eval CONFIG --checkpoint PATH`: evaluate a checkpoint (a run's checkpoint folder or a Hugging Face
model folder) on the config's eval sets, with no training. Only the Rollout role and its engines start.

A progress bar (prompts done of all sets) follows the evaluator's `progress.json` while it runs
(`relax.rollout.evaluator.EvalProgress`; `ops.progress: false` turns the bar off).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from relax.config import RelaxConfig
from relax.config.paths import resolve_paths
from relax.orchestration import preflight, service
from relax.utils.placement import ray_placement

logger = logging.getLogger(__name__)


def resolve_checkpoint(cfg: RelaxConfig, checkpoint: str | None) -> int:
    """Point `cfg.model.path` at the weights to evaluate; returns the training step they belong to."""
    if checkpoint is None:
        return 0
    path = Path(checkpoint)
    if (path / "config.json").exists():
        cfg.model.path = str(path)
        return 0
    if not path.is_dir():
        raise FileNotFoundError(f"--checkpoint {path} is neither a model folder nor a run checkpoint folder")
    from relax.backends.training.export import export_checkpoint

    meta = path / "meta.json"
    step = json.loads(meta.read_text())["step"] if meta.exists() else 0
    out = cfg.run.run_dir / "eval_only" / f"model_{path.name}"
    export_checkpoint(path, cfg, out)
    cfg.model.path = str(out)
    return step


def run_eval(cfg: RelaxConfig, checkpoint: str | None) -> dict[str, float]:
    if not cfg.eval.sets:
        raise ValueError("relax eval needs at least one eval set: add eval.sets to the config")
    resolve_paths(cfg)
    step = resolve_checkpoint(cfg, checkpoint)
    preflight.check_local(cfg)
    out_dir = cfg.run.run_dir / "eval_only"
    out_dir.mkdir(parents=True, exist_ok=True)
    from relax.roles.rollout import RolloutRole

    owns_ray = service.start_ray(
        cfg.resources.ray_address,
        cfg.resources.num_cpus,
        cfg.resources.object_store_mb,
        secrets_dir=cfg.run.run_dir / "secrets",
    )
    try:
        from relax.orchestration.gpus import cluster_gpus

        cfg.rollout.elastic.enabled = False  # no weight pushes here: a scale-out could never sync weights
        if cfg.resources.engine_gpus is None:  # no trainer here: each engine takes a whole GPU
            cfg.resources.engine_gpus = 1.0 if cluster_gpus() and cfg.trainer.device != "cpu" else 0.0
        service.start_serve()
        preflight.check_nodes(cfg)
        rollout = service.deploy_role("rollout", RolloutRole, cfg, placement=ray_placement(cfg, "rollout"))
        try:
            metrics = _with_progress(
                lambda: rollout.evaluate.remote(step, str(out_dir)).result(),
                out_dir / "progress.json",
                enabled=cfg.ops.progress,
            )
        finally:
            try:
                rollout.stop_engines.remote().result(timeout_s=60)
            finally:
                service.delete_roles()
    finally:
        service.shutdown(stop_ray=owns_ray)
    with (out_dir / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": step, "checkpoint": checkpoint, **metrics}) + "\n")
    return metrics


def _with_progress(call: Any, progress_file: Path, enabled: bool = True, poll_s: float = 0.5) -> Any:
    """Run `call()` (it blocks until the evaluation ends) in a worker thread while a bar follows
    `progress_file`; returns what `call` returns and raises what it raises."""
    from tqdm import tqdm

    from relax.rollout.evaluator import read_progress

    progress_file.unlink(missing_ok=True)  # a file left by an earlier evaluation is not this one's
    with ThreadPoolExecutor(1, thread_name_prefix="relax-eval") as pool:
        fut: Future = pool.submit(call)
        bar = tqdm(desc="eval", unit="prompt", disable=not enabled)
        try:
            while not fut.done():
                time.sleep(poll_s)
                p = read_progress(progress_file)
                if p is not None:
                    bar.total = p["total"]
                    bar.set_postfix_str(p["set"], refresh=False)
                    bar.update(p["done"] - bar.n)
            p = read_progress(progress_file)
            if p is not None and fut.exception() is None:
                bar.update(p["done"] - bar.n)
        finally:
            bar.close()
        return fut.result()

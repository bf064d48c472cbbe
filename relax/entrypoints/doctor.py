"""`relax doctor`: what is installed, which engines and backends are usable here, what Ray sees."""

from __future__ import annotations

import importlib.metadata as md
import platform

import relax

# (distribution, what it does, how it is installed). "relax[X]" names an extra of pyproject.toml (a test
# checks that every one named here exists); the rest are plain dependencies or installed by hand.
PACKAGES = [
    ("torch", "training backend, embedded engine", "required"),
    ("transformers", "model classes", "required"),
    ("ray", "cluster and Serve deployments", "required"),
    ("pydantic", "configuration", "required"),
    ("datasets", "prompt data from Hub data sets (hf://...)", "required"),
    ("transferqueue", "streaming data plane", "required"),
    ("math-verify", "math reward", "required"),
    ("tensorboard", "metrics sink", "required"),
    ("wandb", "metrics sink", "optional: relax[metrics]"),
    ("apprise", "notifications", "optional: relax[metrics]"),
    ("clearml", "metrics sink", "optional: pip install clearml"),
    ("peft", "LoRA", "optional: relax[lora]"),
    ("bm25s", "search task's index", "optional: relax[agentic]"),
    ("sglang", "SGLang engine on GPU clusters", "optional: relax[sglang]"),
]


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def run_doctor(check_ray: bool = True) -> int:
    import torch

    print(f"relax       {relax.__version__}")
    print(f"python      {platform.python_version()} on {platform.platform()}")
    for name, role, how in PACKAGES:
        v = _version(name)
        print(f"{name:14s}{v or 'not installed':14s}{role} ({how})")
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    print(
        f"\ndevices     cpu threads={torch.get_num_threads()}" + (f", cuda: {gpus}" if cuda else ", no CUDA")
    )
    print("engines     embedded: usable" + (" (GPU)" if cuda else " (CPU)"))
    print(
        f"            sglang: {'usable' if _version('sglang') and cuda else 'not usable (needs sglang + CUDA)'}"
    )
    print(f"backends    torch (1 rank): usable; weight sync: {'nccl' if cuda else 'gloo'}")
    if check_ray:
        from relax.orchestration.local_ray import init_local_ray
        from relax.orchestration.service import set_ray_env_defaults

        set_ray_env_defaults()
        import ray

        started = not ray.is_initialized()
        if started:  # started again if a busy machine makes its node time out (local_ray.py)
            init_local_ray(
                num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False
            )
        print(f"\nray         nodes={len(ray.nodes())} resources={ray.cluster_resources()}")
        if started:
            ray.shutdown()
    return 0

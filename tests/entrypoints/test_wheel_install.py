"""A wheel built from the repository, installed into a fresh virtual environment outside it, works as a
user gets it from `pip install`: `relax --version`, `python -m relax --help`, an example config from the
installed package, two training steps of it on a tiny model (CPU), and `relax export` of the result.

No network: the wheel is built with the running environment's setuptools (`--no-build-isolation`) and
installed with `--no-deps --no-index`; the fresh venv sees the running environment's packages (torch,
ray, ...) through a `.pth` file, but not its Relax (an editable install's hook is not read that way)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import relax

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(venv, environment to run it in) with the repository's wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    dist = tmp / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(ROOT),
        ],
        tmp,
        env,
    )
    (wheel,) = dist.glob("relax-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env
        ).stdout.strip()
    )
    shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_shared_packages.pth").write_text("".join(p + "\n" for p in sorted(shared)))
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        tmp,
        env,
    )
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return venv, env


def test_wheel_in_a_fresh_venv_runs_the_cli_and_trains(installed, tmp_path):
    venv, env = installed
    work = tmp_path / "work"  # outside the repository
    work.mkdir()
    bin_ = venv / "bin"
    where = _run([str(bin_ / "python"), "-c", "import relax; print(relax.__file__)"], work, env).stdout
    assert where.strip().startswith(str(venv)), where  # the installed copy, not the checkout

    assert _run([str(bin_ / "relax"), "--version"], work, env).stdout.strip() == f"relax {relax.__version__}"
    same = "import importlib.metadata as m, relax; assert m.version('relax') == relax.__version__"
    _run([str(bin_ / "python"), "-c", same], work, env)  # the wheel's metadata has the one version
    assert "examples" in _run([str(bin_ / "python"), "-m", "relax", "--help"], work, env).stdout
    assert "quickstart" in _run([str(bin_ / "relax"), "examples", "list"], work, env).stdout
    _run([str(bin_ / "relax"), "examples", "copy", "quickstart", "."], work, env)
    config = work / "quickstart.yaml"
    assert config.read_text() == (ROOT / "examples" / "quickstart.yaml").read_text()

    # the model and data the example's opening comment asks for (the tiny default model: fast)
    _run([str(bin_ / "relax"), "tiny-model", "--out", ".relax/assets/quickstart-qwen2"], work, env)
    _run(
        [str(bin_ / "relax"), "data", "arith", "--out", ".relax/assets/arith_train.jsonl", "--n", "200"],
        work,
        env,
    )
    overrides = [
        "trainer.num_steps=2",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=2",
        "trainer.num_mini_batches=1",
        "eval.sets=[]",
        "ops.progress=false",
        "ops.tensorboard=false",
        "resources.num_cpus=8",
    ]
    trained = _run([str(bin_ / "relax"), "train", str(config), *overrides], work, env, timeout=480)
    run_dir = work / "runs" / "quickstart"
    # the console shows Relax's progress, not Ray Serve's internals (in runs/quickstart/logs/serve), and a
    # clean exit kills nothing that warns
    console = trained.stdout + trained.stderr
    assert "ServeController" not in console and "ray.kill" not in console, console[-3000:]
    assert "done at step 2" in console and any((run_dir / "logs" / "serve").glob("controller_*.log"))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("time" in r for r in rows)

    (ckpt,) = sorted((run_dir / "checkpoints").glob("step_*"))[-1:]
    out = _run(
        [
            str(bin_ / "relax"),
            "export",
            str(ckpt),
            "--config",
            str(run_dir / "config.yaml"),
            "--out",
            "exported",
        ],
        work,
        env,
    )
    assert (work / "exported" / "config.json").exists()
    assert "export" in out.stderr and "4/4" in out.stderr  # the stage bar ran to its end

"""The fault-injection harness: start a real `relax train` run, inject one fault at one phase, judge the
outcome (docs/faults.md has the matrix it runs and its last table).

A cell is (fault, phase, mode, hosts). `run_cell` starts the toy run (the quickstart's GRPO set-up on the
tiny model: 6 steps of 8 prompts x 4 samples, a checkpoint every 2 steps) as a subprocess on this host or
as the driver on host 1 of the simulated three-host cluster (tests/cluster/netns.py), reaches the phase
through the phase hook (tests/faults/hook/sitecustomize.py), injects the fault and returns a `Result`
whose outcome is one of

* "finished, exact steps": rc 0, metrics.jsonl holds steps 1..N once each, every step trained exactly
  prompts x samples samples, the final checkpoint is complete;
* "stopped, named cause": rc != 0, the cause (a regex per fault) in the run's output, the exit within the
  fault's bound after the fault (the harness's wait timeout is the bound: no wall-clock assertion), no
  process of the run left behind, the steps logged a gap-free prefix;
* "resumed, exact steps" (the driver killed): nothing of the run left behind, and `--resume` finishes
  with steps 1..N once each;

or "FAILS: <what differed>". The harness never raises for a failing cell; it always removes what it
started (processes by pid, namespaces, tmpfs mounts).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from tests.faults.cells import (
    CKPT_EVERY,
    FINISH_S,
    PROMPTS,
    REWARD_STALL_S,
    SAMPLES,
    STEPS,
    STOP_GRACE_S,
    Cell,
    CellFailed,
    Expect,
    Result,
    expected,
    span,
)
from tests.faults.places import (
    REPO,
    TITLES,
    Assets,
    Cluster,
    OneHost,
    kill_pids,
    process_title,
)

CONFIG = REPO / "tests" / "toy_arith.yaml"

ARM_AFTER = 2  # the fault is armed once this step is logged: a checkpoint exists, the run is warm
HOLD_S = 2.0  # how long the hooked call waits once hit, so the fault lands inside the phase
# phases Relax marks itself with a fault point (relax/utils/faults.py, the same RELAX_FAULT_DIR); the
# others are reached through the test-only hook (tests/faults/hook/sitecustomize.py)
POINTS = {"rollout": "router.request", "push": "weight_push.push"}
START_S = 300.0  # start-up and the steps before the fault (the machine may be loaded)


# -- helpers (also used by tests/ops/test_faults_e2e.py and tests/e2e/test_interrupt.py) ---------------
def run_overrides(model: Path, data: Path, out_dir: Path, name: str) -> list[str]:
    """The fault runs' common settings: a small fast run, heartbeats often, no progress bar."""
    return [
        f"model.path={model}",
        f"data.train_files=[{data}]",
        f"run.output_dir={out_dir}",
        f"run.name={name}",
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.n_samples_per_prompt={SAMPLES}",
        "rollout.engine_threads=1",
        "trainer.threads=1",
        "ops.progress=false",
        "ops.tensorboard=false",
        "ops.heartbeat_interval_s=0.5",
        "ops.heartbeat_timeout_s=15",
        "eval.sets=[]",
        "eval.before_train=false",
    ]


def metric_rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The rows of metrics.jsonl (a line still being written is skipped)."""
    path = Path(run_dir) / name
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def steps_logged(run_dir: Path, name: str = "metrics.jsonl") -> list[int]:
    return [r["step"] for r in metric_rows(run_dir, name)]


def wait_for(cond: Callable[[], object], what: str, timeout_s: float = START_S, poll_s: float = 0.05):
    """`cond()`'s first true value; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(poll_s)
    raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")


# -- one cell --------------------------------------------------------------------------------------
class Run:
    """One started run of a cell: where it writes, how to reach its phases."""

    def __init__(self, cell: Cell, place: OneHost | Cluster, cell_dir: Path, out_dir: Path) -> None:
        self.cell, self.place, self.cell_dir = cell, place, cell_dir
        self.run_dir = out_dir / "run"
        self.log = cell_dir / "run.log"
        self.fault_dir = place.fault_dir
        self.proc: subprocess.Popen | None = None
        self.fault_at: float | None = None  # wall clock (metrics rows carry wall-clock times)
        self.notes: list[str] = []

    def output(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return re.sub(r"\x1b\[[0-9;]*m", "", text)  # Ray colours its workers' prefixes

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_steps(self, n: int) -> None:
        def reached() -> bool:
            if not self.alive():
                raise CellFailed(f"the run ended (rc {self.proc.returncode}) before step {n}")
            return len(steps_logged(self.run_dir)) >= n

        wait_for(reached, f"step {n}", START_S, poll_s=0.2)

    def reach(self, phase: str) -> dict:
        """Wait until the run is in `phase`; returns the hit (pid, time)."""
        if phase == "startup":  # the roles are being deployed: no step yet
            wait_for(lambda: "starting roles" in self.output() or not self.alive(), "start-up", START_S, 0.1)
            if not self.alive():
                raise CellFailed(f"the run ended (rc {self.proc.returncode}) during start-up")
            return {"pid": self.proc.pid, "time": time.time()}
        self.wait_steps(ARM_AFTER)
        if phase in POINTS:
            return self._hold_at(phase, POINTS[phase])
        (self.fault_dir / "arm").write_text(json.dumps({"phase": phase, "hold_s": HOLD_S}))
        hit_file = self.fault_dir / "hit"

        def hit() -> dict | None:
            if not self.alive():
                raise CellFailed(f"the run ended (rc {self.proc.returncode}) before the {phase} phase")
            return json.loads(hit_file.read_text()) if hit_file.exists() else None

        try:
            return wait_for(hit, f"the {phase} phase", START_S, poll_s=0.02)
        except TimeoutError as e:
            raise CellFailed(f"the {phase} phase never came (hook not hit): {e}") from e

    def _hold_at(self, phase: str, name: str) -> dict:
        """Relax's own fault point `name` (relax/utils/faults.py): the process that reaches it waits
        there until `disarm` releases it."""
        from relax.utils import faults

        faults.hold(self.fault_dir, name)
        reached = self.fault_dir / f"{name}.reached"

        def pid() -> int | None:
            if not self.alive():
                raise CellFailed(f"the run ended (rc {self.proc.returncode}) before the {phase} phase")
            text = reached.read_text().strip() if reached.exists() else ""
            return int(text) if text else None

        try:
            return {
                "phase": phase,
                "pid": wait_for(pid, f"the {phase} phase", START_S, 0.02),
                "time": time.time(),
            }
        except TimeoutError as e:
            raise CellFailed(f"the {phase} phase never came (fault point {name} not reached): {e}") from e

    def disarm(self) -> None:
        """The hook's phase off, and a process held at a fault point let go."""
        from relax.utils import faults

        (self.fault_dir / "arm").unlink(missing_ok=True)
        for name in POINTS.values():
            faults.release(self.fault_dir, name)

    def kill_role(self, role: str, hit: dict) -> None:
        if role == "driver":
            pid = self.proc.pid
        else:
            pid = self.place.find(role)
            if pid is None:
                raise CellFailed(f"no {role} process found ({TITLES[role]})")
        self.fault_at = time.time()
        os.kill(pid, signal.SIGKILL)
        self.notes.append(f"killed {role} pid {pid} in {hit.get('phase', 'startup')}")


def run_cell(cell: Cell, work: Path, assets: Assets, keep: bool = False) -> Result:
    """Run one cell in `work/<slug>`; never raises (a harness error is a FAILS result). A run that
    failed before its fault was injected (Ray not starting on an overloaded host) is tried once more:
    it says nothing about the fault."""
    result = _attempt(cell, work, assets, keep)
    if not result.ok and not result.injected:
        first = result.outcome
        result = _attempt(cell, work, assets, keep)
        result.notes.append(f"second try; the first failed before the fault: {first[:150]}")
    return result


def _attempt(cell: Cell, work: Path, assets: Assets, keep: bool) -> Result:
    cell_dir = work / cell.slug
    shutil.rmtree(cell_dir, ignore_errors=True)
    fault_dir = cell_dir / "fault"
    fault_dir.mkdir(parents=True)
    t0 = time.monotonic()
    mount = run = None
    try:
        out_dir = cell_dir / "out"
        out_dir.mkdir()
        if cell.fault == "disk_full":
            mount = out_dir
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=24m", "relax-faults", str(out_dir)], check=True
            )
        place = Cluster(fault_dir, cell_dir) if cell.hosts == "cluster" else OneHost(fault_dir)
        with place:
            run = Run(cell, place, cell_dir, out_dir)
            result = _drive(run, assets)
    except CellFailed as e:
        result = Result(cell, f"FAILS: {e}")
    except Exception as e:  # noqa: BLE001 - a harness error is reported as the cell's failure
        result = Result(cell, f"FAILS: harness error {type(e).__name__}: {e}")
    finally:
        if mount is not None:
            _unmount(mount)
    result.injected = run is not None and run.fault_at is not None
    if run is not None and not result.steps:
        result.steps = span(steps_logged(run.run_dir))
    result.seconds = round(time.monotonic() - t0, 1)
    result.log = str(cell_dir / "run.log")
    if result.ok and not keep:
        shutil.rmtree(cell_dir / "out", ignore_errors=True)
    return result


def _unmount(path: Path) -> None:
    for _ in range(20):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy still: detach it


def _args(cell: Cell, assets: Assets, out_dir: Path) -> list[str]:
    args = [
        str(CONFIG),
        *run_overrides(assets.model, assets.data, out_dir, "run"),
        f"schedule.mode={cell.mode}",
        f"trainer.num_steps={STEPS}",
        f"ops.checkpoint_interval={CKPT_EVERY}",
        f"ops.stop_grace_s={STOP_GRACE_S:g}",
        "ops.max_global_restarts=2",
    ]
    if cell.mode != "colocate":
        args.append("schedule.max_staleness=1")
    if cell.phase == "eval":
        eval_set = f"{{name: arith, files: [{assets.eval_data}], max_prompts: 4}}"
        args += [f"eval.sets=[{eval_set}]", f"eval.interval={CKPT_EVERY}"]
    if cell.fault == "refused_group":  # steps of a second, so the run outlives the operation
        args.append("schedule.debug_train_delay_s=1")
    if cell.fault in ("hung_reward", "reward_stall"):
        args.append("reward.name=tests.faults.rewards:hang_when_armed")
        args += (
            ["reward.timeout_s=2"]
            if cell.fault == "hung_reward"
            else ["reward.timeout_s=3600", f"ops.step_timeout_s={REWARD_STALL_S}"]
        )
    return args


def _drive(run: Run, assets: Assets) -> Result:
    cell, expect = run.cell, expected(run.cell)
    args = _args(cell, assets, run.run_dir.parent)
    run.proc = run.place.start(args, run.log)
    fake = None
    try:
        if cell.fault == "refused_group":
            from tests.faults.fake_engine import FakeEngine

            fake = FakeEngine().__enter__()
        try:
            _inject(run, fake)
        except Exception as e:  # noqa: BLE001 - the run may have died under the fault: say how
            if run.proc.poll() is None:
                try:
                    run.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            msg = str(e) if isinstance(e, CellFailed) else f"{type(e).__name__}: {e}"
            if run.proc.poll() is not None:
                msg += f"; the run ended rc {run.proc.returncode}: {_last_error(run.output())}"
            raise CellFailed(msg) from e
        wait_s = expect.bound_s if expect.kind != "finished" else FINISH_S
        try:
            rc = run.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            raise CellFailed(_overdue(run, wait_s, expect.kind == "stopped")) from None
        exited_at = time.time()
        if expect.kind == "resumed":
            return _resumed(run, args)
        if expect.kind == "stopped":
            return _stopped(run, rc, expect, exited_at)
        result = _finished(run, rc)
        if fake is not None:
            _check_refusal(run, fake, result)
        return result
    finally:
        run.disarm()
        if run.alive():
            run.proc.kill()
        if fake is not None:
            fake.__exit__()


def _inject(run: Run, fake) -> None:
    fault, phase = run.cell.fault, run.cell.phase
    if fault == "refused_group":
        _scale_out_to(run, fake)
        return
    hit = run.reach("reward" if fault in ("hung_reward", "reward_stall") else phase)
    if fault.startswith("kill:"):
        run.kill_role(fault.split(":", 1)[1], hit)
    elif fault == "sigterm2":
        run.fault_at = time.time()
        run.proc.send_signal(signal.SIGTERM)  # to the driver, as a scheduler or `kill` sends it
        time.sleep(1.0)
        run.proc.send_signal(signal.SIGTERM)
    elif fault == "host_lost":
        host = run.place.sim.hosts[-1]
        pids = run.place.host_pids(host.index)
        on_host = sorted({t for p in pids for t in TITLES.values() if process_title(p).startswith(t)})
        run.fault_at = time.time()
        kill_pids(pids)
        run.notes.append(f"host {host.index} lost with {', '.join(on_host) or 'no role'}")
    elif fault == "disk_full":
        run.fault_at = time.time()
        _fill(run.run_dir.parent)
        run.notes.append("tmpfs filled during the checkpoint")
    elif fault in ("hung_reward", "reward_stall"):
        run.fault_at = hit["time"]
        return  # armed for good: a hung reward function hangs on every call
    run.disarm()


def _overdue(run: Run, bound_s: float, wait_more: bool) -> str:
    """The run outlived its bound: where it was, how busy the machine was (a bound in seconds means
    little on an overloaded host) and, for a run that should have stopped, how much longer it took
    (up to two more minutes)."""
    load = os.getloadavg()[0]
    where = f"steps {span(steps_logged(run.run_dir))}, last error: {_last_error(run.output())}"
    if wait_more:
        try:
            run.proc.wait(timeout=120)
            took = time.time() - run.fault_at if run.fault_at else float("nan")
            return f"exited {took:.1f}s after the fault, past the bound of {bound_s:.0f}s (load average {load:.0f}); {where}"
        except subprocess.TimeoutExpired:
            bound_s += 120
    return f"still running {bound_s:.0f}s after the fault (load average {load:.0f}); {where}"


def _fill(folder: Path) -> None:
    """Write a file until the file system is full."""
    chunk = b"\0" * (1 << 20)
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass


def _scale_out_to(run: Run, fake) -> None:
    """After step ARM_AFTER: an external scale-out to the fake engine; the operation must fail alone."""
    import httpx

    from relax.utils.auth import auth_headers, read_run_token

    run.wait_steps(ARM_AFTER)
    api = json.loads((run.run_dir / "endpoints.json").read_text())["elastic_api"]
    headers = auth_headers(read_run_token(str(run.run_dir)))
    run.fault_at = time.time()
    r = httpx.post(
        f"{api}/v1/engines/scale_out",
        json={"mode": "external", "engine_urls": [fake.url]},
        headers=headers,
        timeout=30,
    )
    if r.status_code >= 300:
        raise CellFailed(f"scale_out answered {r.status_code}: {r.text[:300]}")
    op_id = r.json()["request_id"]

    def done() -> dict | None:
        try:
            state = httpx.get(f"{api}/v1/operations/{op_id}", headers=headers, timeout=30).json()
        except httpx.TransportError:
            if run.alive():
                raise
            # the run went on and ended first (its API with it): the Rollout logged how the op ended
            end = re.search(rf"elastic scale_out {op_id} (\w+): (.*)", run.output())
            if end is None:
                raise CellFailed(f"the run ended (rc {run.proc.returncode}) during the scale-out") from None
            return {"state": end.group(1), "error": end.group(2), "done": True}
        return state if state.get("done") else None

    op = wait_for(done, "the scale-out to end", 180, poll_s=0.5)
    run.notes.append(f"scale-out {op.get('state')}: {str(op.get('error'))[:120]}")
    if op.get("state") != "failed":
        raise CellFailed(f"the scale-out to a refusing engine ended {op.get('state')!r}, not failed")


def _check_refusal(run: Run, fake, result: Result) -> None:
    if "/init_weights_update_group" not in fake.paths():
        result.outcome = "FAILS: the weight-sync group was never offered to the fake engine"
    token = (run.run_dir / "secrets" / "run_token").read_text().strip()
    leaked = any(r["authorization"] and token in r["authorization"] for r in fake.requests)
    result.notes.append("external engine got the run's token" if leaked else "run token not sent")


def _rows_check(run: Run) -> tuple[list[dict], list[str]]:
    rows = metric_rows(run.run_dir)
    steps = [r["step"] for r in rows]
    problems = []
    if steps != list(range(1, STEPS + 1)):
        problems.append(f"steps {span(steps)}, not 1-{STEPS} once each")
    bad = [r["step"] for r in rows if r.get("rollout/num_samples") != float(PROMPTS * SAMPLES)]
    if bad:
        problems.append(f"steps {bad} trained another number of samples than {PROMPTS * SAMPLES}")
    return rows, problems


def _finished(run: Run, rc: int) -> Result:
    rows, problems = _rows_check(run)
    if rc != 0:
        problems.insert(0, f"rc {rc}: {_last_error(run.output())}")
    final = run.run_dir / "checkpoints" / f"step_{STEPS:06d}" / "COMPLETE"
    if not final.exists():
        problems.append(f"no complete checkpoint of step {STEPS}")
    if run.cell.fault == "hung_reward" and not any(r.get("reward/timeouts") for r in rows):
        problems.append("no reward timed out: the hang never reached the scorer")
    result = _measured(run, rows, problems, "finished, exact steps")
    last = rows[-1] if rows else {}
    for key in ("health/engine_restarts", "health/role_restarts"):
        if last.get(key):
            result.notes.append(f"{key.split('/')[1]} {last[key]:g}")
    if restarts := len(re.findall(r"global restart \d+ of \d+", run.output())):
        result.notes.append(f"global restarts {restarts}")
    if (run.run_dir / "metrics.superseded.jsonl").exists():
        redone = steps_logged(run.run_dir, "metrics.superseded.jsonl")
        result.notes.append(f"global restart (steps {span(redone)} redone)")
    if run.cell.fault == "hung_reward":
        result.notes.append(f"reward timeouts {sum(r.get('reward/timeouts', 0) for r in rows):g}")
    return result


def _measured(run: Run, rows: list[dict], problems: list[str], ok: str) -> Result:
    samples = sum(r.get("rollout/num_samples", 0) for r in rows)
    after = [r for r in rows if run.fault_at is not None and r.get("time", 0) > run.fault_at]
    # a row written just after the fault may be of a step done before it (metrics are flushed behind
    # the steps): the first row that counts the restart, when the run counted one, is the recovery
    counted = [r for r in after if any(r.get(k) for k in ("health/engine_restarts", "health/role_restarts"))]
    after = [r["time"] for r in counted or after]
    return Result(
        run.cell,
        "FAILS: " + "; ".join(problems) if problems else ok,
        recover_s=round(min(after) - run.fault_at, 1) if after else None,
        steps=span([r["step"] for r in rows]),
        samples=f"{samples:g}/{len(rows) * PROMPTS * SAMPLES}",
        notes=run.notes,
    )


def _stopped(run: Run, rc: int, expect: Expect, exited_at: float) -> Result:
    out = run.output()
    problems = []
    if rc == 0:
        problems.append("rc 0: the run did not stop")
    if not re.search(expect.cause, out):
        problems.append(f"cause /{expect.cause}/ not in the output; last error: {_last_error(out)}")
    left = _left_behind(run)
    if left:
        problems.append(f"{len(left)} processes left running 30s after the exit ({left[0]})")
    rows = metric_rows(run.run_dir)
    steps = [r["step"] for r in rows]
    if steps != list(range(1, len(steps) + 1)):
        problems.append(f"steps logged {span(steps)} are not a gap-free prefix")
    result = _measured(run, rows, problems, "stopped, named cause")
    result.recover_s = round(exited_at - run.fault_at, 1) if run.fault_at else None
    match = re.search(expect.cause + r".*", out)
    result.notes.append(f"rc {rc}" + (f": {match.group(0)[:100]}" if match else ""))
    return result


def _resumed(run: Run, args: list[str]) -> Result:
    killed_at = time.monotonic()
    left = _left_behind(run)
    if left:  # how long they stay (Ray's agents watch their raylet), then ours to remove
        while run.place.leftovers(run.proc) and time.monotonic() - killed_at < 120:
            time.sleep(1)
        remain = run.place.leftovers(run.proc)
        gone = (
            f"still there {time.monotonic() - killed_at:.0f}s after"
            if remain
            else (f"gone {time.monotonic() - killed_at:.0f}s after")
        )
        run.notes.append(f"leftovers {gone} the kill")
        kill_pids(remain)
    before = steps_logged(run.run_dir)
    run.notes.append(f"driver killed after step {before[-1] if before else 0}; resumed")
    run.proc = run.place.start([*args, "--resume"], run.log)
    rc = run.proc.wait(timeout=FINISH_S)
    result = _finished(run, rc)
    if left:
        what = f"{len(left)} processes of the run left 30s after the driver was killed ({', '.join(left)})"
        result.outcome = (f"{result.outcome}; " if not result.ok else "FAILS: ") + what
    if result.ok:
        result.outcome = "resumed, exact steps"
    return result


def _left_behind(run: Run) -> list[str]:
    deadline = time.monotonic() + 30
    while (left := run.place.leftovers(run.proc)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [process_title(p)[:60] for p in sorted(left)]


def _last_error(out: str) -> str:
    """The last line that looks like an error (the cause a user would read first)."""
    lines = [
        ln.strip()
        for ln in out.splitlines()
        if re.search(r"(Error|Exception|error:|failed|stalled|No space|relax train:)", ln)
    ]
    return lines[-1][:300] if lines else (out.strip().splitlines() or ["(no output)"])[-1][:300]


def new_work_dir(base: Path | None = None) -> Path:
    return Path(base or "/tmp") / f"relax-faults-{uuid.uuid4().hex[:8]}"

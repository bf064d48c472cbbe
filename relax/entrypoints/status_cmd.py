"""`relax status RUN_DIR`: where a running (or finished) job stands: its step, reward and weight version
from `<run_dir>/metrics.jsonl`, and its inference engines with their health from the elastic API whose
URL the Rollout role wrote to `<run_dir>/endpoints.json`.

    relax status runs/quickstart          # a short report
    relax status runs/quickstart --json   # the same, as one JSON object
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REWARD_KEYS = ("rollout/reward_mean", "reward_mean")
STEP_TIME_KEY = "perf/step_time_s"  # the Controller's "step_time" phase (relax/ops/trace.py: perf/<name>_s)


def add_status_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("status", help="a run's step, reward, engines and their health")
    p.add_argument("run_dir", help="the run folder (<run.output_dir>/<run.name>)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the elastic API")
    p.add_argument(
        "--engine-key",
        metavar="URL",
        default=None,
        help="print the key the run sends to the engine at URL (http://host:port), to start an external "
        "engine with (RELAX_API_KEY=... relax engine serve, SGLang's --api-key), and exit; the run's "
        "token comes from RELAX_RUN_TOKEN or RUN_DIR/secrets/run_token",
    )
    p.set_defaults(func=status_command)
    return p


def last_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The last complete line of metrics.jsonl (a torn last line is skipped), or None."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    for line in reversed(path.read_text().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def collect(run_dir: Path, timeout_s: float = 5.0) -> dict[str, Any]:
    """Everything the report shows, as plain data."""
    import httpx

    out: dict[str, Any] = {"run_dir": str(run_dir), "step": None, "num_steps": None}
    metrics = last_metrics(run_dir)
    if metrics is not None:
        out["step"] = metrics.get("step")
        out["reward"] = next((metrics[k] for k in REWARD_KEYS if metrics.get(k) is not None), None)
        out["weight_version"] = metrics.get("weight_version")
        out["step_time_s"] = metrics.get(STEP_TIME_KEY)
        # the row's wall-clock time (JsonlSink writes it); older runs' rows have none: the file's mtime
        logged = metrics.get("time") or (run_dir / "metrics.jsonl").stat().st_mtime
        out["metrics_age_s"] = time.time() - logged
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        out["num_steps"] = cfg["trainer"]["num_steps"]
    except (OSError, KeyError, TypeError, ValueError):
        pass
    # The last step logged is the last step of the config: the run is over, and its engines with it, so
    # there is no API to ask (asking would only time out).
    out["finished"] = bool(out["num_steps"] and out["step"] is not None and out["step"] >= out["num_steps"])
    if out["finished"]:
        return out
    try:
        url = json.loads((run_dir / "endpoints.json").read_text())["elastic_api"]
    except (OSError, KeyError, ValueError):
        out["api_error"] = "no elastic API recorded in endpoints.json (rollout.elastic.enabled=false?)"
        return out
    out["api"] = url
    try:
        from relax.utils.auth import auth_headers, read_run_token

        headers = auth_headers(read_run_token(run_dir))
        with httpx.Client(base_url=url, timeout=timeout_s, headers=headers) as client:
            out["engines"] = client.get("/v1/engines").raise_for_status().json()["engines"]
            ops = client.get("/v1/operations").raise_for_status().json()["operations"]
        out["operation"] = ops[-1] if ops else None
    except httpx.HTTPError as e:
        out["api_error"] = (
            f"elastic API at {url} did not answer ({type(e).__name__}): the run has stopped"
            f"{_where(out)}, or its Rollout role is being restarted"
        )
    return out


def _where(s: dict[str, Any]) -> str:
    if s["step"] is None:
        return " before its first step"
    return f" at step {s['step']}" + (f" of {s['num_steps']}" if s.get("num_steps") else "")


def render(s: dict[str, Any]) -> str:
    lines = [f"run       {s['run_dir']}"]
    if s["step"] is None:
        lines.append("step      no step finished yet (metrics.jsonl is empty or missing)")
    else:
        total = f" / {s['num_steps']}" if s.get("num_steps") else ""
        age = f"   (last step logged {s['metrics_age_s']:.0f}s ago)" if "metrics_age_s" in s else ""
        lines.append(f"step      {s['step']}{total}{age}")
        if isinstance(s.get("step_time_s"), (int, float)):
            lines.append(f"step time {s['step_time_s']:.2f} s")
        reward = s.get("reward")
        lines.append(f"reward    {reward:.4f}" if isinstance(reward, (int, float)) else "reward    -")
        if s.get("weight_version") is not None:
            lines.append(f"weights   v{s['weight_version']}")
    if s.get("finished"):
        lines.append(f"state     finished: all {s['num_steps']} steps done")
        return "\n".join(lines)
    if "api_error" in s:
        lines.append(f"engines   unknown: {s['api_error']}")
        return "\n".join(lines)
    engines = s.get("engines", [])
    healthy = sum(e["healthy"] for e in engines)
    lines.append(f"engines   {len(engines)} ({healthy} healthy)   API {s['api']}")
    header = ("url", "origin", "state", "healthy", "version", "in-flight", "served")
    rows = [header] + [
        (
            e["url"],
            e["origin"] + (" (protected)" if e["protected"] else ""),
            e["state"],
            "yes" if e["healthy"] else "NO",
            str(e["weight_version"]),
            str(e["outstanding"]),
            str(e["served"]),
        )
        for e in engines
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    op = s.get("operation")
    if op is not None:
        lines.append(
            f"last op   {op['request_id']} {op['kind']} {op['state']}: {op['error'] or op['message']}"
        )
    return "\n".join(lines)


def status_command(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if args.engine_key:
        return print_engine_key(run_dir, args.engine_key)
    if not run_dir.is_dir():
        print(f"relax status: no run folder {run_dir}; pass <run.output_dir>/<run.name>", file=sys.stderr)
        return 2
    summary = collect(run_dir, args.timeout)
    print(json.dumps(summary, indent=1) if args.json else render(summary))
    return 0


def print_engine_key(run_dir: Path, url: str) -> int:
    """An external engine's key (relax/utils/auth.py: `engine_key`): it opens that engine alone, so the
    engine's operator never needs the run's token."""
    from relax.utils.auth import engine_key, read_run_token

    token = read_run_token(run_dir)
    if token is None:
        print(
            f"relax status: no run token: set RELAX_RUN_TOKEN, or pass the run folder holding "
            f"secrets/run_token (not {run_dir})",
            file=sys.stderr,
        )
        return 2
    print(engine_key(token, url))
    return 0

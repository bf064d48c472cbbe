"""Where the test suite's CPU and time go, from a `RELAX_TEST_CPU_LOG` file (tests/cpu_log.py).

    RELAX_TEST_CPU_LOG=/tmp/cpu.jsonl bash scripts/test.sh     # as root: each queue in its own cgroup
    python benchmarks/suite_cpu.py /tmp/cpu.jsonl [--top 25] [--base OLD.jsonl]

Prints, per queue, the tests' CPU-seconds, wall seconds and their ratio (cores kept busy); the files
and the single tests that cost the most CPU; with `--base`, each file's CPU and wall against an earlier
log (a before/after that the machine's speed of the day moves less than wall time). The suite is bound
by CPU on two cores, so a file's CPU-seconds, not its wall time beside the other queue, say what it
costs the suite.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_file(rows: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        f = out[r["test"].split("::")[0]]
        f[0] += r["cpu_s"] or 0.0
        f[1] += r["wall_s"]
    return out


def report(rows: list[dict], top: int, base: list[dict] | None) -> str:
    lines = []
    queues: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        q = queues[r["queue"]]
        q[0] += r["cpu_s"] or 0.0
        q[1] += r["wall_s"]
        q[2] += 1
    lines.append(f"{'queue':8s} {'tests':>6s} {'cpu s':>9s} {'wall s':>9s} {'cores':>6s}")
    for name, (cpu, wall, n) in sorted(queues.items()):
        lines.append(f"{name:8s} {n:6d} {cpu:9.1f} {wall:9.1f} {cpu / max(wall, 1e-9):6.2f}")
    lines.append(f"{'all':8s} {len(rows):6d} {sum(q[0] for q in queues.values()):9.1f}")
    if all(r["cpu_s"] is None for r in rows):
        lines.append("(no CPU figures: the queues had no cgroup of their own; see tests/cpu_log.py)")
    files = by_file(rows)
    old = by_file(base) if base is not None else {}
    lines += ["", f"files by CPU (top {top})" + (": now, then the base log's" if base else "")]
    for name, (cpu, wall) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        line = f"{cpu:8.1f} cpu s {wall:8.1f} s  {name}"
        if name in old:
            line += f"   (base {old[name][0]:.1f} cpu s, {old[name][1]:.1f} s)"
        lines.append(line)
    lines += ["", f"tests by CPU (top {top})"]
    for r in sorted(rows, key=lambda r: -(r["cpu_s"] or 0.0))[:top]:
        lines.append(f"{r['cpu_s'] or 0.0:8.1f} cpu s {r['wall_s']:8.1f} s  [{r['queue']}] {r['test']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path, help="the RELAX_TEST_CPU_LOG file")
    ap.add_argument("--top", type=int, default=25, help="how many files and tests to list")
    ap.add_argument("--base", type=Path, help="an earlier log to compare each file with")
    args = ap.parse_args()
    print(report(load(args.log), args.top, load(args.base) if args.base else None))


if __name__ == "__main__":
    main()

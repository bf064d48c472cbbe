"""Run the fault-injection matrix and write its table (docs/faults.md explains the cells).

    python scripts/fault_matrix.py                        # every cell, table into docs/faults.md
    python scripts/fault_matrix.py --modes colocate --faults kill:engine sigterm2 --hosts one
    python scripts/fault_matrix.py --out /tmp/faults.json # results as JSON instead

Cells run one after another (each starts a real `relax train`; a cell takes about a minute on two
cores, a cluster cell two to three). It prints one line per cell, stops starting cells once
`--budget-min` is spent (the rest are listed as not run), and removes every process, namespace and mount
it made, also when interrupted. Exit status: 0 when every cell that ran met its promise, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.faults.cells import MODES, Cell, Result  # noqa: E402
from tests.faults.harness import new_work_dir, run_cell  # noqa: E402
from tests.faults.places import make_assets  # noqa: E402

ONE, CLUSTER = "one", "cluster"

# In the order they run: the findings and one cell of each fault first, so a budget that runs
# out leaves variations out, not those.
MATRIX = [
    *(Cell("kill:engine", "rollout", m) for m in MODES),
    Cell("kill:engine", "push", "colocate"),
    Cell("refused_group", "push", "colocate"),
    Cell("disk_full", "checkpoint", "colocate"),
    Cell("sigterm2", "startup", "colocate"),
    Cell("sigterm2", "update", "hybrid"),
    Cell("kill:actor", "update", "colocate"),
    Cell("kill:actor", "update", "fully_async"),
    Cell("host_lost", "rollout", "fully_async", CLUSTER),
    Cell("kill:actor_fwd", "update", "fully_async"),
    Cell("kill:rollout", "rollout", "colocate"),
    Cell("kill:metrics", "update", "colocate"),
    Cell("kill:driver", "update", "colocate"),
    Cell("hung_reward", "reward", "colocate"),
    Cell("reward_stall", "reward", "colocate"),
    Cell("kill:engine", "eval", "colocate"),
    Cell("kill:actor", "checkpoint", "colocate"),
    Cell("kill:engine", "rollout", "fully_async", CLUSTER),
    Cell("sigterm2", "update", "colocate", CLUSTER),
    Cell("kill:engine", "push", "fully_async"),
    Cell("refused_group", "push", "fully_async"),
    Cell("sigterm2", "rollout", "colocate"),
    Cell("sigterm2", "checkpoint", "colocate"),
    Cell("sigterm2", "rollout", "fully_async"),
    Cell("kill:actor", "update", "hybrid"),
    Cell("kill:actor", "push", "fully_async"),
    Cell("kill:rollout", "rollout", "fully_async"),
    Cell("hung_reward", "reward", "fully_async"),
]

BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"


def select(args: argparse.Namespace) -> list[Cell]:
    def wanted(cell: Cell) -> bool:
        fault_ok = not args.faults or any(
            cell.fault == f or cell.fault.startswith(f + ":") for f in args.faults
        )
        return (
            fault_ok
            and (not args.modes or cell.mode in args.modes)
            and (not args.phases or cell.phase in args.phases)
            and (args.hosts == "all" or cell.hosts == args.hosts)
        )

    return [c for c in MATRIX if wanted(c)]


def cell_text(text: str, limit: int = 240) -> str:
    """One line of a table cell: no newline or pipe, at most `limit` characters."""
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(results: list[Result], skipped: list[Cell]) -> str:
    head = "| fault | phase | mode | hosts | outcome | recover (s) | steps | samples | notes |"
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        c = r.cell
        recover = "" if r.recover_s is None else f"{r.recover_s:g}"
        notes, outcome = cell_text("; ".join(r.notes)), cell_text(r.outcome, 400)
        lines.append(
            f"| {c.fault} | {c.phase} | {c.mode} | {c.hosts} | {outcome} | {recover} | {r.steps} | "
            f"{r.samples} | {notes} |"
        )
    for c in skipped:
        lines.append(f"| {c.fault} | {c.phase} | {c.mode} | {c.hosts} | not run (budget) | | | | |")
    return "\n".join(lines)


def write_markdown(
    path: Path, results: list[Result], skipped: list[Cell], command: str, took_s: float
) -> None:
    """Replace the part of `path` between the markers (the prose around it stays)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ok = sum(r.ok for r in results)
    block = "\n".join(
        [
            BEGIN,
            f"Run {now}, `{command}`, {len(results)} cells in {took_s / 60:.0f} min on "
            f"{os.cpu_count()} cores: {ok} met their promise, {len(results) - ok} failed"
            + (f", {len(skipped)} not run (budget)." if skipped else "."),
            "",
            table(results, skipped),
            END,
        ]
    )
    text = path.read_text() if path.exists() else f"# Fault-injection matrix\n\n{BEGIN}\n{END}\n"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="*", choices=MODES, help="only these modes")
    p.add_argument("--faults", nargs="*", help="only these faults (kill = every kill:<role>)")
    p.add_argument("--phases", nargs="*", help="only these phases")
    p.add_argument("--hosts", choices=[ONE, CLUSTER, "all"], default="all")
    p.add_argument("--out", default=str(REPO / "docs" / "faults.md"), help=".md (table) or .json")
    p.add_argument("--budget-min", type=float, default=60.0, help="start no cell after this many minutes")
    p.add_argument("--work", help="folder for the cells' runs (default: a new one under /tmp)")
    p.add_argument(
        "--keep", action="store_true", help="keep every cell's run folder (failed ones always stay)"
    )
    p.add_argument("--list", action="store_true", help="list the selected cells and exit")
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the cell in flight removes its processes, namespaces and mounts
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    cells = select(args)
    if args.list:
        print("\n".join(c.name for c in cells))
        return 0
    if any(c.hosts == CLUSTER for c in cells):
        from tests.cluster.netns import netns_unavailable

        if why := netns_unavailable():
            print(f"cluster cells left out: {why}", flush=True)
            cells = [c for c in cells if c.hosts != CLUSTER]
    work = Path(args.work) if args.work else new_work_dir()
    work.mkdir(parents=True, exist_ok=True)
    assets = make_assets(work / "assets")
    print(f"{len(cells)} cells; runs under {work}", flush=True)
    t0 = time.monotonic()
    results: list[Result] = []
    skipped: list[Cell] = []
    for i, cell in enumerate(cells, 1):
        if time.monotonic() - t0 > args.budget_min * 60:
            skipped = cells[i - 1 :]
            print(f"budget of {args.budget_min:g} min spent: {len(skipped)} cells not run", flush=True)
            break
        r = run_cell(cell, work, assets, keep=args.keep)
        results.append(r)
        recover = "" if r.recover_s is None else f" recover {r.recover_s:g}s"
        print(
            f"[{i}/{len(cells)}] {cell.name}: {r.outcome}{recover} steps {r.steps or '-'} "
            f"({r.seconds:.0f}s){' -- ' + '; '.join(r.notes) if r.notes else ''}",
            flush=True,
        )
    took = time.monotonic() - t0
    out = Path(args.out)
    command = "python scripts/fault_matrix.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if out.suffix == ".json":
        out.write_text(json.dumps([r.to_json() for r in results], indent=1))
    else:
        write_markdown(out, results, skipped, command.strip(), took)
    print(f"{sum(r.ok for r in results)}/{len(results)} cells met their promise; table in {out}", flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`relax examples`: the example configs, wherever Relax is installed from.

    relax examples list                  # name and first line of every example
    relax examples show quickstart       # print one to stdout
    relax examples copy quickstart [DEST]  # write quickstart.yaml (to DEST: a folder or a file name)

The examples are the repository's `examples/*.yaml`. A wheel ships them inside the package
(`relax/examples/`, see setup.py); a source checkout (or an editable install) reads the folder itself.
Each example's opening comment says how to make the model and data it trains on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import relax


def examples_dir() -> Path:
    """The folder holding the example configs: inside the installed package, else the checkout's."""
    package = Path(relax.__file__).resolve().parent
    for cand in (package / "examples", package.parent / "examples"):
        if any(cand.glob("*.yaml")):
            return cand
    raise FileNotFoundError(
        f"no example configs found (looked in {package / 'examples'} and {package.parent / 'examples'}); "
        "reinstall relax from a wheel or a full checkout"
    )


def list_examples() -> dict[str, Path]:
    """Example name (file stem) -> path, sorted by name."""
    return {p.stem: p for p in sorted(examples_dir().glob("*.yaml"))}


def example_path(name: str) -> Path:
    """The file of example `name` (with or without `.yaml`); KeyError listing the names otherwise."""
    found = list_examples()
    stem = name.removesuffix(".yaml")
    if stem not in found:
        raise KeyError(f"no example {name!r}; the examples are: {', '.join(found)}")
    return found[stem]


def summary(path: Path) -> str:
    """The first comment line of an example (what it trains)."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def add_examples_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("examples", help="list, show or copy the example configs")
    sub = p.add_subparsers(dest="examples_command", required=True)
    sub.add_parser("list", help="every example with its first line").set_defaults(fn=cmd_list)
    show = sub.add_parser("show", help="print one example config")
    show.add_argument("name", help="example name (see `relax examples list`)")
    show.set_defaults(fn=cmd_show)
    copy = sub.add_parser("copy", help="write an example config to a file you can edit")
    copy.add_argument("name", help="example name (see `relax examples list`)")
    copy.add_argument("dest", nargs="?", default=".", help="folder or file name (default: here)")
    copy.add_argument("--force", action="store_true", help="overwrite an existing file")
    copy.set_defaults(fn=cmd_copy)
    return p


def cmd_list(args: argparse.Namespace) -> int:
    found = list_examples()
    width = max(map(len, found), default=0)
    for name, path in found.items():
        print(f"{name:{width}s}  {summary(path)}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    try:
        print(example_path(args.name).read_text(), end="")
    except KeyError as e:
        print(f"relax examples: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


def cmd_copy(args: argparse.Namespace) -> int:
    try:
        src = example_path(args.name)
    except KeyError as e:
        print(f"relax examples: {e.args[0]}", file=sys.stderr)
        return 2
    dest = Path(args.dest)
    if dest.is_dir() or args.dest.endswith(("/", "\\")):
        dest = dest / src.name
    if dest.exists() and not args.force:
        print(f"relax examples: {dest} exists; pass --force to overwrite it", file=sys.stderr)
        return 2
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(src.read_text())
    print(f"wrote {dest}; its opening comment says how to make its model and data, then: relax train {dest}")
    return 0

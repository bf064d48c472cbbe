"""`relax examples`: the example configs, wherever Relax is installed from.

    relax examples list                  # name and first line of every example
    relax examples show quickstart       # print one to stdout
    relax examples copy quickstart [DEST]  # write quickstart.yaml (to DEST: a folder or a file name)
    relax examples prepare quickstart [--dir DIR]  # quickstart.yaml plus its tiny model and data in DIR

The examples are the repository's `examples/*.yaml`. A wheel ships them inside the package
(`relax/examples/`, see setup.py); a source checkout (or an editable install) reads the folder itself.

Each example's opening comment is its recipe: the `relax tiny-model ...` and `relax data ...` lines in it
make the model and data it trains on, and `prepare` runs exactly those lines in DIR (outputs relative to
DIR, as the config's paths are relative to the folder `relax train` runs in). So the comment a user reads
and the command they run cannot drift apart; a test prepares every example and checks that each path its
config names was written.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
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


RECIPE_COMMANDS = ("tiny-model", "data")  # the `relax` subcommands a recipe line may run


def recipe(path: Path) -> list[list[str]]:
    """The set-up commands of an example: every line of its opening comment block that reads
    `relax tiny-model ...` or `relax data ...`, as argument lists without the leading `relax` (a trailing
    `# note` is dropped)."""
    steps = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break  # the opening comment ends at the first line of YAML
        text = line.lstrip("#").strip()
        if any(text.startswith(f"relax {c} ") for c in RECIPE_COMMANDS):  # prose may hold lone quotes
            steps.append(shlex.split(text, comments=True)[1:])
    return steps


def _output_of(argv: list[str]) -> str:
    """The `--out` of a recipe command (each one writes one file or folder)."""
    for i, word in enumerate(argv):
        if word == "--out" and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith("--out="):
            return word.split("=", 1)[1]
    raise ValueError(f"recipe line `relax {shlex.join(argv)}` has no --out")


def prepare(name: str, dest: Path, *, force: bool = False, say: Callable[[str], object] = print) -> Path:
    """Write example `name`'s config into folder `dest` and run its recipe there (outputs under `dest`);
    an output that exists already is kept unless `force`. Returns the written config's path."""
    from relax.entrypoints.cli import build_parser

    src = example_path(name)
    dest.mkdir(parents=True, exist_ok=True)
    config = dest / src.name
    if force or not config.exists():
        config.write_text(src.read_text())
        say(f"wrote {config}")
    parser = build_parser()
    for argv in recipe(src):
        out = _output_of(argv)
        target = dest / out
        if target.exists() and not force:
            say(f"kept {target} (exists)")
            continue
        args = parser.parse_args(argv)
        args.out = str(target)  # the recipe's paths are relative to the example's folder
        say(f"relax {shlex.join(argv)}")
        rc = args.fn(args)
        if rc:
            raise RuntimeError(f"`relax {shlex.join(argv)}` failed (exit status {rc})")
    return config


def add_examples_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("examples", help="list, show, copy or prepare the example configs")
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
    prep = sub.add_parser(
        "prepare", help="write an example config plus the tiny model and data it trains on, ready to train"
    )
    prep.add_argument("name", help="example name (see `relax examples list`)")
    prep.add_argument("--dir", default=None, help="folder to prepare it in (default: ./NAME)")
    prep.add_argument("--force", action="store_true", help="overwrite the config and remake model and data")
    prep.set_defaults(fn=cmd_prepare)
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


def cmd_prepare(args: argparse.Namespace) -> int:
    try:
        src = example_path(args.name)
    except KeyError as e:
        print(f"relax examples: {e.args[0]}", file=sys.stderr)
        return 2
    dest = Path(args.dir if args.dir is not None else src.stem)
    config = prepare(src.stem, dest, force=args.force)
    print(f"ready: cd {shlex.quote(str(dest))} && relax train {config.name}")
    print(f"(the opening comment of {config.name} says what else it needs, if anything)")
    return 0

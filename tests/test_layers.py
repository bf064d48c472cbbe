"""The import graph of `relax/` follows the declared layers (ARCHITECTURE.md): a module imports only from
its own folder, from folders of lower layers, or from a folder beside it in its layer without closing a
cycle. Every import counts, those inside functions and under `TYPE_CHECKING` too: a lazy import upwards is
still a dependency upwards. A violation names the two files."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "relax"

# Top to bottom. A folder may import folders of the layers below its own; folders of one layer may import
# each other as long as no cycle forms. `backends` counts as two folders, one per backend kind.
LAYERS: list[set[str]] = [
    {"entrypoints"},
    {"orchestration"},
    {"roles"},
    {"ops", "fleet", "agentic"},
    {"rollout"},
    {"backends/training", "backends/inference", "backends"},
    {"weights", "dataplane"},
    {"engine_api"},
    {"config"},
    {"rewards", "algorithms"},
    {"data"},
    {"models", "utils"},
]
RANK = {folder: i for i, layer in enumerate(LAYERS) for folder in layer}


def folder_of(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    if len(parts) == 1:
        return ""  # relax/__init__.py, relax/__main__.py: the package itself
    return "/".join(parts[:2]) if parts[0] == "backends" and len(parts) > 2 else parts[0]


def module_folder(module: str) -> str | None:
    """`relax.backends.training.fsdp` -> `backends/training`; None outside relax or at its top."""
    parts = module.split(".")
    if parts[0] != "relax" or len(parts) < 2:
        return None
    if parts[1] == "backends" and len(parts) > 2:
        return f"backends/{parts[2]}"
    return parts[1]


def imported_modules(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    package = ["relax", *path.relative_to(ROOT).with_suffix("").parts]
    package = package[:-1]  # the package a relative import starts from (`__init__` or module alike)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from relax import x` and `from relax.backends import training` name submodules
            out += [
                (f"{name}.{a.name}" if name in ("relax", "relax.backends") else name, node.lineno)
                for a in node.names
            ]
    return out


def folder_edges() -> dict[tuple[str, str], list[str]]:
    """(from folder, to folder) -> 'file:line imports module' for every import between folders."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        src = folder_of(path)
        for module, line in imported_modules(path):
            dst = module_folder(module)
            if dst is None or dst == src or not src:
                continue
            edges[(src, dst)].append(f"relax/{path.relative_to(ROOT)}:{line} imports {module}")
    return edges


def test_every_folder_has_a_layer():
    folders = {folder_of(p) for p in ROOT.rglob("*.py")} - {""}
    assert folders <= set(RANK), f"folders missing from LAYERS (tests/test_layers.py): {folders - set(RANK)}"


def test_imports_point_down_the_layers():
    upward = [
        f"{where} ({src} is in layer {RANK[src]}, {dst} above it in layer {RANK[dst]})"
        for (src, dst), wheres in folder_edges().items()
        if RANK[dst] < RANK[src]
        for where in wheres
    ]
    assert not upward, "imports against the layer order:\n  " + "\n  ".join(upward)


def find_cycle(edges: dict[tuple[str, str], list[str]]) -> list[str] | None:
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst in edges:
        graph[src].add(dst)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_cycle_between_folders():
    edges = folder_edges()
    cycle = find_cycle(edges)
    if cycle:
        hops = [f"{a} -> {b}: {edges[(a, b)][0]}" for a, b in zip(cycle, cycle[1:], strict=False)]
        raise AssertionError("import cycle between folders:\n  " + "\n  ".join(hops))


def test_the_check_names_the_files_of_a_violation(tmp_path):
    """The checker itself: an upward import and a cycle are found and named by file."""
    edges = {("rollout", "roles"): ["relax/rollout/x.py:3 imports relax.roles.y"]}
    assert RANK["roles"] < RANK["rollout"]
    edges[("roles", "rollout")] = ["relax/roles/y.py:5 imports relax.rollout.x"]
    assert find_cycle(edges) in (["roles", "rollout", "roles"], ["rollout", "roles", "rollout"])
    assert find_cycle({("a", "b"): ["f"], ("b", "c"): ["g"]}) is None


def test_every_package_says_its_job_and_layer():
    """Each package's `__init__.py` opens with a docstring that says what the package holds and, in a
    `Layer:` line, what it may import."""
    for init in sorted(ROOT.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if init.parent == ROOT:
            assert doc, f"{init} has no docstring"
            continue
        assert "Layer:" in doc and len(doc.splitlines()) >= 3, f"{init}: job and `Layer:` line missing"

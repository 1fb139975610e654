"""The framework's import graph has no cycles and no upward imports between layers.

The layers are the table of docs/design.md §Architecture, encoded here in ``LAYERS`` (lowest first):
a module may import from its own layer and from layers below, never from a layer above; inside
layers 1 and 2 a package may import only packages to its left in its row. Nothing may form a cycle,
neither between modules nor between packages. Every ``import`` in a file's AST counts, including
the lazy ones inside functions: a lazy import hides a cycle from Python, not from the design.

The graph is read from the source of ``hybrid/``, ``models/`` and ``pretrain/`` (nothing is imported), so a
failure names the file, the line and the import statement that breaks the rule.

The entry points above the layers (``benchmarks/``, ``tools/``, ``launch/``) never import ``tests``: what
they share with the tests lives in the library (the multi-rank harness ``hybrid.testing``), and the
framework itself never imports that harness.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("hybrid", "models", "pretrain")
ENTRY_POINT_DIRS = ("benchmarks", "tools", "launch")

# docs/design.md §Architecture: one row per layer, lowest first. Rows whose order matters (a package
# may import only packages to its left) are lists; in a set the order is free (only no cycles).
LAYERS: list[tuple[str, list[str] | set[str]]] = [
    ("0 pure", {"hybrid.topology", "hybrid.layout", "hybrid.perf", "hybrid.processes",
                "hybrid.launch_env", "hybrid.adamw_config", "hybrid.precision_config",
                "hybrid.zero_policy", "hybrid.batch_schedule", "hybrid.muon_config"}),
    ("1 communication", ["hybrid.comm", "hybrid.shm_collectives", "hybrid.parallel_state"]),
    ("2 parallelism", ["hybrid.tensor_parallel", "hybrid.context_parallel", "hybrid.moe", "hybrid.recompute", "hybrid.offload", "hybrid.zero",
                       "hybrid.pipeline", "hybrid.data", "hybrid.generation", "hybrid.testing"]),
    ("3 checkpoint", {"hybrid.checkpoint"}),
    ("4 models", {"models.gpt"}),
    ("5 application", {"pretrain"}),
]
# The root packages' __init__ files hold no imports of the framework (checked below).
NAMESPACES = {"hybrid", "models"}

# Edges (importing module, imported module) tolerated while a change that removes them is under way;
# each must still exist (the test fails on a stale entry, so the list cannot rot). None today.
KNOWN_PENDING: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Edge:
    src: str       # importing module
    dst: str       # imported module of the framework
    path: str      # file of the import, relative to the repository
    line: int
    text: str      # the import statement as written

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}  ({self.src} -> {self.dst})"


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module under ROOTS."""
    out = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module named by ``from <node.module> import ...`` (relative forms included)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, is_package: bool, node: ast.AST, known: set[str]) -> list[str]:
    """Framework modules one import statement loads by name (``from pkg import mod`` is ``pkg.mod``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _resolve(module, is_package, node)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for name in names:
        while name and name not in known:   # `import hybrid.zero.x as y` names a module; a
            name = name.rpartition(".")[0]  # symbol of a module resolves to the module
        if name and name not in out:
            out.append(name)
    return out


def edges_of_source(module: str, source: str, path: str, known: set[str], *,
                    is_package: bool = False) -> list[Edge]:
    """The framework imports of one file: every Import/ImportFrom node of its AST, at any depth."""
    edges = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        text = " ".join(ast.get_source_segment(source, node).split())
        for dst in _targets(module, is_package, node, known):
            if dst != module:
                edges.append(Edge(module, dst, path, node.lineno, text))
    return sorted(edges, key=lambda e: (e.line, e.dst))


@functools.cache   # parsed once for the tests that read it (a tuple: nobody changes it)
def import_edges() -> tuple[Edge, ...]:
    files = module_files()
    known = set(files)
    return tuple(e for module, path in files.items()
                 for e in edges_of_source(module, path.read_text(), str(path.relative_to(REPO)), known,
                                          is_package=path.name == "__init__.py"))


def unit_of(module: str) -> str:
    """The package or top-level module of the layer table that holds ``module``: a top-level
    package listed whole (the application, ``pretrain``) is one unit; inside the namespace roots
    ``hybrid`` and ``models`` a unit is the root's sub-package or module."""
    parts = module.split(".")
    if parts[0] not in NAMESPACES or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2])


def layer_positions() -> dict[str, tuple[int, int | None]]:
    """unit -> (layer index, position in an ordered row or None)."""
    out = {}
    for index, (_, row) in enumerate(LAYERS):
        for pos, unit in enumerate(row) if isinstance(row, list) else ((None, u) for u in row):
            out[unit] = (index, pos)
    return out


def rank_violation(edge: Edge, positions) -> str | None:
    """Why ``edge`` imports upward, or None when the layers allow it."""
    src, dst = unit_of(edge.src), unit_of(edge.dst)
    if src == dst:
        return None
    (src_layer, src_pos), (dst_layer, dst_pos) = positions[src], positions[dst]
    if dst_layer > src_layer:
        return (f"layer {LAYERS[src_layer][0]!r} ({src}) imports from the higher layer "
                f"{LAYERS[dst_layer][0]!r} ({dst})")
    if dst_layer == src_layer and src_pos is not None and dst_pos > src_pos:
        return (f"{src} imports {dst}, which comes after it in layer {LAYERS[src_layer][0]!r} "
                f"({', '.join(LAYERS[src_layer][1])}: a package imports only those to its left)")
    return None


def strongly_connected(nodes, succ) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one node, i.e. the cycles."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(succ[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _graph(edges: list[Edge], key) -> tuple[dict, dict[tuple[str, str], Edge]]:
    """Successor sets of the graph whose nodes are ``key(module)``, and one edge per node pair."""
    by_pair: dict[tuple[str, str], Edge] = {}
    succ = defaultdict(set)
    for e in edges:
        a, b = key(e.src), key(e.dst)
        if a != b:
            by_pair.setdefault((a, b), e)
            succ[a].add(b)
    return succ, by_pair


def _components(succ) -> list[list[str]]:
    return strongly_connected(set(succ) | {b for s in list(succ.values()) for b in s}, succ)


def cycle_report(edges: list[Edge], key) -> list[str]:
    """One message per cycle of the graph whose nodes are ``key(module)``: a closed path through
    the component, each step named by one import that makes it."""
    succ, by_pair = _graph(edges, key)
    messages = []
    for component in _components(succ):
        path = _closed_path(component[0], succ, set(component))
        steps = "\n    ".join(str(by_pair[(a, b)]) for a, b in zip(path, path[1:]))
        messages.append(f"cycle {' -> '.join(path)}:\n    {steps}")
    return messages


def in_a_cycle(edge: Edge, edges: list[Edge]) -> bool:
    """Whether ``edge`` joins two modules, or two packages, of one cycle of ``edges``."""
    for key in (lambda m: m, unit_of):
        succ, _ = _graph(edges, key)
        if any(key(edge.src) in c and key(edge.dst) in c for c in _components(succ)):
            return True
    return False


def _closed_path(start: str, succ, members: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside one component (breadth first)."""
    parents, frontier = {}, [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(succ[node] & members):
                if child == start:   # walk back from node to start, then close the loop
                    back = [node]
                    while back[-1] != start:
                        back.append(parents[back[-1]])
                    return back[::-1] + [start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{start} is in a cycle but no path returns to it")


def check(edges: list[Edge], pending: set[tuple[str, str]]) -> list[str]:
    """Every broken rule, as messages; edges in ``pending`` are excused (and must exist)."""
    positions = layer_positions()
    problems = []
    units = {unit_of(e.src) for e in edges} | {unit_of(e.dst) for e in edges}
    for unit in sorted(units - set(positions)):
        if unit in NAMESPACES:
            problems.extend(f"{e}: the root package imports the framework; keep it empty"
                            for e in edges if e.src == unit)
        else:
            problems.append(f"{unit} is in no layer: add it to LAYERS here and to docs/design.md "
                            f"§Architecture")
    if problems:
        return problems
    edges = [e for e in edges if e.dst not in NAMESPACES]   # the empty root packages
    present = {(e.src, e.dst) for e in edges}
    problems += [f"KNOWN_PENDING lists {a} -> {b}, which no file imports any more: remove the entry"
                 for a, b in sorted(pending - present)]
    problems += [f"KNOWN_PENDING lists {e}, which breaks no rule: remove the entry"
                 for e in edges if (e.src, e.dst) in pending and not rank_violation(e, positions)
                 and not in_a_cycle(e, edges)]
    live = [e for e in edges if (e.src, e.dst) not in pending]
    for e in live:
        why = rank_violation(e, positions)
        if why:
            problems.append(f"{e}\n    upward import: {why}")
    problems += cycle_report(live, lambda m: m)
    problems += cycle_report(live, unit_of)
    return problems


def test_import_graph_is_layered_and_acyclic():
    problems = check(import_edges(), KNOWN_PENDING)
    assert not problems, "import rules of docs/design.md §Architecture broken:\n" + "\n".join(problems)


def imports_of_tests(source: str, path: str) -> list[str]:
    """``path:line: statement`` for every import of the ``tests`` package in one file's AST."""
    out = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(name.split(".")[0] == "tests" for name in names):
            out.append(f"{path}:{node.lineno}: {' '.join(ast.get_source_segment(source, node).split())}")
    return out


def _own_sources(root: str) -> list[Path]:
    """The .py files under ``root``, not those of a git-ignored peer venv (benchmarks/.venv-*)."""
    return [path for path in sorted((REPO / root).rglob("*.py"))
            if not any(part.startswith(".venv") for part in path.relative_to(REPO).parts)]


def test_entry_points_never_import_tests():
    problems = [problem for root in ENTRY_POINT_DIRS for path in _own_sources(root)
                for problem in imports_of_tests(path.read_text(), str(path.relative_to(REPO)))]
    assert not problems, ("benchmarks/, tools/ and launch/ import from tests/; move what they need into "
                          "the library (hybrid.testing):\n" + "\n".join(problems))


def test_the_framework_never_imports_the_test_harness():
    problems = [str(e) for e in import_edges()
                if unit_of(e.dst) == "hybrid.testing" and unit_of(e.src) != "hybrid.testing"]
    assert not problems, "the framework imports its test harness hybrid.testing:\n" + "\n".join(problems)


# ---- the checker itself must be able to fail -------------------------------------------------
def _edge(src: str, dst: str, line: int = 1) -> Edge:
    return Edge(src, dst, src.replace(".", "/") + ".py", line, f"from {dst} import x")


def test_checker_flags_an_upward_import_with_file_and_line():
    problems = check([_edge("hybrid.zero.engine", "pretrain.config", 7)], set())
    assert len(problems) == 1 and "hybrid/zero/engine.py:7: from pretrain.config" in problems[0]
    assert "higher layer" in problems[0]


def test_checker_flags_order_inside_a_layer():
    problems = check([_edge("hybrid.offload.budget", "hybrid.zero.config")], set())
    assert len(problems) == 1 and "comes after it" in problems[0]


def test_checker_flags_module_and_package_cycles():
    module_cycle = [_edge("hybrid.recompute.plan", "hybrid.recompute.planner", 3),
                    _edge("hybrid.recompute.planner", "hybrid.recompute.plan", 9)]
    problems = check(module_cycle, set())
    assert len(problems) == 1 and "hybrid/recompute/plan.py:3" in problems[0] \
        and "hybrid/recompute/planner.py:9" in problems[0]
    three = [_edge("hybrid.zero.a", "hybrid.zero.b"), _edge("hybrid.zero.b", "hybrid.zero.c"),
             _edge("hybrid.zero.c", "hybrid.zero.a")]
    problems = check(three, set())
    assert len(problems) == 1 and "cycle hybrid.zero.a -> hybrid.zero.b -> hybrid.zero.c -> " \
        "hybrid.zero.a:" in problems[0]
    package_cycle = [_edge("hybrid.perf.memory", "hybrid.topology"),
                     _edge("hybrid.topology", "hybrid.perf.flops")]
    problems = check(package_cycle, set())
    assert len(problems) == 1 and "cycle hybrid.perf -> hybrid.topology -> hybrid.perf" in problems[0]


def test_checker_excuses_pending_edges_and_rejects_stale_ones():
    upward = _edge("models.gpt.weights", "pretrain.checkpointing")
    assert check([upward], {("models.gpt.weights", "pretrain.checkpointing")}) == []
    stale = check([], {("models.gpt.weights", "pretrain.checkpointing")})
    assert len(stale) == 1 and "no file imports any more" in stale[0]
    allowed = _edge("hybrid.zero.engine", "hybrid.comm")
    harmless = check([allowed], {("hybrid.zero.engine", "hybrid.comm")})
    assert len(harmless) == 1 and "breaks no rule" in harmless[0]


def test_checker_rejects_packages_outside_the_table():
    problems = check([_edge("hybrid.experimental.stage", "hybrid.comm")], set())
    assert problems == ["hybrid.experimental is in no layer: add it to LAYERS here and to docs/design.md "
                        "§Architecture"]


def test_imports_of_tests_are_found_at_any_depth():
    source = ("import json\n"
              "from hybrid.testing.multirank import run_on_ranks\n"
              "def run():\n"
              "    from tests.reliability_helpers import tiny_cli\n"
              "    import tests.fault_entry as fault\n")
    assert imports_of_tests(source, "benchmarks/x.py") == [
        "benchmarks/x.py:4: from tests.reliability_helpers import tiny_cli",
        "benchmarks/x.py:5: import tests.fault_entry as fault"]


def test_lazy_and_relative_imports_are_edges():
    source = ("import torch\n"
              "from . import reducer\n"
              "def build():\n"
              "    from hybrid.offload.budget import build_offload_state\n"
              "    import hybrid.comm as c\n")
    known = {"hybrid.zero.optimizer", "hybrid.zero.reducer", "hybrid.offload.budget", "hybrid.comm"}
    edges = edges_of_source("hybrid.zero.optimizer", source, "hybrid/zero/optimizer.py", known)
    assert [(e.dst, e.line) for e in edges] == [("hybrid.zero.reducer", 2),
                                                 ("hybrid.offload.budget", 4), ("hybrid.comm", 5)]

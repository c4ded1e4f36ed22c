"""kvtide's import map: no import cycles, and no arrow against the package order of DESIGN.md.

Every module under ``kvtide/`` is parsed with ``ast``: imports at module level, inside functions and under
``TYPE_CHECKING`` all count (a lazy import is still a dependency), relative ones resolved, and a string constant
that names a kvtide submodule counts too (what an importlib registry holds). Two graphs are checked: modules, and
packages (``kvtide/<name>/`` or a top-level ``kvtide/<name>.py``). Adding an arrow means adding it to DESIGN.md's
map and to ``MAY_IMPORT`` below, on purpose.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvtide"

# DESIGN.md's package order as a table: a package may import its own modules, the utilities (which import only
# each other), and the packages of its row.
UTILITIES = {"log", "config_values", "extras"}
MAY_IMPORT: dict[str, set[str]] = {
    "config": {"config_load", "store"},  # RestoreConfig checks its store spec with the store factory's parser
    "config_load": {"config"},
    "cache": set(),  # the ZipFusion format and the compressed page pool: no kernels, no engine
    "kernels": {"cache"},  # kernels implement the format, each beside its torch reference
    "models": {"config"},
    "store": {"cache", "kernels", "config"},
    # restore and transfer reach a model through the narrow interface they define (restore.executor.ModelPort,
    # implemented by the engine's EnginePort), never by importing the engine
    "restore": {"store", "cache", "kernels", "models", "config"},
    "transfer": {"store", "cache", "kernels", "models", "config"},
    "parallel": {"restore", "store", "cache", "kernels", "models", "config"},
    "engine": {"restore", "transfer", "parallel", "store", "cache", "kernels", "models", "config", "config_load"},
}
# On top of the engine: may import anything, but of the engine only its public API.
TOP = {"kvtide", "cli", "server", "integrations", "demo", "benchmarks"}
ENGINE_PUBLIC = {"kvtide.engine", "kvtide.engine.llm", "kvtide.engine.llm_engine", "kvtide.engine.outputs",
                 "kvtide.engine.loop", "kvtide.engine.sampling_params"}
# Cycles that exist on purpose, with the reason; each must still exist (a stale entry fails too).
KNOWN_CYCLES = {
    # EngineConfig.from_env is the loader's front door on the config class; config_load needs the dataclasses
    frozenset({"kvtide.config", "kvtide.config_load"}),
}


def module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Module -> the package's modules it imports, and where (``file:line``) each edge was first seen."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    edges: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}

    def known(name: str) -> str | None:  # the module itself, else its nearest enclosing package
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in files else src for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                    and node.value in files:
                targets = [node.value]
            for t in targets:
                dst = known(t) if t.split(".")[0] == root.name else None
                if dst is not None and dst != mod:
                    edges[mod].add(dst)
                    where.setdefault((mod, dst), f"{path.relative_to(root.parent)}:{node.lineno}")
    for mod in files:
        edges.setdefault(mod, set())
    return dict(edges), where


def package_of(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for a, bs in edges.items():
        out[package_of(a)]
        for b in bs:
            if package_of(a) != package_of(b):
                out[package_of(a)].add(package_of(b))
    return dict(out)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected component with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graphs are small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, comp) for comp in comps]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest path from the component's first node back to itself, inside the component (BFS)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:  # walk back from v to start
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("a strongly connected component without a cycle")


def _show(path: list[str], where: dict[tuple[str, str], str] | None = None) -> str:
    """``a -> b -> a``, then each hop's import line when known."""
    hops = [f"\n      {a} -> {b}  ({where[a, b]})" for a, b in zip(path, path[1:]) if where and (a, b) in where]
    return " -> ".join(path) + "".join(hops)


def arrows_against_design(edges: dict[str, set[str]], where: dict[tuple[str, str], str]) -> list[str]:
    bad = []
    for a, bs in sorted(edges.items()):
        pa = package_of(a)
        for b in sorted(bs):
            pb = package_of(b)
            if pa == pb or pb in UTILITIES:
                continue
            at = where.get((a, b), "?")
            if pa in TOP:
                if pb == "engine" and b not in ENGINE_PUBLIC:
                    bad.append(f"{a} -> {b} ({at}): {pa} sits on top and uses the engine's public API only")
            elif pa not in MAY_IMPORT and pa not in UTILITIES:
                bad.append(f"{a} ({at}): package '{pa}' is not in the map (tests/test_import_map.py, DESIGN.md)")
            elif pb not in MAY_IMPORT.get(pa, set()):
                bad.append(f"{a} -> {b} ({at}): '{pa}' may not import '{pb}'")
    return bad


def test_no_module_cycles():
    edges, where = import_graph(ROOT)
    found = cycles(edges)
    unexpected = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    assert not unexpected, "import cycles between modules:\n  " + "\n  ".join(_show(c, where) for c in unexpected)
    stale = KNOWN_CYCLES - {frozenset(c) for c in found}
    assert not stale, f"KNOWN_CYCLES lists cycles that are gone (remove them): {sorted(map(sorted, stale))}"


def test_no_package_cycles():
    edges, where = import_graph(ROOT)
    pkg = package_graph(edges)
    # a cycle inside one allowed module cycle is not a package cycle
    known = {frozenset(package_of(m) for m in c) for c in KNOWN_CYCLES}
    found = [c for c in cycles(pkg) if frozenset(c) not in known]
    assert not found, "import cycles between packages:\n  " + "\n  ".join(_show(c) for c in found)


def test_no_arrow_against_the_package_order():
    edges, where = import_graph(ROOT)
    bad = arrows_against_design(edges, where)
    assert not bad, "imports against DESIGN.md's package order:\n  " + "\n  ".join(bad)


def test_the_map_sees_lazy_relative_and_registry_imports(tmp_path):
    """The checker itself: a cycle closed by a function-level relative import, one under TYPE_CHECKING, and one
    through a registry's module-name string are all found; arrows against the order are reported."""
    pkg = tmp_path / "kvtide"
    for name, text in {
        "__init__.py": "",
        "cache/__init__.py": "",
        "cache/pool.py": "def f():\n    from ..engine import runner\n",
        "engine/__init__.py": "",
        "engine/runner.py": "from ..cache.pool import f\nfrom . import registry\n",
        "engine/registry.py": "NAMES = {'a': 'kvtide.engine.backend'}\n",
        "engine/backend.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .registry import NAMES\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    edges, where = import_graph(pkg)
    assert edges["kvtide.cache.pool"] == {"kvtide.engine.runner"}
    assert where["kvtide.cache.pool", "kvtide.engine.runner"] == "kvtide/cache/pool.py:2"
    assert edges["kvtide.engine.registry"] == {"kvtide.engine.backend"}
    found = {frozenset(c) for c in cycles(edges)}
    assert frozenset({"kvtide.cache.pool", "kvtide.engine.runner"}) in found
    assert frozenset({"kvtide.engine.registry", "kvtide.engine.backend"}) in found
    assert {frozenset(c) for c in cycles(package_graph(edges))} == {frozenset({"cache", "engine"})}
    bad = arrows_against_design(edges, where)
    assert any("'cache' may not import 'engine'" in b for b in bad)

"""The import graph of qspec's packages, its circles and its imports against the layer order.

    python scripts/import_graph.py          # package graph, circles, violations; exit 1 on any problem

Layers, lowest first: runtime <- quantize <- speculate <- evals <- experiments. A module may import its own
layer and the ones below. Only entry points (a ``__main__`` block, and no other project module imports them)
may import upwards: they are the composition roots that wire layers together. Every import counts, also one
inside a function, so no circle hides behind a local import. tests/test_layers.py runs the same checks.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

LAYERS = ("runtime", "quantize", "speculate", "evals", "experiments")
RANK = {name: i for i, name in enumerate(LAYERS)}
ROOT = Path(__file__).resolve().parents[1]
# Slow-to-import optional libraries: a module that imports one at its top (directly or through project modules)
# is "heavy", and the one good reason for a function-local import is to load a heavy module only when used.
HEAVY_LIBRARIES = {
    "triton",
    "lm_eval",
    "aiohttp",
    "matplotlib",
    "xgrammar",
    "compressed_tensors",
    "transformers",
    "datasets",
    "openai",
    "scipy",
}


@dataclass
class Import:
    source: str  # importing module
    target: str  # imported project module
    line: int
    local: bool  # inside a function or class body


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    entry_points: set[str] = field(default_factory=set)
    heavy: set[str] = field(default_factory=set)  # modules whose import loads a HEAVY_LIBRARIES member


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest project module that ``name`` (a module, or a module plus an attribute) refers to."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def has_main_block(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            left = node.test.left
            if isinstance(left, ast.Name) and left.id == "__name__":
                return True
    return False


def build(root: Path = ROOT) -> Graph:
    graph = Graph()
    trees = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            name = module_name(path, root)
            graph.modules[name] = path
            trees[name] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for name, tree in trees.items():
        is_package = graph.modules[name].name == "__init__.py"
        local_nodes = {
            id(inner)
            for outer in ast.walk(tree)
            if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            for inner in ast.walk(outer)
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in local_nodes:
                libs = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if not node.__dict__.get("level") and any(lib.split(".")[0] in HEAVY_LIBRARIES for lib in libs):
                    graph.heavy.add(name)
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(package[: len(package) - node.level + 1])
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module or ""
                targets = [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                resolved = resolve(target, graph.modules)
                if resolved is not None and resolved != name:
                    graph.imports.append(Import(name, resolved, node.lineno, id(node) in local_nodes))
        if has_main_block(tree):
            graph.entry_points.add(name)
    changed = True
    while changed:  # heavy spreads along top-level imports
        changed = False
        for imp in graph.imports:
            if not imp.local and imp.target in graph.heavy and imp.source not in graph.heavy:
                graph.heavy.add(imp.source)
                changed = True
    imported = {imp.target for imp in graph.imports}
    graph.entry_points -= imported  # a module others import is a library, not a composition root
    return graph


def layer_of(module: str) -> str:
    return module.split(".")[0]


def violations(graph: Graph) -> list[Import]:
    """Imports from a lower layer to a higher one outside entry points."""
    return [
        imp
        for imp in graph.imports
        if RANK[layer_of(imp.target)] > RANK[layer_of(imp.source)] and imp.source not in graph.entry_points
    ]


def circles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    edges = defaultdict(set)
    for imp in graph.imports:
        edges[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph.modules)))
    for v in sorted(graph.modules):
        if v not in index:
            visit(v)
    return found


def local_project_imports(graph: Graph) -> list[Import]:
    """Project imports inside functions, except of heavy modules: they hide dependencies (loading a heavy
    optional library only when it is used is the one reason for a local import)."""
    return [imp for imp in graph.imports if imp.local and imp.target not in graph.heavy]


def package_edges(graph: Graph) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for imp in graph.imports:
        a, b = layer_of(imp.source), layer_of(imp.target)
        if a != b:
            counts[(a, b)] += 1
    return dict(counts)


def main() -> int:
    graph = build()
    print(f"{len(graph.modules)} modules, {len(graph.imports)} project imports; layers: {' <- '.join(LAYERS)}")
    print("package edges (importer -> imported: count):")
    for (a, b), n in sorted(package_edges(graph).items(), key=lambda kv: (RANK[kv[0][0]], RANK[kv[0][1]])):
        print(f"  {a:12s} -> {b:12s} {n:4d}{'   (entry points only)' if RANK[b] > RANK[a] else ''}")
    print(f"entry points: {', '.join(sorted(graph.entry_points))}")
    print(f"heavy modules (imported lazily where needed): {', '.join(sorted(graph.heavy))}")
    bad = violations(graph)
    loops = circles(graph)
    local = local_project_imports(graph)
    for imp in bad:
        print(f"AGAINST THE LAYER ORDER: {imp.source} (line {imp.line}) imports {imp.target}")
    for loop in loops:
        print(f"CIRCLE: {' <-> '.join(loop)}")
    print(f"function-local project imports: {len(local)}")
    for imp in local:
        print(f"  local: {imp.source}:{imp.line} -> {imp.target}")
    return 1 if bad or loops or local else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Find import cycles among the modules of `hybridserve`, `backends` and `checkpoints`.

Builds the module import graph with `ast` (every `import` and `from ... import`, at module
level or inside functions; `from x import y` counts as an import of `x.y` when that is a
module, else of `x`; relative imports are resolved) and prints each strongly connected
component of more than one module (or a module importing itself), with one cycle through it.

    python scripts/check_import_cycles.py          # exit status 1 when a cycle exists
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hybridserve", "backends", "checkpoints")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `PACKAGES` (packages as their
    `__init__`)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            found[".".join(rel.parts).removesuffix(".__init__")] = path
    return found


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `module` (at `path`) imports, anywhere in its body."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import a.b.c` of a non-module c: its package
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    mods = modules(root)
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def one_cycle(edges: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the first module of `comp` (breadth-first within it)."""
    start, members = comp[0], set(comp)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def main() -> int:
    """Print the cycles; 1 if there is one."""
    edges = graph()
    found = cycles(edges)
    for comp in found:
        print(f"cycle among {len(comp)} modules: {' -> '.join(one_cycle(edges, comp))}")
    if not found:
        print(f"no import cycles among {len(edges)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

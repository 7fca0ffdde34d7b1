"""The import graph of this repository's packages, read with `ast` (nothing is imported).

Every `import x` and `from x import y` counts, at any depth (inside functions too, and under
`if TYPE_CHECKING:`): a deferred import is still a dependency. `from pkg import name` adds an
edge to `pkg` and, when `pkg.name` is a module, to it as well; relative imports are resolved.
Importing a module does not count as importing its parent package here (Python runs the
parent's `__init__` first, but that is no dependency of the child's code).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("backends", "hybridserve", "checkpoints")


def modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py file under the packages."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Every absolute name `module` imports (`from a import b` gives `a` and `a.b`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports (edges only to modules that exist)."""
    found = modules(root, packages)
    return {
        m: {name for name in imported_names(m, path) if name in found and name != m}
        for m, path in found.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out

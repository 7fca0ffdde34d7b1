"""Imports point down only. Walks every module's imports with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package prefix -> prefixes of this project it must not import
FORBIDDEN = {
    "backends": ("hybridserve", "checkpoints", "scripts"),
    "hybridserve.core": (
        "jax",
        "flax",
        "hybridserve.cache.view",
        "hybridserve.cache.regions",
        "hybridserve.layers",
        "hybridserve.models",
        "hybridserve.runner",
        "hybridserve.engine",
        "hybridserve.api",
        "checkpoints",
        "scripts",
    ),
    "hybridserve.config": ("jax", "flax", "hybridserve.layers", "hybridserve.models"),
    # the cache package sits under the scheduler and the runner; its pure half (what the
    # scheduler and the transfer descriptors use) imports no jax
    "hybridserve.cache": (
        "hybridserve.core",
        "hybridserve.layers",
        "hybridserve.models",
        "hybridserve.runner",
        "hybridserve.disagg",
        "hybridserve.engine",
        "hybridserve.api",
        "checkpoints",
        "scripts",
    ),
    **{
        f"hybridserve.cache.{pure}": ("jax", "flax", "numpy", "hybridserve.cache.view")
        for pure in ("spec", "plan", "page_layout")
    },
    "hybridserve.layers": (
        "hybridserve.models",
        "hybridserve.runner",
        "hybridserve.weights",
        "hybridserve.engine",
        "hybridserve.api",
        "checkpoints",
    ),
    "hybridserve.models": (
        "hybridserve.runner",
        "hybridserve.weights",
        "hybridserve.engine",
        "hybridserve.api",
        "checkpoints",
    ),
    "hybridserve.weights": (
        "hybridserve.runner",
        "hybridserve.engine",
        "hybridserve.api",
        "checkpoints",
    ),
    "hybridserve.runner": ("hybridserve.engine", "hybridserve.api", "checkpoints"),
    "hybridserve": ("checkpoints", "scripts"),
    "checkpoints": ("scripts",),
}
# The CLI is the composition root: it alone dispatches to the checkpoints tooling.
ALLOWED = {("hybridserve.cli", "checkpoints")}


def _modules():
    for package in ("backends", "hybridserve", "checkpoints"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts).removesuffix(".__init__")
            yield name, path


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_imports_point_down():
    bad = []
    checked = 0
    for module, path in _modules():
        rules = [p for p in FORBIDDEN if _matches(module, p)]
        for imported in _imports(path):
            checked += 1
            for rule in rules:
                for forbidden in FORBIDDEN[rule]:
                    if _matches(imported, forbidden) and not any(
                        _matches(module, m) and _matches(imported, i) for m, i in ALLOWED
                    ):
                        bad.append(f"{module} imports {imported} (rule {rule} -/-> {forbidden})")
    assert checked > 50
    assert not bad, "\n".join(bad)

"""The structure, enforced: each package imports only what its allow-list names, the host-side
packages never import jax, and no module imports itself through others (no cycle anywhere).

The graph comes from `import_graph` (every import at any depth, `ast` only). Layers, bottom up:
  backends                    ops; nothing of this project
  config                      frozen configs and the HF/Inkling parsers
  cache (spec, plan, layout)  the hybrid cache's arithmetic, no jax; view/regions: device side
  core                        host bookkeeping, no jax: scheduler, cache manager, connector API
  layers, models, weights     Flax NNX blocks, their assembly, checkpoint names and loading
  runner                      the jitted step, sampling, speculative decoding
  disagg                      the NIXL connector (below the engine: reached only by name)
  engine                      scheduler + runner + connector + outputs
  entrypoints, server, cli    LLM / DisaggregatedLLM / the worker, the OpenAI server, the CLI
"""

from __future__ import annotations

from pathlib import Path

import import_graph
import pytest

ROOT = Path(__file__).resolve().parents[1]

LEAVES = (
    "hybridserve.outputs",
    "hybridserve.sampling_params",
    "hybridserve.tokenizer",
    "hybridserve.chat_template",
    "hybridserve.media",
    "hybridserve.chat_prompt",
)
CONFIG = ("hybridserve.config",)
CACHE = (*CONFIG, "hybridserve.cache")
PURE_CACHE = tuple(f"hybridserve.cache.{m}" for m in ("spec", "plan", "page_layout"))
MODEL = (*CACHE, "backends", "hybridserve.layers", "hybridserve.models", "hybridserve.parallel")

# module prefix -> the project prefixes it may import (its own prefix always allowed); the
# longest matching prefix rules a module, and every module must match one.
ALLOWED: dict[str, tuple[str, ...]] = {
    "backends": (),
    "hybridserve": (),  # the package: public names are imported lazily, by string
    "hybridserve.config": (),
    "hybridserve.parallel": (),
    "hybridserve.outputs": (),
    "hybridserve.sampling_params": (),
    "hybridserve.tokenizer": ("hybridserve.chat_template",),
    "hybridserve.chat_template": (),
    "hybridserve.media": (),
    "hybridserve.chat_prompt": (*CONFIG, "hybridserve.chat_template", "hybridserve.media"),
    "hybridserve.prompt_check": ("hybridserve.sampling_params", "hybridserve.core.request"),
    "hybridserve.bench": (),  # talks HTTP to any server: nothing of the engine
    "hybridserve.output_processor": ("hybridserve.core", *LEAVES),
    "hybridserve.cache": CONFIG,
    **{m: (*CONFIG, *PURE_CACHE) for m in PURE_CACHE},  # no device views under the arithmetic
    "hybridserve.core": (*CONFIG, *PURE_CACHE),  # the scheduler never sees device memory
    "hybridserve.layers": (*CACHE, "backends"),
    "hybridserve.models": MODEL,
    "hybridserve.weights": MODEL,
    "hybridserve.runner": (*MODEL, "hybridserve.weights", "hybridserve.core", *LEAVES),
    "hybridserve.disagg": (*CACHE, "hybridserve.core"),
    "hybridserve.engine": (
        *CACHE,
        "hybridserve.core",
        "hybridserve.runner",
        "hybridserve.prompt_check",
        "hybridserve.output_processor",
        *LEAVES,
    ),
    "hybridserve.entrypoints": (*CONFIG, "hybridserve.engine", *LEAVES),
    "hybridserve.server": (
        *CONFIG,
        "hybridserve.engine",
        "hybridserve.entrypoints",
        "hybridserve.disagg.auth",
        "hybridserve.disagg.params",
        *LEAVES,
    ),
    "hybridserve.cli": (
        *CONFIG,
        "hybridserve.engine",
        "hybridserve.entrypoints",
        "hybridserve.server",
        "hybridserve.sampling_params",
        "hybridserve.bench",
        "checkpoints",  # the composition root: it alone dispatches to the converter
    ),
    "checkpoints": (*MODEL, "hybridserve.weights", "hybridserve.runner"),
}
# host-side code that must run without jax (the core is tested and used without it); the
# cache arithmetic without numpy either
HEAVY = ("jax", "jaxlib", "flax", "torch")
NO_HEAVY: dict[str, tuple[str, ...]] = {
    "hybridserve.core": HEAVY,
    "hybridserve.config": HEAVY,
    **{m: (*HEAVY, "numpy") for m in PURE_CACHE},
    "hybridserve.disagg.descriptors": HEAVY,
    "hybridserve.disagg.tp_mapping": HEAVY,
}
# modules (not packages) that must stay light: the CLI imports it before it parses arguments
LIGHT_MODULES = ("hybridserve.entrypoints",)


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _rule(module: str) -> str | None:
    rules = [p for p in ALLOWED if _matches(module, p)]
    return max(rules, key=len) if rules else None


def _external(path: Path) -> set[str]:
    return {n.split(".")[0] for n in import_graph.imported_names("", path)}


def test_every_import_is_on_its_package_allow_list():
    edges = import_graph.graph(ROOT)
    assert len(edges) > 100
    bad, unruled = [], []
    for module, targets in sorted(edges.items()):
        rule = _rule(module)
        if rule is None:
            unruled.append(module)
            continue
        allowed = (rule, *ALLOWED[rule])
        for target in sorted(targets):
            if not any(_matches(target, a) for a in allowed):
                bad.append(f"{module} imports {target} (allowed for {rule}: {allowed})")
    assert not unruled, f"modules no rule covers (add one to ALLOWED): {unruled}"
    assert not bad, "\n".join(bad)


def test_host_side_packages_import_no_jax():
    found = import_graph.modules(ROOT)
    bad = []
    for module, path in sorted(found.items()):
        rules = [p for p in NO_HEAVY if _matches(module, p)]
        banned = set(NO_HEAVY[max(rules, key=len)]) if rules else set()
        if module in LIGHT_MODULES:
            banned |= set(HEAVY)
        heavy = _external(path) & banned
        if heavy:
            bad.append(f"{module} imports {sorted(heavy)}")
    assert len(found) > 100
    assert not bad, "\n".join(bad)


def test_there_is_no_import_cycle():
    found = import_graph.cycles(import_graph.graph(ROOT))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_planted_cycle(tmp_path):
    """The checks above would fail on a cycle, even one through a deferred import."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("import pkg.c\n")  # on the way in, not in the cycle
    edges = import_graph.graph(tmp_path, ("pkg",))
    assert edges["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    assert import_graph.cycles(edges) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (package / "c.py").write_text("import json\n")
    assert import_graph.cycles(import_graph.graph(tmp_path, ("pkg",))) == []


@pytest.mark.parametrize(
    "module,target,ok",
    [
        ("hybridserve.core.scheduler", "hybridserve.runner.model_runner", False),
        ("hybridserve.core.scheduler", "hybridserve.cache.plan", True),
        ("hybridserve.core.scheduler", "hybridserve.cache.view", False),
        ("hybridserve.cache.plan", "hybridserve.cache.regions", False),
        ("hybridserve.engine", "hybridserve.disagg.connector", False),
        ("hybridserve.cli", "checkpoints.convert", True),
        ("backends.xla", "hybridserve.config", False),
    ],
)
def test_the_allow_list_says_what_it_means(module, target, ok):
    rule = _rule(module)
    assert rule is not None
    assert any(_matches(target, a) for a in (rule, *ALLOWED[rule])) is ok

"""scripts/check_import_cycles.py: it finds cycles through function-level imports and
`from package import module`, and none runs through the config package or the weight tables."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location(
        "check_import_cycles", ROOT / "scripts" / "check_import_cycles.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_finds_function_level_and_module_from_imports(tmp_path):
    check = _checker()
    _write(
        tmp_path,
        {
            "hybridserve/__init__.py": "",
            "hybridserve/a.py": "def f():\n    from hybridserve.b import g\n",
            "hybridserve/b.py": "from hybridserve import a\n",
            "hybridserve/c.py": "from . import a\n",
            "hybridserve/p/__init__.py": "from .q import x\n",
            "hybridserve/p/q.py": "import hybridserve.p.r\n",
            "hybridserve/p/r.py": "from hybridserve.p import q\n",
            "backends/__init__.py": "",
            "checkpoints/__init__.py": "",
        },
    )
    edges = check.graph(tmp_path)
    assert edges["hybridserve.b"] == {"hybridserve.a"}
    assert edges["hybridserve.c"] == {"hybridserve.a"}
    assert check.cycles(edges) == [
        ["hybridserve.a", "hybridserve.b"],
        ["hybridserve.p.q", "hybridserve.p.r"],
    ]
    cycle = check.one_cycle(edges, ["hybridserve.a", "hybridserve.b"])
    assert cycle == ["hybridserve.a", "hybridserve.b", "hybridserve.a"]


def test_no_cycle_through_the_config_package_or_the_weight_tables():
    check = _checker()
    mine = ("hybridserve.config", "hybridserve.weights", "hybridserve.engine", "hybridserve.api")
    found = check.cycles(check.graph())
    assert not [c for c in found if any(m.startswith(mine) for m in c)], found

"""The notebooks in `notebooks/` run top to bottom, are stored without outputs, and every figure
they draw has axis labels and a caption.

Each notebook runs in a fresh IPython kernel (nbclient) from the `notebooks/` directory. Before
its first cell the test installs a check on every figure the kernel renders (inline display,
`plt.show`, `savefig`: all go through `FigureCanvasBase.print_figure`): every axes that shows
its axis needs an x and a y label (a colorbar one label), and the figure needs a caption, a
`fig.text` that says what to look at. After the last cell, the collected problems must be none.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))

CHECK_FIGURES = """
import matplotlib.backend_bases as _hs_bb

_hs_problems, _hs_rendered = [], []
_hs_print_figure = _hs_bb.FigureCanvasBase.print_figure


def _hs_checked_print_figure(self, *args, **kwargs):
    fig = self.figure
    name = f"figure {len(_hs_rendered) + 1}"
    _hs_rendered.append(name)
    if not any(t.get_text().strip() for t in fig.texts):
        _hs_problems.append(f"{name}: no caption (fig.text)")
    for ax in fig.axes:
        if not ax.axison:
            continue
        labels = [ax.get_xlabel().strip(), ax.get_ylabel().strip()]
        if hasattr(ax, "_colorbar") and any(labels):
            continue
        if not all(labels):
            _hs_problems.append(f"{name}: axes {ax.get_title()!r} lacks an axis label")
    return _hs_print_figure(self, *args, **kwargs)


_hs_bb.FigureCanvasBase.print_figure = _hs_checked_print_figure
"""

REPORT_FIGURES = "assert not _hs_problems, _hs_problems\nprint(len(_hs_rendered), 'figures')"


def test_notebooks_exist():
    names = {p.name for p in PATHS}
    for prefix in ("1_", "2_", "3_", "4_"):
        assert any(n.startswith(prefix) for n in names), f"no notebook {prefix}* in {names}"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"cell {i} keeps outputs"
            assert cell.execution_count is None, f"cell {i} keeps an execution count"


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs_and_its_figures_are_labelled(path):
    nb = nbformat.read(path, as_version=4)
    n_figures_expected = "plt." in "".join(c.source for c in nb.cells if c.cell_type == "code")
    nb.cells.insert(0, nbformat.v4.new_code_cell(CHECK_FIGURES))
    nb.cells.append(nbformat.v4.new_code_cell(REPORT_FIGURES))
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    seconds = time.perf_counter() - start
    report = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    print(f"{path.name}: {seconds:.0f} s, {report.strip()}")
    if n_figures_expected:
        assert not report.startswith("0 figures"), "the notebook draws but no figure rendered"

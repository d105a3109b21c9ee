"""Every walkthrough in phases/ is paired with an executed notebook in notebooks/, and they agree."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
WALKTHROUGHS = sorted((ROOT / "phases").glob("*.py"))


def test_every_walkthrough_has_a_notebook_and_back() -> None:
    assert WALKTHROUGHS, "no walkthroughs found"
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert notebooks == {p.stem for p in WALKTHROUGHS}


@pytest.mark.parametrize("source", WALKTHROUGHS, ids=lambda p: p.stem)
def test_pair_has_not_drifted(source: Path) -> None:
    """The notebook's cells are the walkthrough's cells, in order, with the same sources."""
    text = jupytext.read(source)
    notebook = nbformat.read(ROOT / "notebooks" / f"{source.stem}.ipynb", as_version=4)
    ours = [(c.cell_type, c.source.strip()) for c in text.cells]
    theirs = [(c.cell_type, c.source.strip()) for c in notebook.cells]
    assert ours == theirs, (
        f"{source.name} and notebooks/{source.stem}.ipynb drifted: re-run scripts/execute_notebooks.py"
    )


@pytest.mark.parametrize("source", WALKTHROUGHS, ids=lambda p: p.stem)
def test_notebook_is_executed(source: Path) -> None:
    notebook = nbformat.read(ROOT / "notebooks" / f"{source.stem}.ipynb", as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), "notebook has unexecuted cells"

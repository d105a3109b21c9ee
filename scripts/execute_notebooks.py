"""Pair every walkthrough (phases/*.py) with its notebook and execute it, rewriting the outputs.

Run on a CUDA box to record the GPU figures that the committed notebooks show:

    PYTHONPATH=. python3 scripts/execute_notebooks.py [phases/phase1_narrow_output.py ...]
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reference_impl.errors import ConfigError  # noqa: E402
from reference_impl.tool_args import ToolParser, refusing  # noqa: E402

PROG = "python3 scripts/execute_notebooks.py"


#: A Markdown link to a page's source (``.md``): the site serves a notebook at ``notebooks/NAME/`` and a page at
#: ``PAGE/``, and the strict build does not check links inside notebooks, so such a link breaks unseen.
_SOURCE_LINK = re.compile(r"\]\((?![a-z]+:)([^)\s]*\.md(?:#[^)\s]*)?)\)")


def source_links(notebook: nbformat.NotebookNode) -> list[str]:
    """The links of the notebook's Markdown cells that point at a ``.md`` source instead of a built page
    (``../../phases/phase7-fused-kernels/#measured-results``, not ``../phases/phase7-fused-kernels.md#...``)."""
    return [
        m.group(1)
        for cell in notebook.cells
        if cell.cell_type == "markdown"
        for m in _SOURCE_LINK.finditer(cell.source)
    ]


def execute(source: Path) -> Path:
    notebook = jupytext.read(source)
    target = ROOT / "notebooks" / (source.stem + ".ipynb")
    start = time.time()

    def log_cell(cell, cell_index, **_):  # progress on stderr: which cell finished, after how long
        print(f"  {source.stem} cell {cell_index} done at {time.time() - start:.0f} s", file=sys.stderr, flush=True)

    client = NotebookClient(
        notebook,
        timeout=1800,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
        on_cell_executed=log_cell,
    )
    client.execute()
    nbformat.write(notebook, target)
    print(f"{source.name} -> {target.relative_to(ROOT)} in {time.time() - start:.0f} s", flush=True)
    return target


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(PROG, __doc__.splitlines()[0])
    parser.add_argument("walkthroughs", nargs="*", type=Path, help="phases/*.py files (default: all)")
    args = parser.parse_args(argv)
    sources = args.walkthroughs or sorted((ROOT / "phases").glob("*.py"))
    missing = [str(p) for p in sources if not p.is_file() or p.suffix != ".py"]
    if missing:
        raise ConfigError(f"walkthroughs: not a walkthrough (phases/*.py): {', '.join(missing)}")
    linked = [f"{p}: {link}" for p in sources for link in source_links(jupytext.read(p))]
    if linked:
        raise ConfigError(
            "a walkthrough links a page's .md source; link the built page (../../PAGE/): " + "; ".join(linked)
        )
    for src in sources:
        execute(src.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())

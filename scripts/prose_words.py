"""Count the prose words of the site's pages: what a reader reads, not the tables and code around it.

A design page keeps its prose under a budget (:data:`BUDGETS`). Prose here is the markdown with
these taken out: fenced blocks (code, console output, diagrams), table rows, figures rendered from
results (the text between ``<!-- fig ... -->`` and ``<!-- /fig -->``), HTML comments, images and
link targets (a link counts its text). Headings, list items and admonitions count.

    python3 scripts/prose_words.py              # a table of every page: prose words, budget
    python3 scripts/prose_words.py --json       # the same as JSON
    python3 scripts/prose_words.py PAGE ...     # only these pages

Exit 1 when a page is over its budget.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: Prose budget per page (words), by path under docs/; every other page: :data:`DEFAULT_BUDGET`.
BUDGETS = {"benchmarks.md": 3000}
DEFAULT_BUDGET = 2500
#: Pages without a prose budget: the API reference is generated from docstrings; snippets are not pages.
UNBUDGETED = ("api/", "includes/")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(```|~~~).*?^(?P=indent)(```|~~~)[ \t]*$", re.S | re.M)
_FIG = re.compile(r"<!-- fig(:\S*)? .+? -->.*?<!-- /fig -->", re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
_LINK = re.compile(r"\[([^\]]*)\](\([^)]*\)|\[[^\]]*\])")
_WORD = re.compile(r"[A-Za-z0-9][\w'’.,:/+-]*")


def prose(text: str) -> str:
    """The prose of a markdown page (see the module docstring for what is taken out)."""
    text = _FIG.sub(" ", text)
    text = _COMMENT.sub(" ", text)
    text = _FENCE.sub(" ", text)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))
    text = _IMAGE.sub(" ", text)
    return _LINK.sub(r"\1", text)


def prose_words(text: str) -> int:
    return len(_WORD.findall(prose(text)))


def budget(page: str) -> int | None:
    """The prose budget of ``page`` (a path under docs/), None where there is none."""
    if page.startswith(UNBUDGETED):
        return None
    return BUDGETS.get(page, DEFAULT_BUDGET)


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def counts(paths: list[Path] | None = None) -> list[dict]:
    rows = []
    for path in paths or pages():
        path = path.resolve()
        name = path.relative_to(DOCS).as_posix() if path.is_relative_to(DOCS) else path.relative_to(ROOT).as_posix()
        rows.append({"page": name, "prose_words": prose_words(path.read_text()), "budget": budget(name)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("pages", nargs="*", type=Path)
    args = parser.parse_args(argv)
    rows = counts(args.pages or None)
    over = [r for r in rows if r["budget"] is not None and r["prose_words"] >= r["budget"]]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("| page | prose words | budget |\n| --- | --- | --- |")
        for r in rows:
            print(f"| {r['page']} | {r['prose_words']:,} | {r['budget'] or '-'} |")
    for r in over:
        print(f"{r['page']}: {r['prose_words']:,} prose words, budget {r['budget']:,}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

"""Checks of the built site as a reader sees it (``mkdocs build``'s HTML), and of the package's docstrings.

The markdown can be right and the page still wrong: a table cell that swallows a figure marker,
a test name that was renamed, a sentence that cites the project's own work items. These functions
read what a browser shows (text nodes; comments, scripts and styles left out) and return what they
find; ``tests/test_site.py`` asserts on them.

    python3 scripts/site_checks.py SITE_DIR     # print every finding on a built site; exit 1 if any
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Iterator
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------- visible text


class _Text(HTMLParser):
    """The text nodes of an HTML page outside ``<script>``, ``<style>`` and diagram sources (an element of
    class ``mermaid``, which the bundled diagram library replaces by its drawing), comments left out."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._open: list[tuple[str, bool]] = []  # (tag, skipped) of the open elements that may hold text

    def _skipping(self) -> bool:
        return any(skipped for _, skipped in self._open)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in _VOID:
            return
        classes = (dict(attrs).get("class") or "").split()
        self._open.append((tag, tag in ("script", "style") or "mermaid" in classes))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == tag:
                del self._open[i:]
                break

    def handle_data(self, data: str) -> None:
        if not self._skipping():
            self.parts.append(data)


_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def visible_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    parser.close()
    return " ".join(parser.parts)


def site_pages(site: Path) -> Iterator[tuple[str, str]]:
    """``(page, visible text)`` of every HTML page of a built site but the search and 404 pages."""
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site).as_posix()
        if rel in ("404.html",) or rel.startswith(("search/", "assets/")):
            continue
        yield rel, visible_text(path.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------- the checks

#: What a figure marker leaves when markdown cuts it: the comment's opening in visible text.
_MARKER = re.compile(r"<!--|/fig -->")


def marker_leaks(text: str) -> list[str]:
    """Visible pieces of figure-marker source (``<!-- fig ...``, ``-->``), with some context."""
    return [text[max(0, m.start() - 40):m.end() + 60].strip() for m in _MARKER.finditer(text)]


_TEST_NAME = re.compile(r"\btest_\w*[A-Za-z0-9](?![\w.]*\.json)(?!\w)")


def cited_tests(text: str) -> set[str]:
    """Every ``test_...`` name a text cites: test functions and test files (``test_x.py`` as ``test_x``);
    a results file (``test_run_h200.json``) is not a test."""
    return set(_TEST_NAME.findall(text))


def defined_tests(tests_dir: Path = ROOT / "tests") -> set[str]:
    """The names under ``tests/``: test modules (file stems) and every function or class they define."""
    names: set[str] = set()
    for path in tests_dir.rglob("*.py"):
        names.add(path.stem)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names.update(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    return names


def missing_tests(text: str, defined: set[str]) -> set[str]:
    return {name for name in cited_tests(text) if name not in defined}


#: Words that only make sense inside the project's own history: its work items, its working notes,
#: the people and sessions that built it. A reader of the site has none of these.
INTERNAL = [
    re.compile(r"\bissues? #?\d+\b", re.I),
    re.compile(r"\bBRIEF\b"),
    re.compile(r"\bthe (design )?brief\b", re.I),
    re.compile(r"\bbrief's\b", re.I),
    re.compile(r"\bseed (notes?|log|file)\b", re.I),
    re.compile(r"shared/seed|/work/(main|wt|shared)\b"),
    re.compile(r"\bwork items?\b", re.I),
    re.compile(r"\b(the|to the) lead\b"),
    re.compile(r"\bcommit [0-9a-f]{7,40}\b"),
    re.compile(r"\b(this|that|the previous|an earlier) session\b", re.I),
]


def internal_references(text: str) -> list[str]:
    """Each internal reference in ``text``, with some context."""
    return [text[max(0, m.start() - 40):m.end() + 40].replace("\n", " ").strip()
            for pattern in INTERNAL for m in pattern.finditer(text)]


def docstrings_and_comments(paths: Iterable[Path]) -> Iterator[tuple[str, int, str]]:
    """``(file, line, text)`` of every docstring and ``#`` comment in the Python files ``paths``."""
    for path in paths:
        source = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        for number, line in enumerate(source.splitlines(), 1):
            if "#" in line:
                comment = line[line.index("#"):]
                yield rel, number, comment
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield rel, getattr(node, "lineno", 1), doc


def python_sources() -> list[Path]:
    """The project's Python files whose docstrings and comments a reader sees: the package, scripts, tests,
    walkthroughs."""
    return sorted(p for d in ("reference_impl", "scripts", "tests", "phases") for p in (ROOT / d).rglob("*.py")
                  if p != Path(__file__).resolve())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    site = Path(args[0])
    defined = defined_tests()
    found = 0
    for page, text in site_pages(site):
        for what, hits in (("marker source", marker_leaks(text)), ("cited test that does not exist", sorted(missing_tests(text, defined))),
                           ("internal reference", internal_references(text))):
            for hit in hits:
                print(f"{page}: {what}: {hit}")
                found += 1
    for rel, line, text in docstrings_and_comments(python_sources()):
        for hit in internal_references(text):
            print(f"{rel}:{line}: internal reference: {hit}")
            found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

"""Checks of the built site as a reader sees it (``mkdocs build``'s HTML), and of the package's docstrings.

The markdown can be right and the page still wrong: a table cell that swallows a figure marker,
a test name that was renamed, a sentence that cites the project's own work items. These functions
read what a browser shows (text nodes; comments, scripts and styles left out) and return what they
find; ``tests/test_site.py`` asserts on them.

    python3 scripts/site_checks.py SITE_DIR     # print every finding on a built site; exit 1 if any
"""

from __future__ import annotations

import ast
import functools
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
    return [text[max(0, m.start() - 40) : m.end() + 60].strip() for m in _MARKER.finditer(text)]


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
        names.update(
            n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        )
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
    return [
        text[max(0, m.start() - 40) : m.end() + 40].replace("\n", " ").strip()
        for pattern in INTERNAL
        for m in pattern.finditer(text)
    ]


def docstrings_and_comments(paths: Iterable[Path]) -> Iterator[tuple[str, int, str]]:
    """``(file, line, text)`` of every docstring and ``#`` comment in the Python files ``paths``."""
    for path in paths:
        source = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        for number, line in enumerate(source.splitlines(), 1):
            if "#" in line:
                comment = line[line.index("#") :]
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
    return sorted(
        p
        for d in ("reference_impl", "scripts", "tests", "phases")
        for p in (ROOT / d).rglob("*.py")
        if p != Path(__file__).resolve()
    )


# ------------------------------------------------------------------------------- the page's structure


class _Structure(HTMLParser):
    """What a page links to, the ids it defines, the scripts it loads, and its paragraphs as lines: text
    with ``\x01`` where a ``<strong>`` opens and ``\x02`` where it closes (a bold label at a line start)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.hrefs: list[str] = []
        self.ids: set[str] = set()
        self.script_srcs: list[str] = []
        self.script_bodies: list[str] = []
        self.paragraphs: list[str] = []
        self.code_spans: list[str] = []
        self._paragraph: list[str] | None = None
        self._script: list[str] | None = None
        self._code: list[str] | None = None
        self._pre = 0  # inside <pre>: a code block, not prose

    def handle_starttag(self, tag: str, attrs: list) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(found["id"])
        if tag == "a" and found.get("href") is not None:
            self.hrefs.append(found["href"])
        elif tag == "script":
            if found.get("src") is not None:
                self.script_srcs.append(found["src"])
            self._script = []
        elif tag == "pre":
            self._pre += 1
        elif tag == "p" and not self._pre:
            self._paragraph = []
        elif tag == "strong" and self._paragraph is not None:
            self._paragraph.append("\x01")
        elif tag == "code" and not self._pre:
            self._code = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "script" and self._script is not None:
            self.script_bodies.append("".join(self._script))
            self._script = None
        elif tag == "pre":
            self._pre = max(0, self._pre - 1)
        elif tag == "p" and self._paragraph is not None:
            self.paragraphs.append("".join(self._paragraph))
            self._paragraph = None
        elif tag == "strong" and self._paragraph is not None:
            self._paragraph.append("\x02")
        elif tag == "code" and self._code is not None:
            self.code_spans.append("".join(self._code))
            self._code = None

    def handle_data(self, data: str) -> None:
        if self._script is not None:
            self._script.append(data)
        if self._paragraph is not None:
            self._paragraph.append(data)
        if self._code is not None:
            self._code.append(data)


def structure(html: str) -> _Structure:
    parser = _Structure()
    parser.feed(html)
    parser.close()
    return parser


def html_pages(site: Path) -> Iterator[tuple[str, str]]:
    """``(page, HTML)`` of every page of a built site but the search and 404 pages."""
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site).as_posix()
        if rel in ("404.html",) or rel.startswith(("search/", "assets/")):
            continue
        yield rel, path.read_text(encoding="utf-8")


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    """The ids a built page defines, parsed once per page (every link to it reads them)."""
    return frozenset(structure(path.read_text(encoding="utf-8")).ids)


def broken_links(site: Path, page: str, html: str) -> list[str]:
    """The relative links of ``page`` (a path under ``site``) that lead nowhere: a target that is not a
    file or a folder with an ``index.html`` (a ``.md`` or ``.ipynb`` source path, say), or an anchor that
    the target page does not define. The strict build checks the Markdown pages' links, not those inside
    a notebook."""
    found = []
    here = (site / page).parent
    for href in structure(html).hrefs:
        if not href or href.startswith("#") or re.match(r"^[a-z][a-z0-9+.-]*:|^//", href, re.I):  # external
            continue
        target, _, anchor = href.partition("#")
        path = (here / target.split("?")[0]).resolve()
        if path.is_dir():
            path = path / "index.html"
        if not path.is_file():
            found.append(f"{href}: no such page")
        elif anchor and path.suffix == ".html" and anchor not in _anchors(path):
            found.append(f"{href}: no anchor #{anchor} on that page")
    return found


#: A line of a paragraph that starts the way a Markdown list item does: Markdown read it as text.
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d{1,3}\.)\s+\S")
#: A line that opens with a bold label (``**Buys:** ...``).
_LABEL = re.compile(r"^\s*\x01[^\x01\x02]{1,40}:\s*\x02")


def run_on_lists(html: str) -> list[str]:
    """Paragraphs that swallowed a list: a line after the first that starts like a list item (a list needs
    a blank line before it, after a paragraph), or two lines that open with a bold label (``**Changes:**``
    / ``**Buys:**`` lines that markdown joined into one paragraph)."""
    found = []
    for paragraph in structure(html).paragraphs:
        lines = paragraph.split("\n")
        items = [line for line in lines[1:] if _LIST_ITEM.match(line)]
        labels = [line for line in lines if _LABEL.match(line)]
        if items or len(labels) >= 2:
            shown = (items or labels[1:])[0].replace("\x01", "").replace("\x02", "").strip()
            found.append(f"{lines[0].replace(chr(1), '').replace(chr(2), '').strip()[:60]} ... {shown[:60]}")
    return found


#: Where a page's script pulls code from the network: a ``src``, or an ``import`` inside the script.
_NETWORK = re.compile(r"^(?:https?:)?//", re.I)
_IMPORT = re.compile(r"""\bimport\s*(?:\(\s*|[\w{}*,\s]*\bfrom\s*|\s)["'`]((?:https?:)?//[^"'`]+)""", re.I)


def network_scripts(html: str) -> list[str]:
    """Every script a page loads from the network: ``<script src="http...">`` and an ``import`` of an
    ``http`` address inside a script (nbconvert's diagram loader does that)."""
    parsed = structure(html)
    return [src for src in parsed.script_srcs if _NETWORK.match(src)] + [
        m.group(1) for body in parsed.script_bodies for m in _IMPORT.finditer(body)
    ]


#: A host folder of the machine that ran a benchmark: a reader has no such path.
_HOST_PATH = re.compile(r"(?<![\w$.~-])/(?:root|tmp)/\S*")
#: A recorded command: the code span after "Command:" (the results tables' line), or one that runs the package.
_COMMAND = re.compile(r"^\s*(?:PYTHONPATH=\S+\s+)?(?:python3?|bash|torchrun)\s")


def host_paths_in_commands(html: str) -> list[str]:
    """Host paths (``/root/...``, ``/tmp/...``) inside the recorded commands a page shows: every code span
    that is a command line (``python ...``, ``bash ...``) and the text after ``Command:``."""
    parsed = structure(html)
    commands = [code for code in parsed.code_spans if _COMMAND.match(code)]
    text = visible_text(html)
    commands += [m.group(1) for m in re.finditer(r"\bCommand:\s*([^\n]+)", text)]
    return sorted(
        {f"{m.group(0)} in `{command.strip()[:100]}`" for command in commands for m in _HOST_PATH.finditer(command)}
    )


#: The README is the repository's front page: what to run, the status, the links; detail lives on the site.
README_BUDGET = 12_000


def readme_over_budget(text: str, budget: int = README_BUDGET) -> int:
    """How many characters ``text`` has past ``budget`` (0 when within it)."""
    return max(0, len(text) - budget)


def structure_findings(site: Path) -> Iterator[tuple[str, str, str]]:
    """``(page, what, finding)`` of the structural checks over every page of a built site."""
    for page, html in html_pages(site):
        for what, hits in (
            ("broken link", broken_links(site, page, html)),
            ("list rendered as a paragraph", run_on_lists(html)),
            ("script from the network", network_scripts(html)),
            ("host path in a recorded command", host_paths_in_commands(html)),
        ):
            for hit in hits:
                yield page, what, hit


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    site = Path(args[0])
    defined = defined_tests()
    found = 0
    for page, text in site_pages(site):
        for what, hits in (
            ("marker source", marker_leaks(text)),
            ("cited test that does not exist", sorted(missing_tests(text, defined))),
            ("internal reference", internal_references(text)),
        ):
            for hit in hits:
                print(f"{page}: {what}: {hit}")
                found += 1
    for page, what, hit in structure_findings(site):
        print(f"{page}: {what}: {hit}")
        found += 1
    if over := readme_over_budget((ROOT / "README.md").read_text(encoding="utf-8")):
        print(f"README.md: {over:,} characters over its budget of {README_BUDGET:,}")
        found += 1
    for rel, line, text in docstrings_and_comments(python_sources()):
        for hit in internal_references(text):
            print(f"{rel}:{line}: internal reference: {hit}")
            found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

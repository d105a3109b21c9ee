"""Render the measured figures on the docs pages from the results they came from, or check them.

A figure on a page is never typed: it sits between two HTML comments (invisible on the site and on
GitHub) that name where it comes from, and this script rewrites the text between them.

* ``<!-- fig EXPR -->text<!-- /fig -->``: ``EXPR`` is a Python expression over the results (the
  names below), its value shown with ``str``; ``<!-- fig:FORMAT EXPR -->`` formats it with a format
  spec first (``fig:.2f``, ``fig:,``, ``fig:.0%``). The format sits in the marker's keyword, so no
  character of it can collide with the markdown around the marker. A value may span lines:
  ``table(...)`` renders a whole markdown table.
* Markdown sees two things inside the comments: a ``|`` splits a table cell, and ``][`` reads as
  a reference link to mkdocs-autorefs. So a marker inside a table row may not contain a ``|``
  (refused here: format with ``fig:FORMAT``, build strings with ``"...".format``), and an
  expression uses attribute access (``w.levels[4]``, not ``w["levels"][4]``). An inline marker may
  not start a line: markdown would read the comment as an HTML block and cut the paragraph
  (refused here). The old filter syntax, ``<!-- fig EXPR | FORMAT -->``, is refused everywhere
  (``--upgrade`` rewrites it).
* ``<!-- console: ARGS -->`` on the line before a ````text```` block: the block is what
  ``python -m reference_impl ARGS`` prints on a CPU (``ARGS`` may end in a shell filter,
  ``| grep ...``). Wall-clock columns and the machine's architecture are compared as patterns.

Names an expression can use:

* every ``docs/results/NAME.json`` as ``NAME`` (attribute access: ``compute_bench.per_rank.attention.engine_tflops``);
* ``notebook("phase1_narrow_output")``: the JSON object the executed notebook printed last;
* ``printed("phase7_fused_kernels", r"copy (\\d+) GB/s")``: the first group of a pattern in what it printed;
* ``find(items, key=value, ...)``: the one element whose fields match (``a__b`` reaches ``a["b"]``);
* ``layer_level(doc, prefix, extend, level)``: one level's row of a ``bench.layer`` workload;
* ``span(values, FORMAT)``: ``"lo-hi"`` (or one value where they are equal);
* ``rows(items, "| a | b |", "| {a:.2f} | {b:,} |")``: a markdown table, one row per item;
* ``table(KIND, doc)``: a table of :mod:`results_tables` (``compute``, ``kernels``, ``layer``);
* ``optional("NAME")``: ``docs/results/NAME.json`` where it exists, else ``None`` (a table says "not measured");
* ``design_verdict(doc, a, b, prefix, extend)``: ``bench.designs``' paired verdict of design ``a`` against ``b``;
* ``level_verdict(doc, prefix, extend, a, b)``: ``bench.layer``'s paired verdict of level ``a`` against level ``b``
  ("not re-measured with paired repeats" for a file from before the paired protocol);
* ``min``, ``max``, ``abs``, ``len``, ``sum``, ``round``, ``sorted``.

Usage::

    python3 scripts/render_docs.py            # check every page; exit 1 naming each figure that differs
                                              # and each time or rate typed outside a marker
    python3 scripts/render_docs.py --write    # rewrite the pages from the results
    python3 scripts/render_docs.py --no-console  # figures only (the console examples take a minute)
    python3 scripts/render_docs.py --write docs/phases/phase3-current-reuse.md   # one page
    python3 scripts/render_docs.py --upgrade  # rewrite old ``EXPR | FORMAT`` markers as ``fig:FORMAT EXPR``
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import results_tables  # noqa: E402
from reference_impl.errors import ConfigError  # noqa: E402
from reference_impl.tool_args import ToolParser, refusing  # noqa: E402

PAGES = ("README.md", "docs")
FIG = re.compile(r"<!-- fig(?::(?P<fmt>\S*))? (?P<spec>.+?) -->(?P<text>.*?)<!-- /fig -->", re.S)
CONSOLE = re.compile(r"^<!-- console: (?P<args>.+?) -->\n```text\n(?P<text>.*?)```$", re.S | re.M)


# ----------------------------------------------------------------------------------- the names


class Doc(dict):
    """A JSON object whose fields read as attributes; lists and objects inside read the same way."""

    def __getattr__(self, name: str) -> Any:
        try:
            return wrap(self[name])
        except KeyError:
            raise AttributeError(f"no field {name!r} (fields: {', '.join(self)})") from None

    def __getitem__(self, key: Any) -> Any:
        return wrap(dict.__getitem__(self, key))


class Items(list):
    def __getitem__(self, i: Any) -> Any:
        return wrap(list.__getitem__(self, i))

    def __iter__(self):  # noqa: ANN204
        return (wrap(v) for v in list.__iter__(self))


def wrap(value: Any) -> Any:
    if isinstance(value, dict) and not isinstance(value, Doc):
        return Doc(value)
    if isinstance(value, list) and not isinstance(value, Items):
        return Items(value)
    return value


def _field(item: Mapping[str, Any], path: str) -> Any:
    for key in path.split("__"):
        item = item[key]
    return item


def find(items: Iterable[Any], **match: Any) -> Any:
    """The one element of ``items`` whose fields equal ``match`` (``a__b`` reaches ``a["b"]``)."""
    hits = [it for it in items if all(_field(it, k) == v for k, v in match.items())]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} elements match {match}, need exactly one")
    return wrap(hits[0])


def layer_level(doc: Doc, prefix: int, extend: int, level: int) -> Doc:
    """The row of ``level`` in the ``bench.layer`` workload of ``prefix`` cached + ``extend`` new tokens."""
    workload = find(doc.workloads, workload__prefix=prefix, workload__extend=extend)
    return find(workload.levels, level=level)


def span(values: Iterable[float], fmt: str = "") -> str:
    """``"lo-hi"`` of ``values`` formatted (one value where both ends format alike)."""
    vals = sorted(values)
    lo, hi = format(vals[0], fmt), format(vals[-1], fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def rows(items: Iterable[Mapping[str, Any]], header: str, row: str) -> str:
    """A markdown table: ``header`` (``"| a | b |"``), its rule, and ``row.format(**item)`` per item."""
    columns = header.count("|") - 1
    lines = [header, "|" + " --- |" * columns] + [row.format(**{k: wrap(v) for k, v in item.items()}) for item in items]
    return "\n\n" + "\n".join(lines) + "\n\n"


def table(kind: str, doc: Doc) -> str:
    """A :mod:`results_tables` table, set off by blank lines so that markdown sees a block."""
    renderer: Callable[[dict], str] = getattr(results_tables, kind)
    return f"\n\n{renderer(doc)}\n\n"


@dataclass
class Sources:
    """The results a page may cite: ``docs/results/*.json`` and the executed notebooks' JSON."""

    results_dir: Path = ROOT / "docs" / "results"
    notebooks_dir: Path = ROOT / "docs" / "notebooks"

    def namespace(self) -> dict[str, Any]:
        names: dict[str, Any] = {
            "find": find,
            "layer_level": layer_level,
            "span": span,
            "rows": rows,
            "table": table,
            "notebook": self.notebook,
            "printed": self.printed,
            "min": min,
            "max": max,
            "abs": abs,
            "len": len,
            "sum": sum,
            "round": round,
            "sorted": sorted,
        }
        for path in sorted(self.results_dir.glob("*.json")):
            names[path.stem] = wrap(json.loads(path.read_text()))
        names["optional"] = lambda stem: names.get(stem)  # a results file that may not exist yet: None
        names["design_verdict"] = results_tables.design_verdict
        names["level_verdict"] = results_tables.level_verdict
        return names

    def _printed_outputs(self, name: str) -> list[str]:
        """What each output of ``docs/notebooks/NAME.ipynb`` printed (its stored, executed outputs)."""
        cells = json.loads((self.notebooks_dir / f"{name}.ipynb").read_text())["cells"]
        return ["".join(out.get("text", [])) for cell in cells for out in cell.get("outputs", [])]

    def printed(self, name: str, pattern: str) -> str:
        """The first group of ``pattern`` in what ``docs/notebooks/NAME.ipynb`` printed."""
        m = re.search(pattern, "\n".join(self._printed_outputs(name)), re.M)
        if m is None:
            raise LookupError(f"docs/notebooks/{name}.ipynb printed nothing that matches {pattern!r}")
        return m.group(1)

    def notebook(self, name: str) -> Doc:
        """The last JSON object printed by ``docs/notebooks/NAME.ipynb``."""
        found, decoder = None, json.JSONDecoder()
        for printed in self._printed_outputs(name):
            for m in re.finditer(r"^\{", printed, re.M):
                try:
                    found = decoder.raw_decode(printed, m.start())[0]
                except json.JSONDecodeError:
                    continue
        if found is None:
            raise LookupError(f"docs/notebooks/{name}.ipynb printed no JSON object")
        return wrap(found)


_FORMAT_SPEC = re.compile(r"[<>^=]?[+\- ]?#?0?\d*[,_]?(\.\d+)?[bcdeEfFgGnosxX%]?")


def old_filter(spec: str) -> tuple[str, str] | None:
    """``(EXPR, FORMAT)`` where ``spec`` uses the old filter syntax ``EXPR | FORMAT``, else None."""
    expr, _, fmt = spec.rpartition(" | ")
    return (expr, fmt.strip()) if expr and fmt.strip() and _FORMAT_SPEC.fullmatch(fmt.strip()) else None


def render_figure(spec: str, names: dict[str, Any], fmt: str = "") -> str:
    """Evaluate ``spec`` over ``names`` and format the value with ``fmt`` (a format spec)."""
    if old_filter(spec):
        raise ValueError(
            "the old filter syntax `EXPR | FORMAT` (a table reads its pipe as a cell border): "
            "write `<!-- fig:FORMAT EXPR -->`; `python3 scripts/render_docs.py --upgrade` rewrites it"
        )
    if fmt and not _FORMAT_SPEC.fullmatch(fmt):
        raise ValueError(f"`fig:{fmt}`: not a format spec")
    value = eval(spec, {"__builtins__": {}, **names})  # noqa: S307 - our own pages, our own results
    return format(value, fmt)


def upgrade_markers(text: str) -> str:
    """``text`` with every old-syntax marker ``<!-- fig EXPR | FORMAT -->`` written ``<!-- fig:FORMAT EXPR -->``."""

    def one(m: re.Match[str]) -> str:
        old = None if m["fmt"] is not None else old_filter(m["spec"])
        if old is None:
            return m.group(0)
        return f"<!-- fig:{old[1]} {old[0]} -->{m['text']}<!-- /fig -->"

    return FIG.sub(one, text)


def _indent_like(text: str, start: int, value: str) -> str:
    """A multi-line value keeps the indentation of the line its marker opens on (a list item's table)."""
    line_start = text.rfind("\n", 0, start) + 1
    indent = text[line_start:start]
    if "\n" not in value or not indent or indent.strip():
        return value
    lines = value.split("\n")
    last = len(lines) - 1  # the closing marker's line
    return "\n".join(indent + line if i and (line or i == last) else line for i, line in enumerate(lines))


# --------------------------------------------------------------------------------- the console


_WALL_CLOCK_HEADER = re.compile(r"\bms\s*$")


def normalize_console(text: str) -> str:
    """What two runs of one command on CPUs share: the last column of rows under a header that ends in
    ``ms`` is wall time, and ``cpu (ARCH)`` names the machine."""
    out, timed = [], False
    for line in text.splitlines():
        line = re.sub(r"cpu \([^)]*\)", "cpu (ARCH)", line)
        if _WALL_CLOCK_HEADER.search(line) and not re.search(r"\d\s*$", line):
            timed = True
        elif timed and re.match(r"^\s+\d+\s", line):
            line = re.sub(r"\s*\d+(\.\d+)?\s*$", " <ms>", line)
        else:
            timed = False
        out.append(line.rstrip())
    return "\n".join(out).strip()


def run_console(args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "120"}
    cmd = f"{sys.executable} -m reference_impl {args}"
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    if proc.returncode not in (0, 1):  # 1: the filter matched nothing or the run disagreed; both show
        raise RuntimeError(f"`python -m reference_impl {args}` exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return proc.stdout


# ----------------------------------------------------------------------------- the typed figures


# A time or a rate typed into prose is a measurement nobody re-renders. Figures that are not
# measurements (a device's datasheet, another project's published number, a configured wire speed in
# a command line) go in code spans or carry a ``<!-- typed: why -->`` comment on their line.
_UNITS = r"(ms|us|µs|TFLOPS|GB/s|TB/s)"
MEASURED = re.compile(r"(?<![\w.])\d[\d,]*(\.\d+)?\s?" + _UNITS + r"\b")
_FENCE = re.compile(r"^\s*```.*?^\s*```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def typed_figures(text: str) -> list[tuple[int, str]]:
    """``(line, figure)`` for each measured-looking figure outside markers, code and ``typed:`` lines."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731 - keep line numbers
    text = FIG.sub(blank, text)
    text = CONSOLE.sub(blank, text)
    text = _FENCE.sub(blank, text)
    text = _CODE_SPAN.sub(blank, text)
    found = []
    lines = text.splitlines()
    timed_columns: list[int] = []  # the columns of the current table whose header names a time or a rate
    for number, line in enumerate(lines, 1):
        cells = _cells(line)
        following = _cells(lines[number]) if number < len(lines) else None
        if following is not None and set("".join(following)) <= set("-: ") and cells is not None:
            timed_columns = [i for i, c in enumerate(cells) if _TIMED_HEADER.search(c)]  # a header row
            continue
        if cells is None:
            timed_columns = []
        if "<!-- typed:" in line:
            continue
        found += [(number, m.group(0)) for m in MEASURED.finditer(line)]
        if cells is not None:
            found += [(number, cells[i]) for i in timed_columns if i < len(cells) and re.search(r"\d", cells[i])]
    return found


def _cells(line: str) -> list[str] | None:
    return [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None


_TIMED_HEADER = re.compile(r"\b" + _UNITS + r"\b")


# ------------------------------------------------------------------------------------- the pages


@dataclass
class Difference:
    page: Path
    line: int
    spec: str
    page_text: str
    rendered: str

    def __str__(self) -> str:
        where = f"{self.page.relative_to(ROOT)}:{self.line}: `{self.spec[:120]}`"
        if "\n" not in self.rendered.strip():
            return f"{where} renders {self.rendered.strip()!r}, the page says {self.page_text.strip()!r}"
        diff = difflib.unified_diff(
            self.page_text.strip().splitlines(),
            self.rendered.strip().splitlines(),
            "page",
            "rendered",
            lineterm="",
            n=0,
        )
        return where + " differs:\n" + "\n".join(list(diff)[:20])


def page_paths(only: Iterable[Path] = ()) -> list[Path]:
    """README.md and every page under docs/, or those of them that ``only`` names."""
    chosen = {p.resolve() for p in only}
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in paths if not chosen or p in chosen]


def render_page(
    text: str, names: dict[str, Any], console: Callable[[str], str] | None
) -> tuple[str, list[tuple[int, str, str, str]]]:
    """``text`` with every marker rendered, and ``(line, spec, page text, rendered)`` for each change
    (console blocks compared normalized)."""
    changes: list[tuple[int, str, str, str]] = []

    def figure(m: re.Match[str]) -> str:
        line = text.count("\n", 0, m.start()) + 1
        line_start = text.rfind("\n", 0, m.start()) + 1
        if text[line_start : m.start()].lstrip().startswith("|") and "|" in m["spec"]:
            raise ValueError(
                f"line {line}: `{m['spec'][:80]}` sits in a table row and contains a `|`, which the "
                'table reads as a cell border: format with `fig:FORMAT`, build strings with "...".format'
            )
        try:
            rendered = _indent_like(text, m.start(), render_figure(m["spec"], names, m["fmt"] or ""))
        except Exception as e:
            raise ValueError(f"line {line}: `{m['spec']}` does not render: {type(e).__name__}: {e}") from e
        if text[line_start : m.start()].count("`") % 2:
            raise ValueError(
                f"line {line}: a figure inside a code span shows its marker source on the page: "
                "take the backticks off, or put them inside the figure's format"
            )
        starts_line = not text[line_start : m.start()].strip()
        if starts_line and "\n" not in rendered:
            raise ValueError(
                f"line {line}: an inline figure starts the line, where markdown reads the comment as "
                "an HTML block and cuts the paragraph: move a word in front of it"
            )
        if rendered != m["text"]:
            changes.append((line, m["spec"], m["text"], rendered))
        keyword = "fig" if m["fmt"] is None else f"fig:{m['fmt']}"
        return f"<!-- {keyword} {m['spec']} -->{rendered}<!-- /fig -->"

    text = FIG.sub(figure, text)
    if console is None:
        return text, changes

    def block(m: re.Match[str]) -> str:
        rendered = console(m["args"]).rstrip() + "\n"
        if normalize_console(rendered) == normalize_console(m["text"]):
            return m.group(0)
        changes.append((text.count("\n", 0, m.start()) + 1, "console: " + m["args"], m["text"], rendered))
        return f"<!-- console: {m['args']} -->\n```text\n{rendered}```"

    return CONSOLE.sub(block, text), changes


def render_all(sources: Sources, console: bool, write: bool, only: Iterable[Path] = ()) -> list[Difference]:
    """Render (and with ``write`` rewrite) every page, or the pages ``only`` names; the differences."""
    names = sources.namespace()
    pages = {p: p.read_text() for p in page_paths(only)}
    outputs: dict[str, str] = {}
    if console:
        wanted = sorted({m["args"] for t in pages.values() for m in CONSOLE.finditer(t)})
        # Each example is its own process (ranks included): as many at once as the machine has cores for.
        with ThreadPoolExecutor(max_workers=max(2, min(8, (os.cpu_count() or 2) // 2))) as pool:
            outputs = dict(zip(wanted, pool.map(run_console, wanted)))
    differences = []
    for path, text in pages.items():
        try:
            new, changes = render_page(text, names, outputs.__getitem__ if console else None)
        except ValueError as e:
            raise ValueError(f"{path.relative_to(ROOT)}: {e}") from None
        differences += [Difference(path, *c) for c in changes]
        if write and new != text:
            path.write_text(new)
    return differences


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = ToolParser("python3 scripts/render_docs.py", __doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the pages from the results")
    parser.add_argument("--no-console", action="store_true", help="skip the console examples")
    parser.add_argument(
        "--upgrade",
        action="store_true",
        help="rewrite old `<!-- fig EXPR | FORMAT -->` markers as `<!-- fig:FORMAT EXPR -->`, then exit",
    )
    parser.add_argument("pages", nargs="*", type=Path, help="only these pages (default: README.md and docs/)")
    args = parser.parse_args(argv)
    site = set(page_paths())
    strays = [str(p) for p in args.pages if p.resolve() not in site]
    if strays:
        raise ConfigError(f"pages: not a page of the site (README.md or docs/**/*.md): {', '.join(strays)}")
    if args.upgrade:
        for path in page_paths(args.pages):
            text = path.read_text()
            if (new := upgrade_markers(text)) != text:
                path.write_text(new)
                print(f"upgraded {path.relative_to(ROOT)}")
        return 0
    differences = render_all(Sources(), console=not args.no_console, write=args.write, only=args.pages)
    for d in differences:
        print(("rewrote " if args.write else "") + str(d))
    typed = [(p, n, f) for p in page_paths(args.pages) for n, f in typed_figures(p.read_text())]
    for page, number, figure in typed:
        print(f"{page.relative_to(ROOT)}:{number}: {figure!r} is typed, not rendered from a result")
    if differences and not args.write:
        print(f"{len(differences)} figure(s) differ from their results: python3 scripts/render_docs.py --write")
    return 1 if (differences and not args.write) or typed else 0


if __name__ == "__main__":
    sys.exit(main())

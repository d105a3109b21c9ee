"""The site as a reader gets it: the built pages, their figures and their plots.

The strict build catches broken links; these tests catch what it does not: marker source that a
table cut loose, a cited test that does not exist, the project's own tickets and notes on a page or in
a docstring, a plot older than its results, one metric quoted from two runs, a page over its prose
budget, a diagram that needs the network. The site is built once per session (or taken from
``DSACP_SITE_DIR``, where ``scripts/test.sh`` has built it already).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import draw_diagrams  # noqa: E402
import figure_sources  # noqa: E402
import plot_results  # noqa: E402
import prose_words  # noqa: E402
import site_checks  # noqa: E402
from reference_impl import figures  # noqa: E402
from render_docs import Sources  # noqa: E402


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site: ``DSACP_SITE_DIR`` when it holds one, else one strict build for the session."""
    given = os.environ.get("DSACP_SITE_DIR")
    if given and (Path(given) / "index.html").is_file():
        return Path(given)
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def pages(site: Path) -> dict[str, str]:
    """Visible text of every page, and of README.md (the repository's front page)."""
    found = dict(site_checks.site_pages(site))
    found["README.md"] = re.sub(r"<!--.*?-->", "", (ROOT / "README.md").read_text(), flags=re.S)  # as GitHub shows it
    return found


# --------------------------------------------------------------------------- the built pages


def test_no_page_shows_figure_marker_source(pages: dict[str, str]) -> None:
    leaks = {
        page: hits for page, text in pages.items() if page != "README.md" and (hits := site_checks.marker_leaks(text))
    }
    assert not leaks, "marker source a reader sees (a `|` in a table row's marker?):\n" + "\n".join(
        f"{page}: {hit}" for page, hits in leaks.items() for hit in hits[:3]
    )


def test_every_test_a_page_cites_exists(pages: dict[str, str]) -> None:
    defined = site_checks.defined_tests()
    missing = {
        page: sorted(names) for page, text in pages.items() if (names := site_checks.missing_tests(text, defined))
    }
    assert not missing, "cited tests that do not exist under tests/:\n" + "\n".join(
        f"{p}: {n}" for p, n in missing.items()
    )


def test_no_page_cites_the_projects_own_tickets_or_notes(pages: dict[str, str]) -> None:
    found = {page: hits for page, text in pages.items() if (hits := site_checks.internal_references(text))}
    assert not found, "internal references:\n" + "\n".join(f"{p}: {h}" for p, hits in found.items() for h in hits)


def test_no_docstring_or_comment_cites_the_projects_own_tickets_or_notes() -> None:
    found = [
        f"{path}:{line}: {hit}"
        for path, line, text in site_checks.docstrings_and_comments(site_checks.python_sources())
        for hit in site_checks.internal_references(text)
    ]
    assert not found, "internal references:\n" + "\n".join(found)


def test_diagrams_render_offline(site: Path) -> None:
    """Every page with a diagram loads the bundled diagram library, and no page loads a script from the network:
    neither a ``<script src="http...">`` nor an ``import("http...")`` inside a script (nbconvert's diagram loader
    on the notebook pages)."""
    assert (site / "javascripts" / "mermaid.min.js").stat().st_size > 1_000_000
    found = {}
    for path in site.rglob("*.html"):
        html = path.read_text(encoding="utf-8")
        if 'class="mermaid"' in html:
            assert "javascripts/mermaid.min.js" in html, path
        if hits := site_checks.network_scripts(html):
            found[path.relative_to(site).as_posix()] = hits
    assert not found, "scripts loaded from the network:\n" + "\n".join(f"{p}: {h}" for p, h in found.items())


def test_every_relative_link_of_every_page_leads_to_a_page(site: Path) -> None:
    """The strict build checks the Markdown pages' links; this follows every page's, the notebooks' included."""
    found = {
        page: hits
        for page, html in site_checks.html_pages(site)
        if (hits := site_checks.broken_links(site, page, html))
    }
    assert not found, "broken links:\n" + "\n".join(f"{p}: {h}" for p, hits in found.items() for h in hits)


def test_no_list_renders_as_a_paragraph(site: Path) -> None:
    found = {page: hits for page, html in site_checks.html_pages(site) if (hits := site_checks.run_on_lists(html))}
    assert not found, "lists that render as paragraphs (a list needs a blank line before it):\n" + "\n".join(
        f"{p}: {h}" for p, hits in found.items() for h in hits
    )


def test_no_recorded_command_shows_a_host_path(site: Path) -> None:
    """A recorded command names paths a reader has (``$OUT/...``), not the benchmark machine's folders."""
    found = {
        page: hits for page, html in site_checks.html_pages(site) if (hits := site_checks.host_paths_in_commands(html))
    }
    assert not found, "host paths in recorded commands:\n" + "\n".join(
        f"{p}: {h}" for p, hits in found.items() for h in hits
    )


def test_the_readme_keeps_its_budget() -> None:
    over = site_checks.readme_over_budget((ROOT / "README.md").read_text(encoding="utf-8"))
    assert not over, f"README.md is {over:,} characters over {site_checks.README_BUDGET:,}: move detail to a docs page"


# ------------------------------------------------------------------------- figures and plots


def test_every_plot_and_diagram_is_what_its_sources_say() -> None:
    from reference_impl.demo import demo_figure_data

    stale = plot_results.stale(ROOT / "docs" / "results", ROOT / "docs" / "results") + draw_diagrams.stale()
    demo = json.loads((ROOT / "docs" / "results" / "demo_h200.json").read_text())
    if figures.embedded(ROOT / "docs" / "results" / "demo_h200.png") != figures.expected(demo_figure_data(demo)):
        stale.append("demo_h200.png")
    assert not stale, f"redraw: python3 scripts/plot_results.py; python3 scripts/draw_diagrams.py ({stale})"


def test_a_plot_goes_stale_when_its_results_change(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(ROOT / "docs" / "results", results)
    doc = json.loads((results / "layer_bench.json").read_text())
    doc["workloads"][0]["levels"][3]["layer_ms_median"] += 1.0
    (results / "layer_bench.json").write_text(json.dumps(doc))
    assert plot_results.stale(results, ROOT / "docs" / "results") == ["layer_bench.svg"]


def test_the_capacity_results_are_what_the_planner_says() -> None:
    import capacity_plan
    from reference_impl.figures import same_up_to_rounding

    committed = json.loads(capacity_plan.OUT.read_text())
    assert same_up_to_rounding(committed, capacity_plan.planned()), "rerun: python3 scripts/capacity_plan.py"


def test_a_metric_quoted_on_two_pages_comes_from_one_results_field() -> None:
    found = figure_sources.conflicts(figure_sources.figure_reads())
    assert not found, figure_sources.explain(found)


def test_the_metric_check_sees_two_runs_of_one_metric(tmp_path: Path) -> None:
    """Two pages quoting the per-rank top-k time, one from each of two results files, conflict."""
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text("x <!-- fig compute_bench.per_rank.indexer.topk_ms -->?<!-- /fig -->\n")
    b.write_text("x <!-- fig topk_select_h200.compute_bench.per_rank.indexer.topk_ms -->?<!-- /fig -->\n")
    found = figure_sources.conflicts(figure_sources.figure_reads([a, b], Sources()))
    assert [metric[0] for metric in found] == ["per_rank.indexer.topk_ms"]
    b.write_text("x <!-- fig compute_bench.per_rank.indexer.topk_ms -->?<!-- /fig -->\n")
    assert not figure_sources.conflicts(figure_sources.figure_reads([a, b], Sources()))


#: Design pages besides those under docs/phases/: each opens with what it changes, buys and costs.
DESIGN_PAGES = (
    "all-gathers.md",
    "pd-transfer.md",
    "round-robin-shared-kv.md",
    "compute-kernels.md",
    "glue-kernels.md",
    "glm-5.3.md",
)


def test_every_design_page_opens_with_what_it_changes_buys_and_costs() -> None:
    docs = ROOT / "docs"
    pages = sorted((docs / "phases").glob("*.md")) + [docs / name for name in DESIGN_PAGES]
    wrong = []
    for page in pages:
        lines = [line for line in page.read_text().splitlines() if line.strip()]
        labels = [line.split(":**")[0] for line in lines[1:4]]
        if not (lines[0].startswith("# ") and labels == ["- **Changes", "- **Buys", "- **Costs"]):
            wrong.append(page.relative_to(docs).as_posix())
    assert not wrong, (
        "open with a list of three items under the title, `- **Changes:**` / `- **Buys:**` / "
        "`- **Costs:**` (three plain lines render as one paragraph): " + ", ".join(wrong)
    )


def test_every_page_keeps_its_prose_budget() -> None:
    over = [r for r in prose_words.counts() if r["budget"] is not None and r["prose_words"] >= r["budget"]]
    assert not over, "over the prose budget (tables, code and figures aside):\n" + "\n".join(map(str, over))


# ---------------------------------------------------------------------- the checks can fail


def test_the_checks_see_a_cut_marker_a_missing_test_and_an_internal_reference() -> None:
    html = (
        "<table><tr><td>1.9 &lt;!-- fig elementwise_rate.points[-1].x</td></tr></table>"
        "<p>see <code>tests/test_split.py::test_no_such_test</code>; as issue 17 says</p>"
        '<pre class="mermaid">a --&gt; b</pre><!-- fig x -->1<!-- /fig -->'
    )
    text = site_checks.visible_text(html)
    assert len(site_checks.marker_leaks(text)) == 1
    assert site_checks.missing_tests(text, site_checks.defined_tests()) == {"test_no_such_test"}
    assert (
        [hit for hit in site_checks.internal_references(text) if "issue 17" in hit]
        == site_checks.internal_references(text)
        != []
    )
    assert site_checks.internal_references(
        "the BRIEF, commit 9d862d2, the seed notes"
    ) and not site_checks.internal_references("the seed is fixed; every rank issues the same collectives")


def test_the_link_check_sees_a_source_path_and_a_missing_anchor(tmp_path: Path) -> None:
    """A notebook page that links ``../phases/x.md`` (the source, not the built page) or an anchor the page lacks."""
    (tmp_path / "phases" / "x").mkdir(parents=True)
    (tmp_path / "phases" / "x" / "index.html").write_text('<h2 id="measured-results">M</h2>')
    (tmp_path / "notebooks" / "nb").mkdir(parents=True)
    page = "notebooks/nb/index.html"
    good = (
        '<a href="../../phases/x/#measured-results">x</a> <a href="https://example.org/a.md">e</a> <a href="#top">t</a>'
    )
    assert site_checks.broken_links(tmp_path, page, good) == []
    assert site_checks.broken_links(tmp_path, page, '<a href="../phases/x.md#measured-results">x</a>') == [
        "../phases/x.md#measured-results: no such page"
    ]
    assert site_checks.broken_links(tmp_path, page, '<a href="../../phases/x/#results">x</a>') == [
        "../../phases/x/#results: no anchor #results on that page"
    ]


def test_the_walkthrough_check_sees_a_link_to_a_page_source() -> None:
    import nbformat

    from execute_notebooks import source_links

    cell = nbformat.v4.new_markdown_cell
    notebook = nbformat.v4.new_notebook(
        cells=[
            cell("See the [page](../phases/p7.md#measured-results)."),
            cell("[built](../../phases/p7/) and [ext](https://x.org/r.md)"),
        ]
    )
    assert source_links(notebook) == ["../phases/p7.md#measured-results"]


def test_the_list_check_sees_a_swallowed_list_and_a_run_on_header() -> None:
    import markdown

    def html(source: str) -> str:
        return markdown.markdown(source)

    swallowed = "### Operations\n\n1. **Store** every layer.\n\n    Indented paragraph.\n2. **Read** the view.\n"
    assert site_checks.run_on_lists(html(swallowed)) != []
    assert site_checks.run_on_lists(html(swallowed.replace("paragraph.\n2.", "paragraph.\n\n2."))) == []
    assert site_checks.run_on_lists(html("Some text:\n- first\n- second\n")) != []
    header = "# Page\n\n**Changes:** a.\n**Buys:** b.\n**Costs:** c.\n"
    assert site_checks.run_on_lists(html(header)) != []
    assert site_checks.run_on_lists(html(header.replace("\n**", "\n- **"))) == []
    assert site_checks.run_on_lists(html("A sentence that wraps at a dash\nand a **bold:** word, 1 - 2.\n")) == []


def test_the_script_check_sees_a_network_script_and_a_network_import() -> None:
    cdn = "https://cdn.example/m.js"
    assert site_checks.network_scripts(f'<script src="{cdn}"></script>') == [cdn]
    loader = '<script type="module">const m = (await import("https://cdnjs.example/m.esm.mjs")).default;</script>'
    assert site_checks.network_scripts(loader) == ["https://cdnjs.example/m.esm.mjs"]
    local = '<script src="../../javascripts/mermaid.min.js"></script><script>x()</script>'
    assert site_checks.network_scripts(local) == []


def test_the_notebook_hook_drops_the_network_loader() -> None:
    sys.path.insert(0, str(ROOT / "docs"))
    from offline_notebooks import drop_network_loaders

    loader = '<script type="module">\n  const m = (await import("https://cdnjs.example/m.mjs")).default;\n</script>'
    page = f"<script>keep()</script>{loader}<p>text</p>"
    assert site_checks.network_scripts(page) and not site_checks.network_scripts(drop_network_loaders(page))
    assert drop_network_loaders(page) == "<script>keep()</script><p>text</p>"


def test_the_command_check_sees_a_host_path() -> None:
    line = "<p>Command: <code>python -m reference_impl.bench.layer --out {} --wire-gbps 450</code>.</p>"
    assert site_checks.host_paths_in_commands(line.format("/root/out/layer_bench.json")) != []
    assert site_checks.host_paths_in_commands("<p><code>python -m x --libs /tmp/mcdeps</code></p>") != []
    assert site_checks.host_paths_in_commands(line.format("$OUT/layer_bench.json")) == []
    assert site_checks.host_paths_in_commands("<pre><code>json.load(open('/tmp/walkthrough.json'))</code></pre>") == []


def test_the_readme_budget_check_counts_characters() -> None:
    assert site_checks.readme_over_budget("x" * 12_000) == 0
    assert site_checks.readme_over_budget("x" * 12_001) == 1


def test_the_budget_counts_prose_not_tables_code_or_figures() -> None:
    page = (
        "# Title\n\nTwo words here.\n\n| a | b |\n| --- | --- |\n| many words in a table |\n\n"
        "```python\ncode words\n```\n\nA <!-- fig 1 -->rendered figure words<!-- /fig --> [link text](x.md).\n"
    )
    assert prose_words.prose_words(page) == 7  # Title, Two words here., A, link text


def test_results_compare_equal_up_to_float_rounding_and_no_further() -> None:
    """A results file recomputed under another Python (3.12 sums floats with compensation) still
    compares equal; a real change, a missing key or a bool for a float does not."""
    from reference_impl.figures import same_up_to_rounding

    committed = {"plan": {"ms": [0.1 + 0.2, 3], "name": "x"}}
    assert same_up_to_rounding(committed, {"plan": {"ms": [0.3, 3], "name": "x"}})
    assert not same_up_to_rounding(committed, {"plan": {"ms": [0.3001, 3], "name": "x"}})
    assert not same_up_to_rounding(committed, {"plan": {"ms": [0.3, 3]}})
    assert not same_up_to_rounding({"ok": 1.0}, {"ok": True})

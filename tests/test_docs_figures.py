"""Docs that cannot drift: every measured figure on a page is rendered from the results it came from.

``scripts/render_docs.py`` rewrites the text between a page's markers; these tests fail when a page
and its results disagree (someone edited one and not the other), and show that they would.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import render_docs  # noqa: E402
from render_docs import Sources, normalize_console, page_paths, render_all, render_page, typed_figures  # noqa: E402


def _explain(differences: list) -> str:
    return "\n".join(map(str, differences)) + "\nrun: python3 scripts/render_docs.py --write"


def test_every_figure_on_the_pages_matches_its_results() -> None:
    differences = render_all(Sources(), console=False, write=False)
    assert not differences, _explain(differences)


def test_no_time_or_rate_is_typed_on_a_page() -> None:
    """A time or a rate outside a marker is a measurement nobody re-renders (``typed:`` lines excepted)."""
    typed = [f"{p.relative_to(ROOT)}:{n}: {f!r}" for p in page_paths() for n, f in typed_figures(p.read_text())]
    assert not typed, "typed, not rendered from a result:\n" + "\n".join(typed)


def test_the_typed_figure_check_sees_prose_and_timed_table_columns() -> None:
    page = (
        "It took 12.5 ms, `3 ms` in code, <!-- fig 1 -->1<!-- /fig --> ms rendered.\n"
        "A datasheet 4.8 TB/s. <!-- typed: the H200 datasheet -->\n\n"
        "| tokens | layer ms | KiB |\n| --- | --- | --- |\n| 4,096 | 79.4 | 56.0 |\n\nAfter 7 layers.\n"
    )
    assert typed_figures(page) == [(1, "12.5 ms"), (6, "79.4")]


def test_every_console_example_is_what_the_cli_prints() -> None:
    """The documented ``python -m reference_impl ...`` outputs, run again on this CPU (wall-clock
    columns and the machine's architecture compared as patterns)."""
    differences = [d for d in render_all(Sources(), console=True, write=False) if d.spec.startswith("console:")]
    assert not differences, _explain(differences)


def test_editing_a_result_makes_the_pages_disagree(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(ROOT / "docs" / "results", results)
    doc = json.loads((results / "layer_bench.json").read_text())
    level3 = next(w for w in doc["workloads"] if w["workload"]["extend"] == 131072)["levels"][3]
    level3["layer_ms_median"] += 1.0
    (results / "layer_bench.json").write_text(json.dumps(doc))
    differences = render_all(Sources(results_dir=results), console=False, write=False)
    pages = {d.page.name for d in differences}
    assert "phase3-current-reuse.md" in pages, _explain(differences)
    assert all("layer_bench" in d.spec for d in differences)


def test_render_fills_a_figure_and_keeps_a_table_in_its_list_item() -> None:
    names = {**Sources().namespace(), "r": render_docs.wrap({"xs": [{"a": 1.234, "b": 5000}, {"a": 2.5, "b": 7}]})}
    page = (
        "Took <!-- fig:.2f r.xs[0].a -->9<!-- /fig --> ms, "
        "span <!-- fig span((x.a for x in r.xs), '.1f') -->?<!-- /fig -->.\n"
        "1. item\n\n"
        '    <!-- fig rows(r.xs, "| a | b |", "| {a:.1f} | {b:,} |") --><!-- /fig -->\n'
    )
    text, changes = render_page(page, names, console=None)
    assert "Took <!-- fig:.2f r.xs[0].a -->1.23<!-- /fig --> ms" in text
    assert "-->1.2-2.5<!-- /fig -->" in text
    assert "\n    | a | b |\n    | --- | --- |\n    | 1.2 | 5,000 |\n    | 2.5 | 7 |\n\n    <!-- /fig -->" in text
    assert len(changes) == 3
    again, changes = render_page(text, names, console=None)
    assert again == text and not changes


def test_an_inline_figure_may_not_start_a_line() -> None:
    """Markdown reads a line that starts with a comment as an HTML block and cuts the paragraph."""
    with pytest.raises(ValueError, match="starts the line"):
        render_page("Some words\n<!-- fig 1 + 1 -->2<!-- /fig --> more.\n", {}, console=None)


def test_a_figure_inside_a_code_span_is_refused() -> None:
    """Markdown does not read a comment inside backticks as a comment: the page would show the marker."""
    with pytest.raises(ValueError, match="line 2: a figure inside a code span"):
        render_page("Words\nthe value `<!-- fig 1 + 1 -->2<!-- /fig -->` here.\n", {}, console=None)
    text, _ = render_page("Words `code` then <!-- fig 1 + 1 -->?<!-- /fig --> and `more`.\n", {}, console=None)
    assert "<!-- fig 1 + 1 -->2<!-- /fig -->" in text


def test_a_pipe_inside_a_marker_in_a_table_row_is_refused() -> None:
    """A table reads every ``|`` of its row as a cell border, the ones inside an HTML comment too: the
    cell would end in visible marker source."""
    with pytest.raises(ValueError, match=r"line 3: .* table row and contains a `\|`"):
        render_page("| a | b |\n| --- | --- |\n| x | <!-- fig 1 | 2 -->3<!-- /fig --> |\n", {}, console=None)
    text, _ = render_page("| a | b |\n| --- | --- |\n| x | <!-- fig:.1f 1 / 4 -->?<!-- /fig --> |\n", {}, console=None)
    assert "<!-- fig:.1f 1 / 4 -->0.2<!-- /fig -->" in text


def test_the_old_filter_syntax_is_refused_and_upgraded() -> None:
    old = "Took <!-- fig r.a | .2f -->1.23<!-- /fig --> ms; <!-- fig rows(r, 'a | b', 'c') -->x<!-- /fig -->\n"
    with pytest.raises(ValueError, match=r"old filter syntax"):
        render_page(old, {"r": render_docs.wrap({"a": 1.234})}, console=None)
    assert render_docs.upgrade_markers(old) == (
        "Took <!-- fig:.2f r.a -->1.23<!-- /fig --> ms; <!-- fig rows(r, 'a | b', 'c') -->x<!-- /fig -->\n"
    )


def test_a_figure_that_cannot_render_names_its_line() -> None:
    with pytest.raises(ValueError, match=r"line 2: `nope\.field` does not render: NameError"):
        render_page("a\nb <!-- fig nope.field -->1<!-- /fig -->\n", {}, console=None)


def test_console_normalization_keeps_everything_but_wall_time_and_architecture() -> None:
    a = "x | cpu (x86_64) / gloo\n  rank  tokens  layer ms\n     0      88     12.50\n"
    b = "x | cpu (aarch64) / gloo\n  rank  tokens  layer ms\n     0      88    101.07\n"
    c = "x | cpu (aarch64) / gloo\n  rank  tokens  layer ms\n     0      89    101.07\n"
    assert normalize_console(a) == normalize_console(b) != normalize_console(c)


def test_the_tables_quote_each_metric_as_the_glossary_defines_it() -> None:
    """Materialized is per layer and "—" where nothing is materialized (a replica read locally, or no history);
    the main job's table names the store path of the run it checked beside the verdict, apart from the timed run's;
    the KV-designs table calls its wire bytes "received", the phases table its buffers "gathered"."""
    import results_tables

    results = ROOT / "docs" / "results"
    doc = {
        name: json.loads((results / f"{name}.json").read_text())
        for name in ("layer_bench", "capacity_deepseek_v32_c8", "layer_bench_8k", "demo_h200", "kv_designs_h200")
    }
    phases = results_tables.phases(
        {"layer": doc["layer_bench"], "capacity": doc["capacity_deepseek_v32_c8"], "repeats": doc["layer_bench_8k"]}
    )
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in phases.splitlines()
        if line[:4] in ("| 0 ", "| 2 ")
    }
    assert "gathered, MiB per layer" in phases and "moved" not in phases
    assert rows["0"][5] == results_tables.NONE and rows["2"][5] == "98.5"
    demo = results_tables.demo(doc["demo_h200"])
    level5 = next(line for line in demo.splitlines() if line.startswith("| 5 |"))
    assert level5.split(" | ")[1:3] == ["match (gathered)", "direct"]
    assert "oracle check (its store path)" in demo and "timed run: store path" in demo
    designs = results_tables.kv_designs(doc["kv_designs_h200"])
    assert "received MiB / layer" in designs and "moved" not in designs
    none = results_tables.NONE
    assert results_tables.materialized_mib(5 * 2**20, "replicated") == results_tables.materialized_mib(0) == none
    assert results_tables.materialized_mib(8 * 2**20, "gathered", 4) == "2.0"


def test_the_glossary_defines_every_metric_the_tables_quote() -> None:
    text = (ROOT / "docs" / "glossary.md").read_text()
    metrics = text[text.index("## Metrics") :].split("\n## ")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in metrics.splitlines() if line.startswith("| ")}
    for name, field in (
        ("layer time", "layer_ms_median"),
        ("tail wall time", "tail_ms"),
        ("KV at rest", "kv_bytes"),
        ("gathered", "gather_bytes"),
        ("received", "bytes_moved_per_layer"),
        ("materialized", "materialized_bytes"),
        ("measured peak", "measured_peak_bytes"),
    ):
        assert name in rows and f"`{field}`" in rows[name], f"glossary.md#metrics: no row {name!r} naming `{field}`"


def test_level_comparisons_render_the_paired_verdict_or_say_they_were_not_re_measured() -> None:
    """``bench.layer``'s level-to-level verdicts: a file from before the paired protocol renders every comparison
    as not re-measured; a paired one (here the committed file given rounds that agree on level 7 against level 6
    and disagree on level 8 against level 7) renders the verdict of the rounds, whatever the medians say."""
    import results_tables
    from reference_impl.bench import layer, paired

    results = ROOT / "docs" / "results"
    old = json.loads((results / "layer_bench.json").read_text())
    capacity = json.loads((results / "capacity_deepseek_v32_c8.json").read_text())
    repeats = json.loads((results / "layer_bench_8k.json").read_text())
    not_remeasured = results_tables.NOT_REMEASURED
    assert results_tables.level_verdict(old, 0, 131072, 7, 6) == not_remeasured
    assert not_remeasured in results_tables.layer(old)
    assert not_remeasured in results_tables.phases({"layer": old, "capacity": capacity, "repeats": repeats})

    new = json.loads(json.dumps(old))
    new["rule"] = paired.RULE
    work = next(w for w in new["workloads"] if w["workload"] == {"name": "current-only", "prefix": 0, "extend": 131072})
    levels = [p["level"] for p in work["levels"]]
    run_ms = {k: [60.0 + r * 0.1 for r in range(5)] for k in levels}  # every other pair: no difference
    run_ms[7] = [x - 2.0 for x in run_ms[6]]  # level 7 below level 6 in every round
    run_ms[8] = [x + (0.5 if r == 2 else -0.5) for r, x in enumerate(run_ms[7])]  # one round the other way
    for p in work["levels"]:
        p["run_ms"], p["run_ms_spread"] = run_ms[p["level"]], paired.spread(run_ms[p["level"]])
    work["rounds"], work["comparisons"] = 5, layer.compare_levels(levels, run_ms)
    assert results_tables.level_verdict(new, 0, 131072, 7, 6) == "level 7 faster"
    assert results_tables.level_verdict(new, 0, 131072, 8, 7) == paired.WITHIN_NOISE
    assert results_tables.level_verdict(new, 0, 131072, 6, 7) == "level 7 faster"  # either orientation
    assert results_tables.level_verdict(new, 0, 131072, 7, 0) == "level 7 faster"
    with pytest.raises(LookupError, match="no level 7 with level 5"):
        results_tables.level_verdict(new, 0, 131072, 7, 5)  # a pair the benchmark does not record
    assert results_tables.level_verdict(new, 0, 32768, 7, 6) == not_remeasured  # that workload kept its old fields
    table = results_tables.phases({"layer": new, "capacity": capacity, "repeats": repeats})
    row7 = next(line for line in table.splitlines() if line.startswith("| 7 |"))
    assert row7.endswith("faster) |") and "Layer time changes beyond noise: level 7 (" in table
    assert not_remeasured not in table and "5 interleaved rounds" in table
    rendered = results_tables.layer(new)
    assert "| level 8 against level 7 | -0.50 (-0.50 to +0.50) | within noise |" in rendered
    assert "rounds ms: median (min-max)" in rendered

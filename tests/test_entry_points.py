"""Every benchmark, planner and cited script refuses bad input as the ``dsa-cp`` command does.

One table of bad command lines (:data:`BAD_INPUT`) over every ``python -m reference_impl.bench.*``
and ``python -m reference_impl.planner.*`` module with a ``main``, and every ``scripts/*.py`` that a
page or the README gives as a command: each runs the entry's ``main(argv)`` in this process and
must exit 2 (a returned 2, or ``SystemExit(2)`` for a parse error, as argparse's), with one line on
stderr that starts ``error: `` and names the flag, no traceback, within :data:`LIMIT_S`, writing
nothing. The machine's free memory reads as 16 GiB, so the benchmarks' default workloads on a CPU
are refused by their estimate, whatever this machine has. Then each entry once as a command (its
``__main__`` block; three in processes of their own, as typed): an unknown flag is one line naming
the command as it is typed, exit 2; and ``--help`` shows every flag's default.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 5.0
FREE_GIB = 16  # what the memory estimates compare with here
sys.path.insert(0, str(ROOT / "scripts"))  # the scripts import each other by name, as they do when run

# Module entry points: ``python -m <name>``.
MODULES = [
    f"reference_impl.bench.{m}"
    for m in (
        "anchors",
        "compute",
        "designs",
        "glm53",
        "glue",
        "kernels",
        "layer",
        "limits",
        "long_context",
        "pd_mooncake",
        "pd_stream",
        "ranks",
        "topk",
        "v4",
    )
] + [f"reference_impl.planner.{m}" for m in ("designs", "elementwise", "glm53", "v4")]
# Scripts a page or the README gives as a command: ``python3 scripts/<name>.py``; the entry where it is not main.
SCRIPTS = {
    name: "main"
    for name in (
        "calibrate_check",
        "capacity_plan",
        "draw_diagrams",
        "execute_notebooks",
        "index_share_plan",
        "inspect_attention_kernels",
        "inspect_logits_kernel",
        "memory_peak",
        "plot_results",
        "profile_fused_kernels",
        "profile_layer",
        "profile_logits_kernel",
        "render_docs",
        "results_tables",
        "summarize_test_run",
    )
}
SCRIPTS["apply_sweep"] = "cli"  # its main(path) is the library call the tests of the kernels use


def prog(entry: str) -> str:
    return f"python -m {entry}" if entry.startswith("reference_impl.") else f"python3 scripts/{entry}.py"


def entry_main(entry: str) -> Callable[[list[str] | None], Any]:
    return getattr(importlib.import_module(entry), SCRIPTS.get(entry, "main"))


# Stored files the table reads: {name: content}, written under the test's folder as NAME.json.
STORED: dict[str, Any] = {
    "empty": {},
    "layer_partial": {
        "preset": "tiny",
        "n_layers": 1,
        "cp_size": 2,
        "rank": 0,
        "wire_gbps": None,
        "workloads": [{"workload": {"prefix": 0}, "levels": [{"level": 0}]}],
    },
    "layer_bad_rank": {
        "preset": "tiny",
        "n_layers": 1,
        "cp_size": 2,
        "rank": 5,
        "wire_gbps": None,
        "workloads": [
            {
                "workload": {"prefix": 0, "extend": 64},
                "levels": [{"level": 0, "layer_ms_median": 1.0, "kv_bytes": 1, "transient_peak_bytes": 1}],
            }
        ],
    },
    "layer_text_cp": {"preset": "tiny", "n_layers": 1, "cp_size": "8", "rank": 0, "wire_gbps": None, "workloads": []},
    "long_partial": {
        "preset": "tiny",
        "cp_size": 2,
        "rank": 0,
        "n_layers": 2,
        "chunk_tokens": 256,
        "runs": [{"context": 512, "levels": [{"level": 0}]}],
    },
    "long_text_context": {
        "preset": "tiny",
        "cp_size": 2,
        "rank": 0,
        "n_layers": 2,
        "chunk_tokens": 256,
        "runs": [{"context": "512", "levels": []}],
    },
    "profile_no_ops": {"args": {"layers": 2, "extend": 4096, "cp_size": 8, "level": 7, "rank": 0}},
    "sweep_no_rows": {"sweep": {"attention": [], "indexer": []}},
    "list": [1, 2],
}

# (entry, argv, words the one error line must hold); T/ is the test's folder, S/NAME the stored file NAME.
BAD_INPUT: list[tuple[str, list[str], str]] = [
    # bench.anchors
    ("reference_impl.bench.anchors", ["--out", "T/x.json", "--cases", "v5"], "--cases 'v5': name each once"),
    # bench.v4: what a user met as tracebacks
    ("reference_impl.bench.v4", ["--out", "T/x.json", "--cp-size", "0"], "argument --cp-size: 0 is below 1"),
    ("reference_impl.bench.v4", ["--out", "T/x.json", "--rank", "-1"], "argument --rank: -1 is below 0"),
    (
        "reference_impl.bench.v4",
        ["--out", "T/x.json", "--rank", "8"],
        "--rank 8: need a rank within 0..7 (--cp-size 8)",
    ),
    ("reference_impl.bench.v4", ["--out", "T/x.json", "--wire-gbps", "-1"], "argument --wire-gbps: -1 is not positive"),
    ("reference_impl.bench.v4", ["--out", "T/x.json", "--repeats", "0"], "argument --repeats: 0 is below 1"),
    ("reference_impl.bench.v4", ["--out", "T/x.json", "--levels", ""], "--levels '': '' is not an integer"),
    (
        "reference_impl.bench.v4",
        ["--out", "T/x.json", "--preset", "deepseek-v3.2"],
        "argument --preset: unknown V4 preset 'deepseek-v3.2': use deepseek-v4-flash, deepseek-v4-pro, tiny-v4",
    ),
    (
        "reference_impl.bench.v4",
        ["--out", "T/x.json", "--preset", "tiny-v4"],
        "--layers 4: --preset tiny-v4 has 3 layers",
    ),
    (
        "reference_impl.bench.v4",
        ["--out", "T/x.json", "--preset", "tiny-v4", "--layers", "3", "--workloads", "a:0+3"],
        "--workloads a:0+3: it holds 3 new tokens, fewer than the 8 ranks",
    ),
    ("reference_impl.bench.v4", ["--out", "T/x.json", "--workloads", "a:0+x"], "--workloads 'a:0+x': expected name"),
    (
        "reference_impl.bench.v4",
        ["--out", "T/x.json", "--device", "cpu"],
        f"rank 0 of C=8 at 1,048,576 tokens (deepseek-v4-flash, 4 layers) needs up to 84.6 GiB on cpu, which has "
        f"{FREE_GIB}.0 GiB free",
    ),
    # bench.glm53
    ("reference_impl.bench.glm53", ["--out", "T/x.json", "--cp-size", "0"], "argument --cp-size: 0 is below 1"),
    ("reference_impl.bench.glm53", ["--out", "T/x.json", "--levels", "3"], "--levels '3': 3 is not within 0..2"),
    (
        "reference_impl.bench.glm53",
        ["--out", "T/x.json", "--preset", "glm-5.2"],
        "argument --preset: unknown GLM-5.3 preset 'glm-5.2'",
    ),
    (
        "reference_impl.bench.glm53",
        ["--out", "T/x.json", "--workloads", "a:0+15"],
        "--workloads a:0+15: 15 new tokens; the in-seq split needs 2C = 16 (two blocks per rank)",
    ),
    (
        "reference_impl.bench.glm53",
        ["--out", "T/x.json", "--workloads", "a:0+2000000"],
        "--workloads a:0+2000000: 2,000,000 tokens is past glm-5.3-flash's 1,048,576",
    ),
    ("reference_impl.bench.glm53", ["--out", "T/x.json", "--wire-gbps", "0"], "argument --wire-gbps: 0 is not"),
    (
        "reference_impl.bench.glm53",
        ["--out", "T/x.json", "--device", "cpu"],
        "rank 0 of C=8 at 131,072 tokens (glm-5.3-flash) needs up to",
    ),
    # bench.layer
    ("reference_impl.bench.layer", ["--replan", "S/empty"], "--replan 'S/empty': missing field preset"),
    (
        "reference_impl.bench.layer",
        ["--replan", "S/layer_partial"],
        "--replan 'S/layer_partial': missing field workloads[0].workload.extend",
    ),
    (
        "reference_impl.bench.layer",
        ["--replan", "S/layer_text_cp"],
        "--replan 'S/layer_text_cp': field cp_size holds \"8\"; need an integer within 1..4,096",
    ),
    (
        "reference_impl.bench.layer",
        ["--replan", "S/layer_bad_rank"],
        "--replan 'S/layer_bad_rank': field rank 5: need a rank within 0..1 (cp_size 2)",
    ),
    ("reference_impl.bench.layer", ["--replan", "S/list"], "--replan 'S/list': holds a JSON list"),
    ("reference_impl.bench.layer", ["--replan", "T/missing.json"], "--replan 'T/missing.json': no such file"),
    (
        "reference_impl.bench.layer",
        ["--out", "T/x.json", "--device", "cpu", "--levels", "a"],
        "--levels 'a': 'a' is not",
    ),
    (
        "reference_impl.bench.layer",
        ["--out", "T/x.json", "--device", "cpu", "--levels", "8-2"],
        "the range runs downward",
    ),
    (
        "reference_impl.bench.layer",
        ["--out", "T/x.json", "--preset", "tiny-v4"],
        "argument --preset: unknown preset 'tiny-v4': use deepseek-v3.2, glm-5, glm-5.2, tiny (DeepSeek-V4: ",
    ),
    ("reference_impl.bench.layer", ["--out", "T/x.json", "--split-modes", "zigzag"], "--split-modes 'zigzag': use"),
    (
        "reference_impl.bench.layer",
        ["--out", "T/x.json", "--prefetch-repeats", "0"],
        "--prefetch-repeats must be at least 1",
    ),
    ("reference_impl.bench.layer", ["--out", "T/x.json", "--layers", "1000"], "argument --layers: 1000 is above 128"),
    ("reference_impl.bench.layer", ["--out", "T/no/x.json"], "--out 'T/no/x.json': the folder 'T/no' does not exist"),
    ("reference_impl.bench.layer", [], "--out FILE: where to write the results (or --replan FILE)"),
    (
        "reference_impl.bench.layer",
        ["--out", "T/x.json", "--device", "cpu"],
        "--workloads / --layers: rank 0 of C=8 at 139,264 tokens (deepseek-v3.2, 4 layers) needs up to",
    ),
    (
        "reference_impl.bench.layer",
        ["--out", "T/x.json", "--cp-size", "x"],
        "argument --cp-size: 'x' is not an integer",
    ),
    # bench.long_context
    (
        "reference_impl.bench.long_context",
        ["--out", "T/x.json", "--modeled", "--preset", "tiny-v4"],
        "argument --preset: unknown preset 'tiny-v4'",
    ),
    (
        "reference_impl.bench.long_context",
        ["--out", "T/x.json", "--modeled", "--preset", "deepseek-v4-flash"],
        "argument --preset: unknown preset 'deepseek-v4-flash'",
    ),
    ("reference_impl.bench.long_context", ["--out", "T/x.json", "--rank", "99"], "--rank 99: need a rank within 0..7"),
    ("reference_impl.bench.long_context", ["--replan", "S/empty"], "--replan 'S/empty': missing field preset"),
    (
        "reference_impl.bench.long_context",
        ["--replan", "S/long_partial"],
        "--replan 'S/long_partial': missing field runs[0].levels[0].chunk_contexts",
    ),
    (
        "reference_impl.bench.long_context",
        ["--replan", "S/long_text_context"],
        "--replan 'S/long_text_context': field runs[0].context holds \"512\"; need an integer",
    ),
    (
        "reference_impl.bench.long_context",
        ["--out", "T/x.json", "--modeled", "--chunk", "1"],
        "--contexts / --chunk / --levels: 5,111,808 chunks x levels; at most 4,096",
    ),
    ("reference_impl.bench.long_context", ["--out", "T/x.json", "--contexts", "0"], "--contexts '0': 0 is not within"),
    (
        "reference_impl.bench.long_context",
        ["--out", "T/x.json", "--device", "cpu"],
        "--contexts / --chunk / --layers: rank 0 of C=8 at 1,048,576 tokens (deepseek-v3.2, 2 layers) needs up to",
    ),
    # planner.v4
    ("reference_impl.planner.v4", ["--kv-budget-gib", "1e309"], "argument --kv-budget-gib: '1e309' is not a finite"),
    ("reference_impl.planner.v4", ["--kv-budget-gib", "1e300"], "argument --kv-budget-gib: 1e+300 is above 1,048,576"),
    ("reference_impl.planner.v4", ["--cp-size", "99999999"], "argument --cp-size: 99999999 is above 4,096"),
    (
        "reference_impl.planner.v4",
        ["--contexts", "99999999999999"],
        "--contexts '99999999999999': 99999999999999 is not",
    ),
    (
        "reference_impl.planner.v4",
        ["--cp-size", "4096", "--levels", "0,1,2,3,4,5,6,7,8"],
        "--contexts x --levels x --cp-size = 2 x 9 x 4096 = 73,728 ranks to walk: at most 65,536",
    ),
    ("reference_impl.planner.v4", ["--contexts", ",".join(["4096"] * 9000)], "ranks to walk: at most 65,536"),
    ("reference_impl.planner.v4", ["--preset", "tiny"], "argument --preset: unknown V4 preset 'tiny'"),
    # planner.glm53
    ("reference_impl.planner.glm53", ["--preset", "glm-5.2"], "argument --preset: unknown GLM-5.3 preset 'glm-5.2'"),
    ("reference_impl.planner.glm53", ["--cp-size", "0"], "argument --cp-size: 0 is below 1"),
    ("reference_impl.planner.glm53", ["--kv-budget-gib", "inf"], "argument --kv-budget-gib: 'inf' is not a finite"),
    ("reference_impl.planner.glm53", ["--contexts", "0"], "--contexts '0': 0 is not within"),
    ("reference_impl.planner.glm53", ["--out", "T/no/x.json"], "--out 'T/no/x.json': the folder 'T/no' does not"),
    # planner.elementwise and planner.designs
    (
        "reference_impl.planner.elementwise",
        ["T/missing.json", "--out", "T/x.json"],
        "profile 'T/missing.json': no such",
    ),
    ("reference_impl.planner.elementwise", ["README.md", "--out", "T/x.json"], "profile 'README.md': not JSON"),
    ("reference_impl.planner.elementwise", ["S/empty", "--out", "T/x.json"], "profile 'S/empty': missing field args"),
    ("reference_impl.planner.elementwise", ["S/profile_no_ops", "--out", "T/x.json"], "missing field ops"),
    (
        "reference_impl.planner.elementwise",
        ["docs/results/profile_layer_32k.json", "--out", "T/x.json"],
        "need profiles at two different local token counts",
    ),
    ("reference_impl.planner.designs", ["--out", "T/x.json", "--rank", "8"], "--rank 8: need a rank within 0..7"),
    ("reference_impl.planner.designs", ["--out", "T/x.json", "--budget-gib", "inf"], "argument --budget-gib: 'inf'"),
    # the other benchmarks
    ("reference_impl.bench.compute", ["--out", "T/x.json", "--tokens", "0"], "--tokens '0': 0 is not within"),
    ("reference_impl.bench.compute", ["--out", "T/x.json", "--heads", "0"], "argument --heads: 0 is below 1"),
    ("reference_impl.bench.compute", ["--out", "T/x.json", "--cp-context", "4"], "--cp-context 4: the zigzag split"),
    ("reference_impl.bench.glue", ["--out", "T/x.json", "--tokens", "x"], "--tokens 'x': 'x' is not an integer"),
    ("reference_impl.bench.glue", ["--out", "T/x.json", "--cp-size", "0"], "argument --cp-size: 0 is below 1"),
    ("reference_impl.bench.kernels", ["--out", "T/x.json", "--page-size", "48"], "--page-size: page_size=48 must be"),
    ("reference_impl.bench.kernels", ["--out", "T/x.json", "--repeats", "0"], "argument --repeats: 0 is below 1"),
    ("reference_impl.bench.kernels", ["--out", "T/x.json", "--preset", "tiny-v4"], "unknown preset 'tiny-v4'"),
    ("reference_impl.bench.limits", ["--out", "T/x.json", "--layers", "0"], "argument --layers: 0 is below 1"),
    ("reference_impl.bench.limits", ["--out", "T/x.json", "--wire-gbps", "nan"], "'nan' is not a finite number"),
    ("reference_impl.bench.ranks", ["--out", "T/x.json", "--workloads", "0+256"], "--workloads '0+256': expected"),
    ("reference_impl.bench.ranks", ["--out", "T/x.json", "--levels", "9"], "--levels '9': 9 is not within 0..8"),
    ("reference_impl.bench.topk", ["--out", "T/x.json", "--context", "4"], "--context 4: the zigzag split"),
    ("reference_impl.bench.topk", ["--out", "T/x.json", "--topk", "0"], "argument --topk: 0 is below 1"),
    ("reference_impl.bench.designs", ["--out", "T/x.json", "--designs", "phases,vmm"], "--designs 'phases,vmm'"),
    ("reference_impl.bench.designs", ["--out", "T/x.json", "--rank", "9"], "--rank 9: need a rank within 0..7"),
    ("reference_impl.bench.designs", ["--out", "T/x.json", "--device", "cpu"], "needs up to"),
    ("reference_impl.bench.pd_stream", ["--out", "T/x.json", "--level", "1"], "--level 1: the layer-wise send needs"),
    ("reference_impl.bench.pd_stream", ["--out", "T/x.json", "--layers", "1"], "--layers 1: at least 2"),
    ("reference_impl.bench.pd_stream", ["--out", "T/x.json", "--rank", "8"], "--rank 8: need a rank within 0..7"),
    ("reference_impl.bench.pd_stream", ["--out", "T/x.json", "--device", "cpu"], "needs up to"),
    ("reference_impl.bench.pd_mooncake", ["--out", "T/x.json", "--level", "9"], "argument --level: 9 is above 8"),
    (
        "reference_impl.bench.pd_mooncake",
        ["--out", "T/x.json", "--device", "cpu", "--libs", "T/none"],
        "--libs 'T/none': not a folder",
    ),
    # the scripts
    ("execute_notebooks", ["T/missing.py"], "walkthroughs: not a walkthrough (phases/*.py): T/missing.py"),
    ("capacity_plan", ["--out", "T/no/x.json"], "--out 'T/no/x.json': the folder 'T/no' does not exist"),
    ("index_share_plan", ["--out", "T/no/x.json"], "--out 'T/no/x.json': the folder 'T/no' does not exist"),
    ("calibrate_check", ["--out", "T/no/x.json"], "--out 'T/no/x.json': the folder 'T/no' does not exist"),
    ("apply_sweep", ["T/missing.json"], "results 'T/missing.json': no such file"),
    ("apply_sweep", ["S/empty"], "results 'S/empty': missing field sweep"),
    ("apply_sweep", ["S/sweep_no_rows"], "results 'S/sweep_no_rows': field sweep.attention must be a non-empty list"),
    ("results_tables", ["nope", "S/empty"], "argument kind: unknown table 'nope': use compute, kernels, layer"),
    ("results_tables", ["layer", "S/empty"], "path 'S/empty': not a layer results file (KeyError"),
    ("memory_peak", ["--level", "9"], "argument --level: 9 is above 8"),
    ("profile_layer", ["--device", "cpu", "--rank", "8"], "--rank 8: need a rank within 0..7"),
    (
        "profile_layer",
        ["--device", "cpu", "--extend", "4"],
        "--extend 4: it holds 4 new tokens, fewer than the 8 ranks",
    ),
    ("profile_layer", ["--device", "cpu", "--json", "T/no/x.json"], "--json 'T/no/x.json': the folder"),
    ("profile_layer", ["--device", "cpu"], "--extend / --layers: rank 0 of C=8 at 131,072 tokens"),
    ("profile_fused_kernels", ["--tokens", "0"], "--tokens '0': 0 is not within"),
    ("profile_fused_kernels", [], "--out FILE: where to write the profile"),
    ("profile_logits_kernel", ["--out", "T/x.json", "--ncu", "no-such-ncu"], "--ncu 'no-such-ncu': no such command"),
    ("inspect_logits_kernel", ["--json", "T/no/x.json"], "--json 'T/no/x.json': the folder 'T/no' does not exist"),
    ("inspect_attention_kernels", ["extra"], "unrecognized arguments: extra"),
    ("plot_results", ["--results", "T/none"], "--results 'T/none': no such folder"),
    ("plot_results", ["--out", "S/empty"], "--out 'S/empty': exists and is not a folder"),
    ("draw_diagrams", ["--out", "S/empty"], "--out 'S/empty': exists and is not a folder"),
    ("render_docs", ["T/page.md"], "pages: not a page of the site (README.md or docs/**/*.md): T/page.md"),
    ("summarize_test_run", ["T/none", "--seconds", "1", "--out", "T/s.json"], "log_dir 'T/none': no such folder"),
    ("summarize_test_run", ["T", "--seconds", "-1", "--out", "T/s.json"], "argument --seconds: -1 is not positive"),
]


def _expand(values: list[str], tmp: Path) -> list[str]:
    return [
        v.replace("T/", f"{tmp}/").replace("S/", f"{tmp}/stored/")
        if v.startswith(("T/", "S/"))
        else str(tmp)
        if v == "T"
        else v
        for v in values
    ]


def _stored(tmp: Path) -> None:
    (tmp / "stored").mkdir()
    for name, content in STORED.items():
        (tmp / "stored" / name).write_text(json.dumps(content))


def _exit_code(main: Callable[[list[str] | None], Any], argv: list[str]) -> Any:
    try:
        return main(argv)
    except SystemExit as exc:  # a parse error exits 2, as argparse's do
        return exc.code


@pytest.mark.parametrize(
    ("entry", "argv", "words"), BAD_INPUT, ids=[f"{e.rsplit('.', 1)[-1]} {' '.join(a)[:60]}" for e, a, _ in BAD_INPUT]
)
def test_bad_input_is_one_line_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    entry: str,
    argv: list[str],
    words: str,
) -> None:
    from reference_impl import footprint

    monkeypatch.setattr(footprint, "free_bytes", lambda device_type: FREE_GIB << 30)
    monkeypatch.chdir(ROOT)
    _stored(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    main = entry_main(entry)
    start = time.monotonic()
    code = _exit_code(main, _expand(argv, tmp_path))
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    err = err.replace(f"{tmp_path}/stored/", "S/").replace(f"{tmp_path}/", "T/")
    assert code == 2, (code, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert "Traceback" not in err and not out, (out, err)
    assert elapsed < LIMIT_S, f"refused after {elapsed:.1f} s"
    assert sorted(tmp_path.rglob("*")) == before, "a refused run wrote nothing"


def test_the_table_in_a_fresh_process_stays_small(tmp_path: Path) -> None:
    """Every row of the table in one new process: each refused, and the process's peak resident
    memory under 2 GiB (a refusal builds nothing proportional to the size it refuses)."""
    script = f"""
import contextlib, io, json, os, resource, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from reference_impl import footprint
from tests import test_entry_points as t
footprint.free_bytes = lambda device_type: t.FREE_GIB << 30
tmp = Path({str(tmp_path)!r})
t._stored(tmp)
codes = []
for entry, argv, words in t.BAD_INPUT:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = t._exit_code(t.entry_main(entry), t._expand(argv, tmp))
    codes.append([code, err.getvalue().count("\\n")])
print(json.dumps({{"codes": codes, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.splitlines()[-1])
    assert doc["codes"] == [[2, 1]] * len(BAD_INPUT)
    assert doc["peak_kib"] < 2 * 1024 * 1024, f"peak {doc['peak_kib'] / 1024:.0f} MiB"


def test_every_entry_point_has_bad_input_in_the_table() -> None:
    covered = {entry for entry, _, _ in BAD_INPUT}
    assert covered == set(MODULES) | set(SCRIPTS), sorted((set(MODULES) | set(SCRIPTS)) ^ covered)


def test_the_modules_with_a_main_are_all_listed() -> None:
    """A new bench or planner module with a ``main`` joins :data:`MODULES` (and the table)."""
    found = {
        f"reference_impl.{path.parent.name}.{path.stem}"
        for folder in ("bench", "planner")
        for path in (ROOT / "reference_impl" / folder).glob("*.py")
        if "\ndef main(" in path.read_text() or " import main\n" in path.read_text()
    }  # or a family's, by name
    assert found == set(MODULES), sorted(found ^ set(MODULES))


def _parser_of(entry: str) -> argparse.ArgumentParser:
    """The entry's parser, as ``--help`` prints it (its ``print_help`` caught, the exit with it)."""
    captured: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.print_help

    def keep(self: argparse.ArgumentParser, file: Any = None) -> None:
        captured.append(self)

    argparse.ArgumentParser.print_help = keep  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit):
            entry_main(entry)(["--help"])
    finally:
        argparse.ArgumentParser.print_help = real  # type: ignore[method-assign]
    return captured[0]


@pytest.mark.parametrize("entry", MODULES + sorted(SCRIPTS))
def test_help_shows_every_flags_default(entry: str, capsys: pytest.CaptureFixture) -> None:
    parser = _parser_of(entry)
    assert parser.prog == prog(entry)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action) if action.help else ""
        assert action.required or "default" in text.lower(), f"{entry} {action.option_strings[0]}: {text!r}"
    assert parser.format_help().startswith(f"usage: {prog(entry)} ")


def _command(entry: str, *args: str) -> list[str]:
    if entry.startswith("reference_impl."):
        return [sys.executable, "-m", entry, *args]
    return [sys.executable, str(ROOT / "scripts" / f"{entry}.py"), *args]


# Runs each entry's ``if __name__ == "__main__"`` block with ``--bad-flag`` in one process (the imports
# shared: a process per entry takes a minute on a small machine), as ``python -m`` and ``python3 scripts/``
# run them; prints {entry: [exit code, stderr, stdout]}.
AS_COMMANDS = """
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")  # runpy's note on a module that another entry imported already
entries, scripts = json.loads(sys.argv[1]), sys.argv[2]
sys.path.insert(0, scripts)
found = {}
for entry, prog in entries:
    sys.argv = [prog, "--bad-flag"]
    err, out, code = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            if entry.startswith("reference_impl."):
                runpy.run_module(entry, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(f"{scripts}/{entry}.py", run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    found[entry] = [code, err.getvalue(), out.getvalue()]
print(json.dumps(found))
"""


def test_an_unknown_flag_is_one_line_naming_the_command() -> None:
    """Every entry's command-line path (its ``__main__`` block): an unknown flag is one line naming
    the command as typed, exit 2; and three of them in processes of their own, as a user types them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    entries = MODULES + sorted(SCRIPTS)
    alone = ["reference_impl.bench.layer", "reference_impl.planner.v4", "results_tables"]
    running = {
        entry: subprocess.Popen(
            _command(entry, "--bad-flag"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        for entry in alone
    }
    together = subprocess.run(
        [sys.executable, "-c", AS_COMMANDS, json.dumps([[e, prog(e)] for e in entries]), str(ROOT / "scripts")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert together.returncode == 0, together.stderr[-3000:]
    found = json.loads(together.stdout.splitlines()[-1])
    for entry, proc in running.items():
        out, err = proc.communicate(timeout=300)
        found[f"{entry} (alone)"] = [proc.returncode, err, out]
    problems = {
        entry: got
        for entry, got in found.items()
        if got != [2, f"error: {prog(entry.split()[0])}: unrecognized arguments: --bad-flag\n", ""]
    }
    assert not problems, problems
    assert len(found) == len(entries) + len(alone)

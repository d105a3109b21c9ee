"""The command line: split JSON, run JSON report fields, a closed pipe or a full disk, progress on stderr, the help's
defaults and name, the report without a top-k figure, quiet third-party logs."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reference_impl.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_split_json_published_case(capsys) -> None:
    assert main(["split", "--mode", "in-seq", "--cp", "4", "--extend", "19", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"][0]["block_sizes"] == [3, 3, 3, 2, 2, 2, 2, 2]
    assert doc["ranks"][0]["tokens"] == [0, 1, 2, 17, 18]
    assert sorted(doc["rerange_index"]) == list(range(19))


def test_run_json_report_fields(capsys) -> None:
    assert main(["run", "--cp-size", "2", "--requests", "0+40,9+30", "--phases", "1", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    for key in (
        "config",
        "cp_size",
        "phases",
        "device",
        "backend",
        "matches_oracle",
        "max_abs_err",
        "topk_agreement",
        "per_rank",
        "timings",
    ):
        assert key in rep
    assert rep["matches_oracle"] is True and rep["phases"] == [1]
    assert rep["attention_kernel"] == "torch"  # CPU: the torch reference (the Gluon / Triton paths need CUDA)
    for entry in rep["per_rank"]:
        for key in (
            "rank",
            "kv_bytes",
            "index_bytes",
            "transient_peak_bytes",
            "gather_bytes",
            "materialized_bytes",
            "output_gather_bytes",
            "collectives",
        ):
            assert isinstance(entry[key], int)


# Bad input (one line, exit 2, no traceback, fast, small): tests/test_front_door.py.


def test_a_closed_pipe_ends_quietly() -> None:
    """``split ... | head``: the reader leaves early; no BrokenPipeError traceback."""
    cmd = f"{sys.executable} -m reference_impl split --cp 8 --extend 200000 | head -c 10 >/dev/null"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_split_shows_the_page_aligned_split(capsys) -> None:
    assert main(["split", "--cp", "2", "--extend", "100", "--prefix", "13", "--page-size", "16", "--page-aligned"]) == 0
    out = capsys.readouterr().out
    assert "page-aligned: True" in out and "[[19, 32, 32, 17]]" in out


def test_run_progress_is_drawn_on_stderr_by_the_cli() -> None:
    """The library reports how far a run is; the CLI's bar draws it (on a terminal; forced here)."""
    import io

    from reference_impl.cli import _ProgressBar
    from reference_impl.config import Request, RunConfig
    from reference_impl.runner import run_prefill

    seen: list[tuple[str, int, int]] = []
    out = io.StringIO()
    with _ProgressBar(enabled=True, file=out) as bar:

        def progress(stage: str, done: int, total: int) -> None:
            seen.append((stage, done, total))
            bar.update(stage, done, total)

        run_prefill(RunConfig(cp_size=2, requests=(Request(0, 40),), device="cpu"), progress=progress)
    ranks = [s for s in seen if s[0] == "ranks"]
    assert ranks[0] == ("ranks", 0, 3) and ranks[-1] == ("ranks", 3, 3)  # the model, then 2 layers x 1 chunk
    assert [d for _, d, _ in ranks] == sorted(d for _, d, _ in ranks) and seen[-1][0] == "oracle"
    assert "ranks (model, then layers)" in out.getvalue() and "oracle" in out.getvalue()
    assert _ProgressBar(file=io.StringIO()).enabled is False  # not a terminal: no bar


def test_a_full_stdout_is_one_line_and_not_exit_1() -> None:
    """``... > /dev/full``: the result cannot be written. One line saying so, and exit 2 (never 1, which
    says a run disagrees with the oracle), for the table and the JSON alike."""
    for args in (
        ["run", "--requests", "0+40"],
        ["run", "--requests", "0+40", "--json"],
        ["split", "--cp", "2", "--extend", "9"],
        ["run", "--help"],  # argparse alone would drop the failed write and exit 0
    ):
        cmd = f"{sys.executable} -m reference_impl {' '.join(args)} > /dev/full"
        proc = subprocess.run(
            ["bash", "-c", cmd],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT), "DSACP_RANK_THREADS": "1"},
            cwd=ROOT,
        )
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr == "error: cannot write the output to stdout: No space left on device\n", (args, proc.stderr)


def test_every_help_line_shows_its_default() -> None:
    """Each flag's help says its default (or that it is required), with no reST markup."""
    from reference_impl.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in [("", parser), *commands.items()]:
        for action in command._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help and ("default" in action.help or action.required), (name, action.option_strings)
        text = command.format_help()
        assert "``" not in text and ":func:" not in text and ":class:" not in text, name


def test_the_usage_names_the_command_as_invoked(monkeypatch) -> None:
    """``dsa-cp`` (the console script) or ``python -m reference_impl``, as the user typed it."""
    from reference_impl.cli import build_parser

    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/dsa-cp", "--help"])
    assert build_parser().format_usage().startswith("usage: dsa-cp [-h]")
    proc = subprocess.run(
        [sys.executable, "-m", "reference_impl", "run", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m reference_impl run [-h]")
    assert "(default tiny; env DSACP_PRESET)" in " ".join(proc.stdout.split())


def test_no_top_k_figure_where_no_layer_selects(capsys) -> None:
    """DeepSeek-V4 with a sliding-window layer only: nothing is selected, so no top-k agreement (not 0)."""
    assert main(["run", "--preset", "tiny-v4", "--n-layers", "1", "--requests", "0+40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["matches_oracle"] is True and report["topk_agreement"] is None
    assert main(["run", "--preset", "tiny-v4", "--n-layers", "1", "--requests", "0+40"]) == 0
    table = capsys.readouterr().out
    assert "MATCHES oracle: max abs err" in table and "top-k" not in table


def test_the_demo_draws_no_bar_into_a_log() -> None:
    """tqdm's carriage returns only on a terminal: stderr captured here is not one."""
    from reference_impl.demo import _levels_bar

    assert not sys.stderr.isatty()
    with _levels_bar([0, 1], "levels", progress=True) as bar:
        assert bar.disable


def test_mooncake_runs_quietly_unless_debug() -> None:
    """A successful Mooncake PD run prints no third-party log lines; ``--debug`` brings Mooncake's back."""
    from reference_impl.pd.mooncake_engine import mooncake_unavailable

    if mooncake_unavailable() is not None:
        pytest.skip("the Mooncake Transfer Engine does not import here")
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    env.update(PYTHONPATH=str(ROOT), DSACP_RANK_THREADS="1")
    args = [sys.executable, "-m", "reference_impl", "pd", "--transport", "mooncake", "--requests", "0+40"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "decode MATCHES" in proc.stdout and proc.stderr == "", proc.stderr
    proc = subprocess.run([*args, "--debug"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "transfer_engine" in proc.stderr, proc.stderr[-2000:]

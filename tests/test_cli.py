"""The command line: split JSON, run JSON report fields, a closed pipe, progress on stderr."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from reference_impl.cli import main


def test_split_json_published_case(capsys) -> None:
    assert main(["split", "--mode", "in-seq", "--cp", "4", "--extend", "19", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"][0]["block_sizes"] == [3, 3, 3, 2, 2, 2, 2, 2]
    assert doc["ranks"][0]["tokens"] == [0, 1, 2, 17, 18]
    assert sorted(doc["rerange_index"]) == list(range(19))


def test_run_json_report_fields(capsys) -> None:
    assert main(["run", "--cp-size", "2", "--requests", "0+40,9+30", "--phases", "1", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    for key in ("config", "cp_size", "phases", "device", "backend", "matches_oracle", "max_abs_err",
                "topk_agreement", "per_rank", "timings"):
        assert key in rep
    assert rep["matches_oracle"] is True and rep["phases"] == [1]
    assert rep["attention_kernel"] == "torch"  # CPU: the torch reference (the Gluon / Triton paths need CUDA)
    for entry in rep["per_rank"]:
        for key in ("rank", "kv_bytes", "index_bytes", "transient_peak_bytes", "gather_bytes",
                    "materialized_bytes", "output_gather_bytes", "collectives"):
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

"""The command line: split JSON, run JSON report fields, and one-line errors with exit code 2."""

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


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["run", "--cp-size", "8", "--requests", "5"], "larger than the tokens allow"),
        (["run", "--split-mode", "round-robin", "--phases", "2"], "round-robin split cannot run shared-KV"),
        (["run", "--preset", "nope"], "unknown preset 'nope'"),
        (["run", "--requests", "3+x"], "malformed request '3+x'"),
        (["run", "--requests", "1+2+3"], "malformed request"),
        (["run", "--phases", "9"], "out of range"),
        (["run", "--page-size", "48"], "power of two"),
        (["split", "--cp", "4", "--extend", "3"], "larger than the tokens allow"),
        (["split", "--cp", "2", "--extend", "a,b"], "malformed --extend"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv: list[str], words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1


def test_module_entry_point_exit_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "reference_impl", "run", "--preset", "nope"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unknown preset" in proc.stderr

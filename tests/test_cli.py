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


BAD_INPUT = [
    # impossible runs
    (["run", "--cp-size", "8", "--requests", "5"], {}, "larger than the tokens allow"),
    (["run", "--split-mode", "round-robin", "--phases", "4"], {}, "round-robin split cannot run phase 4"),
    (["run", "--kv-interleave", "8"], {}, "kv_interleave shapes KV sharded at rest: it needs phase 2"),
    (["run", "--phases", "2", "--kv-interleave", "3"], {}, "kv_interleave=3 must be a power of two"),
    (["run", "--phases", "2", "--page-size", "16", "--kv-interleave", "32"], {}, "divides the page size 16"),
    (["run", "--phases", "5", "--kv-interleave", "1"], {}, "phase 5 (compute-owner layout) allocates whole pages"),
    (["run", "--split-mode", "round-robin", "--cp-size", "4", "--requests", "0+1,0+2", "--phases", "2"], {},
     "leave rank(s) [2, 3] without a token"),
    (["run", "--preset", "nope"], {}, "unknown preset 'nope'"),
    (["run", "--phases", "9"], {}, "out of range"),
    (["run", "--phases", "+5"], {}, "needs phase(s) [2, 4]"),
    (["run", "--page-size", "48"], {}, "power of two"),
    (["run", "--requests", "0+100000000"], {}, "needs at least"),  # cannot fit: refused before any rank
    # malformed lists
    (["run", "--requests", "3+x"], {}, "malformed request '3+x'"),
    (["run", "--requests", "1+2+3"], {}, "malformed request"),
    (["run", "--requests", ""], {}, "request spec is empty"),
    (["run", "--requests", "0+10,,0+5"], {}, "entry 2 is empty"),
    (["run", "--requests", "0+10,"], {}, "entry 2 is empty"),
    (["run", "--requests", "0+0"], {}, "extend >= 1"),
    (["split", "--cp", "4", "--extend", "3"], {}, "larger than the tokens allow"),
    (["split", "--cp", "2", "--extend", "a,b"], {}, "'a' is not an integer"),
    (["split", "--cp", "2", "--extend", "8,,8"], {}, "entry 2 is empty"),
    (["split", "--cp", "2", "--extend", "100", "--page-size", "1"], {}, "below 4"),
    (["split", "--cp", "2", "--extend", "100", "--prefix", "1,2"], {}, "--prefix has 2 values"),
    (["split", "--mode", "round-robin", "--cp", "2", "--extend", "10", "--page-aligned"], {}, "in-seq split"),
    (["plan", "--contexts", "99999999999999999999"], {}, "outside 1"),
    (["plan", "--contexts", "8192,,1M"], {}, "entry 2 is empty"),
    # numbers that are not numbers, or not finite, or out of range
    (["run", "--cp-size", "0"], {}, "0 is below 1"),
    (["run", "--cp-size", "two"], {}, "'two' is not an integer"),
    (["run", "--timeout-s", "-1"], {}, "not positive"),
    (["plan", "--hbm-gib", "inf"], {}, "not a finite number"),
    (["plan", "--reserved-gib", "nan"], {}, "not a finite number"),
    (["plan", "--kv-budget-fraction", "1.5"], {}, "fraction in (0, 1]"),
    (["plan", "--interconnect-gbps", "0"], {}, "not positive"),
    # environment values
    (["run"], {"DSACP_CHECK": "nope"}, "DSACP_CHECK='nope'"),
    (["run"], {"DSACP_DEBUG": "maybe"}, "DSACP_DEBUG='maybe'"),
    (["run"], {"DSACP_CP_SIZE": "abc"}, "DSACP_CP_SIZE: 'abc' is not an integer"),
    (["run"], {"DSACP_TIMEOUT_S": "inf"}, "DSACP_TIMEOUT_S: 'inf' is not a finite number"),
    (["plan"], {"DSACP_HBM_GIB": "lots"}, "DSACP_HBM_GIB: 'lots' is not a number"),
    (["run"], {"DSACP_FORCE_TORCH": "sometimes"}, "DSACP_FORCE_TORCH='sometimes'"),
    # flags a subcommand would ignore
    (["demo", "--phases", "3"], {}, "demo: unrecognized arguments: --phases 3"),
    (["split", "--cp", "2", "--extend", "9", "--requests", "0+9"], {}, "unrecognized arguments"),
    (["demo", "--device", "tpu"], {}, "--device 'tpu'"),
]


@pytest.mark.parametrize(("argv", "env", "words"), BAD_INPUT, ids=[" ".join(a) + str(e) for a, e, _ in BAD_INPUT])
def test_bad_input_is_one_line_exit_2(capsys, monkeypatch, argv: list[str], env: dict[str, str], words: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err


def test_a_closed_pipe_ends_quietly() -> None:
    """``split ... | head``: the reader leaves early; no BrokenPipeError traceback."""
    cmd = f"{sys.executable} -m reference_impl split --cp 8 --extend 200000 | head -c 10 >/dev/null"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_split_shows_the_page_aligned_split(capsys) -> None:
    assert main(["split", "--cp", "2", "--extend", "100", "--prefix", "13", "--page-size", "16", "--page-aligned"]) == 0
    out = capsys.readouterr().out
    assert "page-aligned: True" in out and "[[19, 32, 32, 17]]" in out


def test_module_entry_point_exit_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "reference_impl", "run", "--preset", "nope"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unknown preset" in proc.stderr

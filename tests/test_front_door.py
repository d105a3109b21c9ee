"""The front door: every bad input is refused early, cheaply and in one line.

One table of bad command lines and environment values (:data:`BAD_INPUT`, built from classes, not
only from strings met once: every library boolean, every enumerated run knob, each empty), each run
through the CLI in this process: exit 2, one line on stderr that names the flag or the variable,
no traceback, within :data:`LIMIT_S`. The table runs once more in a fresh process whose peak
resident memory must stay under 2 GiB: nothing proportional to a bad size is built before it is
refused. Where the process boundary matters (the module entry point, a timeout with rank
processes), a subprocess. Then the Python API: a wrong type or size is a ``ConfigError`` naming
the argument (:data:`API_MISUSE`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reference_impl.cli import main
from reference_impl.config import LIBRARY_ENV, knob_names
from reference_impl.launch import THREADS_PER_CORE
from reference_impl.machine import cpu_cores

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 5.0
MANY_RANKS = THREADS_PER_CORE * cpu_cores() + 1  # more rank threads than this machine runs

# (argv, environment, words the one error line must hold)
BAD_INPUT: list[tuple[list[str], dict[str, str], str]] = [
    # sizes no machine holds, refused by arithmetic before anything proportional to them is built
    (["run", "--requests", "0+99999999999"], {}, "at most 2,147,483,647"),
    (["run", "--requests", "0+100000000"], {}, "needs up to"),
    (["run", "--requests", "4000000+64"], {}, "needs up to"),
    (["run", "--requests", "0+2000000000,0+2000000000"], {}, "the requests hold 4,000,000,000 tokens"),
    (["run", "--batches", "0+64;0+99999999999"], {}, "batch 1's requests hold"),
    (["run", "--requests", "0+1000000", "--chunk-size", "8"], {}, "--chunk-size=8 cuts the run into 125,000 chunks"),
    (["pd", "--requests", "0+100000000"], {}, "needs up to"),
    (["pd", "--requests", "0+99999999999"], {}, "at most 2,147,483,647"),
    (["split", "--cp", "4", "--extend", "99999999999999"], {}, "--extend: 99,999,999,999,999 tokens"),
    (["split", "--cp", "4", "--extend", "5000000000"], {}, "--extend: 5,000,000,000 tokens"),
    (["split", "--cp", "4", "--extend", "100000000"], {}, "split prints every token's rank, at most 1,048,576"),
    (["split", "--mode", "round-robin", "--cp", "99999999999999", "--extend", "8"], {}, "larger than the tokens allow"),
    (["plan", "--hbm-gib", "1e300"], {}, "--hbm-gib: 1e+300 is above"),
    (["plan", "--reserved-gib", "1e300"], {}, "--reserved-gib: 1e+300 is above"),
    (["plan", "--cp", "99999"], {}, "--cp: 99999 is above 4096"),
    (["plan"], {"DSACP_HBM_GIB": "1e300"}, "DSACP_HBM_GIB: 1e+300 is above"),
    (["run", "--seed", "99999999999999999999999999"], {}, "--seed: 99999999999999999999999999 is above"),
    (["run"], {"DSACP_SEED": "99999999999999999999999999"}, "DSACP_SEED: 99999999999999999999999999 is above"),
    # ranks or devices this machine cannot run, refused before any starts
    (["run", "--device", "cuda"], {}, "no CUDA device is visible; use --device cpu"),
    (["run", "--cp-size", str(MANY_RANKS), "--requests", f"0+{4 * MANY_RANKS}"], {}, f"--cp-size={MANY_RANKS}: "),
    (["run", "--cp-size", "512", "--requests", "0+1024"], {"DSACP_RANK_THREADS": "1"}, "--cp-size=512: "),
    (["run"], {"DSACP_RANK_THREADS": "99999"}, "DSACP_RANK_THREADS='99999': at most"),
    (["run"], {"DSACP_RANK_THREADS": "0"}, "DSACP_RANK_THREADS='0': need an integer >= 1"),
    (["pd", "--device", "cuda"], {}, "no CUDA device is visible"),
    # files and folders
    (["demo", "--out", "/proc/nope"], {}, "--out '/proc/nope': cannot create it"),
    (["demo", "--out", "/etc/hostname"], {}, "--out '/etc/hostname': exists and is not a folder"),
    (["plan", "--rates", "/nonexistent/rates.json"], {}, "--rates /nonexistent/rates.json"),
    (["plan"], {"DSACP_RATES": "/nonexistent/rates.json"}, "DSACP_RATES /nonexistent/rates.json"),
    # empty or doubled list entries
    (["run", "--phases", "1,,2"], {}, "--phases: phase spec '1,,2': entry 2 is empty"),
    (["run", "--phases", ","], {}, "--phases: phase spec ',': entry 1 is empty"),
    (["run", "--phases", ""], {}, "--phases: phase spec is empty"),
    (["run"], {"DSACP_PHASES": "1,,2"}, "DSACP_PHASES: phase spec '1,,2': entry 2 is empty"),
    (["run"], {"DSACP_PHASES": ""}, "DSACP_PHASES: phase spec is empty"),
    (["run", "--requests", "3+x"], {}, "--requests: malformed request '3+x'"),
    (["run", "--requests", "1+2+3"], {}, "malformed request"),
    (["run", "--requests", ""], {}, "--requests: request spec is empty"),
    (["run"], {"DSACP_REQUESTS": "0+10,,0+5"}, "DSACP_REQUESTS: request spec '0+10,,0+5': entry 2 is empty"),
    (["run", "--requests", "0+10,"], {}, "entry 2 is empty"),
    (["run", "--batches", "0+8;;0+8"], {}, "--batches: batches '0+8;;0+8': a batch is empty"),
    (["run", "--requests", "0+0"], {}, "extend >= 1"),
    (["split", "--cp", "2", "--extend", "a,b"], {}, "'a' is not an integer"),
    (["split", "--cp", "2", "--extend", "8,,8"], {}, "entry 2 is empty"),
    (["plan", "--contexts", "99999999999999999999"], {}, "outside 1"),
    (["plan", "--contexts", "8192,,1M"], {}, "--contexts '8192,,1M': entry 2 is empty"),
    (["plan"], {"DSACP_CONTEXTS": ""}, "DSACP_CONTEXTS is empty"),
    # impossible runs
    (["run", "--cp-size", "8", "--requests", "5"], {}, "larger than the tokens allow"),
    (["run", "--split-mode", "round-robin", "--phases", "4"], {}, "round-robin split cannot run phase 4"),
    (["run", "--kv-interleave", "8"], {}, "--kv-interleave shapes KV sharded at rest: it needs phase 2"),
    (["run", "--phases", "2", "--kv-interleave", "3"], {}, "--kv-interleave=3 must be a power of two"),
    (["run", "--phases", "5", "--kv-interleave", "1"], {}, "phase 5 (compute-owner layout) allocates whole pages"),
    (
        ["run", "--split-mode", "round-robin", "--cp-size", "4", "--requests", "0+1,0+2", "--phases", "2"],
        {},
        "leave rank(s) [2, 3] without a token",
    ),
    (["run", "--phases", "9"], {}, "out of range"),
    (["run", "--phases", "+5"], {}, "needs phase(s) [2, 4]"),
    (["run", "--page-size", "48"], {}, "power of two"),
    (["split", "--cp", "4", "--extend", "3"], {}, "larger than the tokens allow"),
    (["split", "--cp", "2", "--extend", "100", "--page-size", "1"], {}, "below 4"),
    (["split", "--cp", "2", "--extend", "100", "--prefix", "1,2"], {}, "--prefix has 2 values"),
    (["split", "--mode", "round-robin", "--cp", "2", "--extend", "10", "--page-aligned"], {}, "in-seq split"),
    # numbers that are not numbers, not finite, or out of range
    (["run", "--cp-size", "0"], {}, "0 is below 1"),
    (["run", "--cp-size", "two"], {}, "'two' is not an integer"),
    (["run", "--timeout-s", "-1"], {}, "not positive"),
    (["plan", "--hbm-gib", "inf"], {}, "not a finite number"),
    (["plan", "--reserved-gib", "nan"], {}, "not a finite number"),
    (["plan", "--kv-budget-fraction", "1.5"], {}, "fraction in (0, 1]"),
    (["plan", "--interconnect-gbps", "0"], {}, "not positive"),
    (["run"], {"DSACP_CP_SIZE": "abc"}, "DSACP_CP_SIZE: 'abc' is not an integer"),
    (["run"], {"DSACP_CP_SIZE": ""}, "DSACP_CP_SIZE: '' is not an integer"),
    (["run"], {"DSACP_TIMEOUT_S": "inf"}, "DSACP_TIMEOUT_S: 'inf' is not a finite number"),
    (["plan"], {"DSACP_HBM_GIB": "lots"}, "DSACP_HBM_GIB: 'lots' is not a number"),
    # enumerated values outside their set, the empty string included
    (["run", "--preset", "nope"], {}, "--preset: unknown preset 'nope'"),
    (["run", "--device", ""], {}, "--device: unknown device ''"),
    (["demo", "--device", ""], {}, "--device: unknown device ''"),
    (["demo", "--device", "tpu"], {}, "--device: unknown device 'tpu'"),
    (["demo"], {"DSACP_DEVICE": ""}, "DSACP_DEVICE=''"),
    (["demo"], {"DSACP_DEVICE": "tpu"}, "DSACP_DEVICE='tpu'"),
    (["split", "--mode", "zigzag", "--cp", "2", "--extend", "8"], {}, "--mode: unknown split mode 'zigzag'"),
    (["plan", "--kv-dtype", ""], {}, "--kv-dtype: unknown kv dtype ''"),
    # flags a command would ignore
    (["demo", "--phases", "3"], {}, "demo: unrecognized arguments: --phases 3"),
    (["split", "--cp", "2", "--extend", "9", "--requests", "0+9"], {}, "unrecognized arguments"),
    (["pd", "--backend", "nccl"], {}, "pd: --backend nccl: the prefill ranks and the decode talk over gloo"),
    (["pd"], {"DSACP_BACKEND": "nccl"}, "pd: DSACP_BACKEND nccl"),
    (["run", "--requests", "0+9", "--batches", "0+9"], {}, "give it or --requests, not both"),
    (["pd", "--kv-design", "rotated-shard", "--phases", "1"], {}, "--kv-design=rotated-shard: the PD transfer ships"),
    # the model family's knobs: empty, contradictory, or of no use to the preset
    (["run", "--index-topk-pattern", ""], {}, "--index-topk-pattern: '' is empty"),
    (["run"], {"DSACP_INDEX_TOPK_PATTERN": ""}, "DSACP_INDEX_TOPK_PATTERN: '' is empty"),
    (["plan", "--index-topk-pattern", ""], {}, "--index-topk-pattern: '' is empty"),  # as `run` refuses it
    (
        ["run", "--mla-scale-fmt", "fp32", "--kv-dtype", "bf16"],
        {},
        "--mla-scale-fmt=fp32: the scale format is the FP8 cache's; --kv-dtype=bf16 stores no scales",
    ),
    (["run", "--preset", "tiny-v4", "--cpu-widths"], {}, "tiny-v4 is already small enough for a CPU: drop the flag"),
    (["run", "--preset", "tiny-v4"], {"DSACP_FP8_PROJECTIONS": "1"}, "DSACP_FP8_PROJECTIONS=1: tiny-v4's projections"),
    (["plan", "--preset", "tiny-v4"], {}, "python -m reference_impl.planner.v4 --preset tiny-v4"),
    # a size whose config would be built per layer, refused by its stated maximum
    (["run", "--n-layers", "1000000000"], {}, "--n-layers: 1000000000 is above 1024"),
    (["run"], {"DSACP_N_LAYERS": "1000000000"}, "DSACP_N_LAYERS: 1000000000 is above 1024"),
    # the config's checks, named as the user typed the knob: its flag or its variable
    (["run"], {"DSACP_PAGE_SIZE": "48"}, "DSACP_PAGE_SIZE=48 must be a power of two"),
    (["run"], {"DSACP_PAGE_SIZE": "2"}, "DSACP_PAGE_SIZE=2 is below 4"),
    (["run"], {"DSACP_KV_INTERLEAVE": "8"}, "DSACP_KV_INTERLEAVE shapes KV sharded at rest"),
    (["run"], {"DSACP_PHASES": "2", "DSACP_KV_INTERLEAVE": "3"}, "DSACP_KV_INTERLEAVE=3 must be a power of two"),
    (["run"], {"DSACP_INDEX_TOPK_PATTERN": "FX"}, "DSACP_INDEX_TOPK_PATTERN='FX': use one letter per layer"),
    (["run"], {"DSACP_INDEX_TOPK_PATTERN": "FSF"}, "DSACP_INDEX_TOPK_PATTERN='FSF' has 3 letters for 2 layers"),
    (["run"], {"DSACP_REQUESTS": "0+1000000", "DSACP_CHUNK_SIZE": "8"}, "DSACP_CHUNK_SIZE=8 cuts the run into"),
    (["run"], {"DSACP_MLA_SCALE_FMT": "fp32", "DSACP_KV_DTYPE": "bf16"}, "DSACP_MLA_SCALE_FMT=fp32: the scale format"),
    (["run"], {"DSACP_PRESET": "tiny-v4", "DSACP_CPU_WIDTHS": "1"}, "DSACP_CPU_WIDTHS: tiny-v4 has no CPU-width"),
    (["pd"], {"DSACP_KV_DESIGN": "rotated-shard", "DSACP_PHASES": "1"}, "DSACP_KV_DESIGN=rotated-shard: the PD"),
    (["pd"], {"DSACP_TRANSPORT": "x"}, "DSACP_TRANSPORT='x': use torch, mooncake"),
    (["run", "--index-topk-pattern", "FSF"], {}, "--index-topk-pattern='FSF' has 3 letters for 2 layers"),
    # one case rule for every enumerated knob: the exact spelling
    (
        ["run", "--index-topk-pattern", "fs"],
        {},
        "--index-topk-pattern='fs': use one letter per layer, F (runs the "
        "indexer) or S (reuses the previous F layer's top-k), upper case; found 'f', 's'",
    ),
    (["run", "--preset", "TINY-V4"], {}, "--preset: unknown preset 'TINY-V4'"),
    (["run", "--kv-design", "LAYER-SPLIT"], {}, "--kv-design: unknown kv design 'LAYER-SPLIT'"),
    (["pd", "--transport", "Mooncake"], {}, "--transport='Mooncake': use torch, mooncake"),
    # digits of other scripts: int('٣') is 3 in Python, not here
    (["run", "--cp-size", "٣"], {}, "--cp-size: '٣' is not an integer (ASCII digits only)"),
    (["run"], {"DSACP_CP_SIZE": "٣"}, "DSACP_CP_SIZE: '٣' is not an integer (ASCII digits only)"),
    (["run", "--timeout-s", "٣"], {}, "--timeout-s: '٣' is not a number (ASCII digits only)"),
    (["run", "--requests", "0+٣"], {}, "--requests: '0+٣' is not ASCII"),
    (["run"], {"DSACP_PHASES": "٣"}, "DSACP_PHASES: '٣' is not ASCII"),
    (["split", "--cp", "2", "--extend", "٨"], {}, "--extend: '٨' is not ASCII"),
    (["plan", "--contexts", "٨K"], {}, "--contexts: '٨K' is not ASCII"),
    (["run"], {"DSACP_RANK_THREADS": "١"}, "DSACP_RANK_THREADS='١': need an integer"),
    # results that would overflow: a stated minimum
    (["plan", "--interconnect-gbps", "1e-300"], {}, "--interconnect-gbps: 1e-300 is below 0.001"),
    (["plan"], {"DSACP_INTERCONNECT_GBPS": "1e-300"}, "DSACP_INTERCONNECT_GBPS: 1e-300 is below 0.001"),
    # a torchrun-style environment that an env:// rendezvous could not use, refused by the variable
    (
        ["run"],
        {"RANK": "0", "WORLD_SIZE": "abc", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        "WORLD_SIZE='abc': need an integer",
    ),
    (["run"], {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}, "environment without MASTER_PORT"),
    (["run"], {"WORLD_SIZE": "abc"}, "without RANK, MASTER_ADDR, MASTER_PORT"),
    (
        ["run"],
        {"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        "RANK=3: need 0 <= RANK <= 1",
    ),
    (
        ["run"],
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"},
        "MASTER_PORT=99999: need 1 <= MASTER_PORT <= 65535",
    ),
]
# Every enumerated run knob's variable, empty or outside its set; every boolean's, empty or "maybe".
# Each in another case too: one rule for every enumerated knob, the exact spelling.
_SPELLED = {
    "preset": "tiny",
    "kv_dtype": "fp8",
    "split_mode": "in-seq",
    "device": "cpu",
    "backend": "gloo",
    "compute_dtype": "fp32",
    "kv_design": "layer-split",
    "mla_scale_fmt": "fp32",
}
for _field, _value in _SPELLED.items():
    _, _flag, _env = knob_names(_field)
    BAD_INPUT += [
        (["run"], {_env: ""}, f"{_env}: unknown"),
        (["run"], {_env: "maybe"}, f"{_env}: unknown"),
        (["run"], {_env: _value.upper()}, f"{_env}: unknown"),
        (["run", _flag, _value.upper()], {}, f"{_flag}: unknown"),
    ]
for _field in ("check", "input_logprobs", "return_hidden_states"):
    _env = knob_names(_field)[2]
    BAD_INPUT += [(["run"], {_env: ""}, f"{_env}=''"), (["run"], {_env: "maybe"}, f"{_env}='maybe'")]
# Every variable the library reads, refused by whichever command runs (split never reads them).
for _field, _knob in LIBRARY_ENV.items():
    _env = knob_names(_field)[2]
    BAD_INPUT += [
        (["split", "--cp", "2", "--extend", "8"], {_env: value}, f"{_env}={value!r}") for value in ("", "maybe")
    ]
BAD_INPUT += [(["run"], {"DSACP_TRITON_TOPK": "2"}, "DSACP_TRITON_TOPK='2'")]


@pytest.mark.parametrize(("argv", "env", "words"), BAD_INPUT, ids=[" ".join(a) + str(e) for a, e, _ in BAD_INPUT])
def test_bad_input_is_one_line_exit_2(capsys, monkeypatch, argv: list[str], env: dict[str, str], words: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    assert main(argv) == 2
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err
    assert "Traceback" not in err
    if len(argv) == 1 and env:  # set by the environment alone: the line names the variable the user set
        assert any(name in err for name in env), err
    assert elapsed < LIMIT_S, f"refused after {elapsed:.1f} s"


def test_the_whole_table_in_a_fresh_process_stays_small() -> None:
    """Every row of the table in one new process: each refused, and the process's peak resident
    memory under 2 GiB (a refusal builds nothing proportional to the bad size)."""
    script = f"""
import json, os, resource, sys, io, contextlib
sys.path.insert(0, {str(ROOT)!r})
os.environ.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", DSACP_RANK_THREADS="1")
from tests.test_front_door import BAD_INPUT
from reference_impl.cli import main
codes = []
for argv, env, words in BAD_INPUT:
    saved = {{k: os.environ.get(k) for k in env}}
    os.environ.update(env)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        codes.append((main(argv), words in err.getvalue()))
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
print(json.dumps({{"codes": codes, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.splitlines()[-1])
    assert doc["codes"] == [[2, True]] * len(BAD_INPUT)
    assert doc["peak_kib"] < 2 * 1024 * 1024, f"peak {doc['peak_kib'] / 1024:.0f} MiB"


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    import os

    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "reference_impl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )


def test_a_bare_command_prints_usage() -> None:
    proc = _cli()
    assert proc.returncode == 2 and proc.stderr.startswith("usage: ") and "{run,pd,demo,split,plan}" in proc.stderr


def test_the_module_entry_point_exits_2() -> None:
    proc = _cli("run", "--preset", "nope")
    assert proc.returncode == 2 and proc.stderr.startswith("error: run: argument --preset: unknown preset 'nope': use ")
    assert proc.stderr.count("\n") == 1 and "deepseek-v3.2" in proc.stderr and "tiny-v4" in proc.stderr


def test_a_timeout_while_ranks_start_is_one_line_exit_3() -> None:
    """The ranks are stopped while they start (SIGTERM): none prints a traceback, the parent one line."""
    for cp_size in ("2", "4"):
        proc = _cli("run", "--cp-size", cp_size, "--requests", "0+64", "--timeout-s", "0.01")
        assert proc.returncode == 3, proc.stderr
        assert re.fullmatch(
            r"error: rank\(s\) \[[0-9, ]+\] did not finish .*within 0.01 s; all ranks stopped\n", proc.stderr
        ), proc.stderr


# ---- the Python API ----------------------------------------------------------------------------


def _make_model_from_a_text_file() -> None:
    """``make_model`` given a file that exists and is no safetensors file (its header length is text)."""
    import tempfile

    import reference_impl as ri

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        path.write_text("not a checkpoint")
        ri.make_model("tiny", checkpoint=path)


def _api_misuse() -> list[tuple[str, object, str]]:
    import torch

    import reference_impl as ri

    tiny = ri.get_preset("tiny")
    layout = ri.KVLayout.from_config(tiny, "fp8", 64)
    return [
        (
            "make_model checkpoint not safetensors",
            _make_model_from_a_text_file,
            "model.safetensors: not a safetensors file",
        ),
        ("make_model n_layers huge", lambda: ri.make_model("tiny", n_layers=10**9), "n_layers=1000000000: need"),
        ("RunConfig n_layers huge", lambda: ri.RunConfig(n_layers=10**9), "n_layers=1000000000: need"),
        ("RunConfig pattern case", lambda: ri.RunConfig(index_topk_pattern="fs"), "upper case; found 'f', 's'"),
        ("LayerCache.empty tpu", lambda: ri.LayerCache.empty(layout, "tpu"), "device='tpu'"),
        ("LayerCache.empty cuda", lambda: ri.LayerCache.empty(layout, "cuda:99"), "device='cuda:99'"),
        ("LayerCache.empty layout", lambda: ri.LayerCache.empty("fp8", "cpu"), "layout='fp8'"),
        ("run_prefill progress int", lambda: ri.run_prefill(ri.RunConfig(), progress=5), "progress=5"),
        ("run_prefill tensors str", lambda: ri.run_prefill(ri.RunConfig(), tensors="yes"), "tensors='yes'"),
        ("run_prefills progress str", lambda: ri.run_prefills([ri.RunConfig()], progress="bar"), "progress='bar'"),
        ("make_model dtype str", lambda: ri.make_model("tiny", dtype="float32"), "dtype='float32'"),
        ("make_model n_layers str", lambda: ri.make_model("tiny", n_layers="2"), "n_layers='2'"),
        ("make_model n_layers 0", lambda: ri.make_model("tiny", n_layers=0), "n_layers=0"),
        ("make_model device cuda", lambda: ri.make_model("tiny", device="cuda"), "device='cuda'"),
        ("make_model device tpu", lambda: ri.make_model("tiny", device="tpu"), "device='tpu'"),
        ("make_model preset int", lambda: ri.make_model(3), "preset=3"),
        ("make_model seed", lambda: ri.make_model("tiny", seed=2**64), "seed="),
        ("make_model head", lambda: ri.make_model("tiny", head="yes"), "head='yes'"),
        ("make_inputs spec str", lambda: ri.make_inputs(tiny, "0+10"), "requests='0+10'"),
        ("make_inputs cfg str", lambda: ri.make_inputs("tiny", [ri.Request(0, 10)]), "cfg='tiny'"),
        ("make_inputs too big", lambda: ri.make_inputs(tiny, [ri.Request(0, 2**40)]), "make_inputs of"),
        ("make_inputs dtype", lambda: ri.make_inputs(tiny, [ri.Request(0, 4)], dtype=torch.int8), "dtype=torch.int8"),
        ("build_split int", lambda: ri.build_split("in-seq", 4, 19), "extend_lens=19"),
        ("build_split float", lambda: ri.build_split("in-seq", 4, [19.0]), "19.0 is not an int"),
        ("build_split cp str", lambda: ri.build_split("in-seq", "4", [19]), "cp_size='4'"),
        ("build_split huge", lambda: ri.build_split("in-seq", 4, [10**14]), "at most 2,147,483,647"),
        ("build_split prefix str", lambda: ri.build_split("in-seq", 2, [19], "4"), "prefix_lens='4'"),
        ("PhaseSet.level str", lambda: ri.PhaseSet.level("3"), "phase level '3'"),
        ("PhaseSet.parse int", lambda: ri.PhaseSet.parse(3), "phase spec 3"),
        ("PlannerConfig cp str", lambda: ri.PlannerConfig(cp_size="8"), "cp_size='8'"),
        ("PlannerConfig contexts str", lambda: ri.PlannerConfig(contexts="128K"), "contexts='128K'"),
        ("PlannerConfig hbm", lambda: ri.PlannerConfig(hbm_gib=1e300), "hbm_gib=1e+300"),
        ("PlannerConfig cp huge", lambda: ri.PlannerConfig(cp_size=10**6), "cp_size=1000000"),
        ("load_rates missing", lambda: ri.load_rates("x.json"), "rates x.json: No such file"),
        ("load_rates ints", lambda: ri.load_rates([1, 2]), "rates=[1, 2]"),
        ("RunConfig seed", lambda: ri.RunConfig(seed=2**63), "seed=9223372036854775808"),
        ("RunConfig device", lambda: ri.RunConfig(device=""), "device=''"),
        ("run_prefill str", lambda: ri.run_prefill("tiny"), "run='tiny'"),
        ("oracle model", lambda: ri.oracle("m", [ri.Request(0, 4)], []), "model='m'"),
        ("run_prefills one run", lambda: ri.run_prefills(ri.RunConfig()), "need a list of RunConfig"),
        ("run_prefills str item", lambda: ri.run_prefills(["x"]), "runs[0]='x'"),
        ("parse_requests int", lambda: ri.parse_requests(96), "request spec=96"),
        ("plan_capacity rates None", lambda: ri.plan_capacity(ri.PlannerConfig(), None), "rates=None"),
        ("plan_capacity config str", lambda: ri.plan_capacity("x", ri.load_rates()), "config='x'"),
    ]


@pytest.mark.parametrize("case", range(len(_api_misuse())), ids=[name for name, _, _ in _api_misuse()])
def test_api_misuse_is_a_config_error_naming_the_argument(case: int) -> None:
    import reference_impl as ri

    _, call, words = _api_misuse()[case]
    start = time.monotonic()
    with pytest.raises(ri.ConfigError) as info:
        call()
    assert words in str(info.value) and "--" not in str(info.value), str(info.value)  # a Python name, no CLI flag
    assert time.monotonic() - start < LIMIT_S


def test_make_model_estimates_its_memory_before_allocating(monkeypatch) -> None:
    """The default model (61 DeepSeek-V3.2 layers) on a CPU with 16 GiB free: refused at once."""
    import reference_impl as ri
    from reference_impl import api

    monkeypatch.setattr(api, "free_bytes", lambda device_type: 16 << 30)
    start = time.monotonic()
    with pytest.raises(ri.ConfigError, match=r"make_model\('deepseek-v3.2', n_layers=61.*needs about .* GiB on cpu"):
        ri.make_model()
    assert time.monotonic() - start < 1.0
    assert len(ri.make_model("tiny").layers) == 2  # what fits is built


def test_load_rates_takes_a_path_or_a_list(tmp_path) -> None:
    import reference_impl as ri

    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"interconnect_gbps": 123.0}))
    for given in (str(path), path, [str(path)], (path,)):
        rates = ri.load_rates(given)
        assert rates.interconnect_gbps == 123.0 and rates.sources["interconnect_gbps"].endswith("interconnect_gbps")
    path.write_text(json.dumps({"interconnect_gbps": -1}))
    with pytest.raises(ri.ConfigError, match="must be positive, finite numbers"):
        ri.load_rates(path)
    path.write_text(json.dumps({"interconnect_gbps": True}))
    with pytest.raises(ri.ConfigError, match=r"\['interconnect_gbps'\] are booleans"):
        ri.load_rates(path)


# ---- ranks the machine cannot run --------------------------------------------------------------


def test_the_machine_rules_name_cores_and_file_descriptors() -> None:
    from reference_impl.config import ConfigError
    from reference_impl.launch import FDS_BASE, FDS_PER_PEER, check_machine, choose_backend

    def plan(cp_size: int):  # noqa: ANN202
        return choose_backend(cp_size, "cpu", "auto", 0)

    check_machine(plan(32), 1, cores=2, fd_limit=1024)  # 16 rank threads per core: the most
    with pytest.raises(ConfigError, match=r"cp_size=33: 33 ranks on 2 cores; this machine runs at most 32"):
        check_machine(plan(33), 1, cores=2, fd_limit=1024)
    with pytest.raises(ConfigError, match=r"cp_size=16: 16 ranks x 4 threads on 2 cores; this machine runs at most 8"):
        check_machine(plan(16), 4, cores=2, fd_limit=1024)
    too_many = (1024 - FDS_BASE) // FDS_PER_PEER + 1
    with pytest.raises(ConfigError, match=r"file descriptors .* over this process's limit of 1024 \(ulimit -n\)"):
        check_machine(plan(too_many), 1, cores=1024, fd_limit=1024)
    check_machine(plan(1), 99, cores=1, fd_limit=1)  # one rank runs in this process: no rule applies


def test_plan_refuses_a_boolean_rate_naming_the_file_and_field(tmp_path, capsys, monkeypatch) -> None:
    """``{"interconnect_gbps": true}`` is no rate (read as a number it would be 1 GB/s)."""
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"interconnect_gbps": True}))
    assert main(["plan", "--rates", str(path)]) == 2
    assert (
        capsys.readouterr().err == f"error: --rates {path}: interconnect_gbps is true, a boolean; a rate is a number\n"
    )
    monkeypatch.setenv("DSACP_RATES", str(path))
    assert main(["plan"]) == 2
    assert capsys.readouterr().err.startswith(f"error: DSACP_RATES {path}: interconnect_gbps is true")
    path.write_text(json.dumps({"interconnect_gbps": 123.0}))  # a number is taken
    assert main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rates"]["interconnect_gbps"]["value"] == 123.0

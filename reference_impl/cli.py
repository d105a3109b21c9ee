"""Command line: ``python -m reference_impl {run,pd,demo,split,plan} ...``.

Every run flag is a :class:`~reference_impl.config.RunConfig` field: ``--cp-size`` is the field
``cp_size`` and the environment variable ``DSACP_CP_SIZE`` (an environment variable sets the
default; a flag overrides it). Exit codes: 0 success, 1 a run disagrees with the oracle, 2 bad
input (one line on stderr naming the flag or variable, no traceback), also an output that cannot be
written (stdout on a full disk: one line saying so), 3 a rank failed, died or hung (one line naming
the rank; with ``--debug`` that rank's traceback too), 128 + N stopped by signal N (SIGTERM, SIGINT:
every rank stopped first).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from reference_impl.config import (
    BACKENDS,
    COMPUTE_DTYPES,
    DEVICES,
    KV_DESIGNS,
    KV_DTYPES,
    MAX_HBM_GIB,
    MAX_LAYERS,
    MAX_PLAN_CP,
    MAX_SEED,
    SCALE_FMTS,
    SPLIT_MODES,
    ConfigError,
    PhaseSet,
    RunConfig,
    ascii_int,
    check_environment,
    env_choice,
    env_flag,
    env_value,
    knob_names,
    parse_batches,
    parse_int_list,
    parse_requests,
    validate_page_size,
)
from reference_impl.errors import RankFailedError, RunStopped
from reference_impl.families import family_of, get_preset, preset_names

EXIT_OK = 0
EXIT_DISAGREES = 1
EXIT_BAD_INPUT = 2
EXIT_RANK_FAILED = 3  # a rank raised, died or hung (the message names it)
EXIT_NO_OUTPUT = EXIT_BAD_INPUT  # stdout cannot be written (a full disk): never 1, which says "disagrees"
MIN_INTERCONNECT_GBPS = 1e-3  # plan: 1 MB/s; below it a level's times overflow to inf


class _OutputError(Exception):
    """Writing the command's output to stdout failed (not a closed pipe: a full disk, an I/O error)."""


def _out(text: str) -> None:
    """Print the command's result on stdout, flushed here, so that a write that fails is reported as such."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise _OutputError(exc.strerror or str(exc)) from None


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``error: ...``) and exit code 2, and whose help and usage go
    through :func:`_out` (argparse itself drops a failed write and exits 0)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog.split()[-1]}: {message}")

    def print_help(self, file: Any = None) -> None:
        if file is None or file is sys.stdout:
            _out(self.format_help().rstrip("\n"))
        else:
            super().print_help(file)


# ---- typed flag values: each refuses what it cannot use, naming the flag ----------------------


def _int_arg(minimum: int | None = None, maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = ascii_int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer{_digits_hint(text)}") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is above {maximum}{f' ({why})' if why else ''}")
        return value

    return parse


def _digits_hint(text: str) -> str:
    return "" if text.isascii() else " (ASCII digits only)"


def _choice_arg(choices: Sequence[str], what: str) -> Callable[[str], str]:
    """One of ``choices`` exactly, case included (surrounding blanks dropped); anything else (the empty
    string, another case) is refused with the choices. Every enumerated knob follows this one rule."""

    def parse(text: str) -> str:
        if text.strip() not in choices:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}: use {', '.join(choices)}")
        return text.strip()

    return parse


def _float_arg(
    positive: bool = True, maximum: float | None = None, why: str = "", minimum: float | None = None
) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            if not text.isascii():
                raise ValueError(text)
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number{_digits_hint(text)}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if positive and value <= 0:
            raise argparse.ArgumentTypeError(f"{value:g} is not positive")
        if value < 0:
            raise argparse.ArgumentTypeError(f"{value:g} is negative")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value:g} is above {maximum:,g}{f' ({why})' if why else ''}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{value:g} is below {minimum:g}{f' ({why})' if why else ''}")
        return value

    return parse


def _ascii_text(text: str) -> str:
    """A spec of numbers (requests, phases, contexts) in ASCII: Python's ``int`` would read '٣' as 3."""
    if not text.isascii():
        raise argparse.ArgumentTypeError(f"{text!r} is not ASCII (numbers take ASCII digits only)")
    return text


def _pattern_arg(text: str) -> str:
    """An IndexShare pattern: not empty (the letters and their count are the config's checks)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is empty: give one letter per layer (F or S), or leave it out for the preset's own pattern"
        )
    return text


def _flag(field: str) -> str:
    return knob_names(field)[1]


# ---- run flags ---------------------------------------------------------------------------------

# field -> (parse, help); defaults come from RunConfig, then DSACP_<FIELD> overrides them.
_RUN_KNOBS: dict[str, tuple[Callable[[str], Any], str]] = {
    "preset": (_choice_arg(preset_names(), "preset"), " | ".join(preset_names())),
    "cp_size": (_int_arg(1), "CP ranks C"),
    "requests": (_ascii_text, "comma-separated PREFIX+EXTEND pairs (or EXTEND), e.g. 0+96,40+70"),
    "kv_dtype": (_choice_arg(KV_DTYPES, "kv dtype"), " | ".join(KV_DTYPES)),
    "phases": (_ascii_text, "a cumulative level 0..8 (e.g. 1) or an explicit list (e.g. 1,2)"),
    "split_mode": (_choice_arg(SPLIT_MODES, "split mode"), " | ".join(SPLIT_MODES)),
    "page_size": (_int_arg(1), "tokens per KV page (a power of two, 4..4096)"),
    "kv_interleave": (
        _int_arg(1),
        "KV sharded at rest: consecutive tokens per rank (a power of two dividing the page size)",
    ),
    "kv_design": (
        _choice_arg(KV_DESIGNS, "kv design"),
        f"how the KV is kept and gathered: {' | '.join(KV_DESIGNS)} "
        "(a design replaces phases 2, 3, 5, 6 and 8: run it with --phases 1,7 or fewer)",
    ),
    "n_layers": (_int_arg(1, MAX_LAYERS, "the deepest DSA model has 78"), "layers"),
    "chunk_size": (_int_arg(1), "chunked prefill: extend tokens per request per chunk"),
    "pool_pages": (
        _int_arg(1),
        "long-lived pool budget in pages: finished requests stay cached for prefix hits, evicted LRU first",
    ),
    "seed": (_int_arg(0, MAX_SEED, "2**63 - 2"), "weights and inputs"),
    "device": (_choice_arg(DEVICES, "device"), " | ".join(DEVICES)),
    "backend": (_choice_arg(BACKENDS, "backend"), " | ".join(BACKENDS)),
    "compute_dtype": (_choice_arg(COMPUTE_DTYPES, "compute dtype"), " | ".join(COMPUTE_DTYPES)),
    "timeout_s": (_float_arg(), "seconds a run may take before its ranks are stopped"),
    "mla_scale_fmt": (
        _choice_arg(SCALE_FMTS, "MLA scale format"),
        "FP8 MLA cache scales: ue8m0 (powers of two, DeepSeek's) | fp32 (amax / 448, SGLang's); same 656-byte rows",
    ),
    "index_topk_pattern": (
        _pattern_arg,
        "IndexShare: one letter per layer, F (runs the indexer) or S (reuses the previous F layer's top-k), e.g. FFFS",
    ),
}
_RUN_SWITCHES: dict[str, str] = {
    "debug": "syncing diagnostics, collective recorder; third-party logs (Mooncake's) too",
    "check": "compare with the oracle",
    "input_logprobs": "needs every row: full tail gather",
    "return_hidden_states": "needs every row: full tail gather",
    "cpu_widths": "a real preset on a CPU: tiny's widths (hidden, heads, q_lora, indexer heads, top-k, vocab), the "
    "preset's head dims, byte layouts and semantics",
}
# The defaults that are no literal value of RunConfig (None there: decided from the rest).
_RUN_DEFAULT_WORDS: dict[str, str] = {
    "device": "auto: CUDA where visible",
    "backend": "auto: NCCL with a GPU per rank, else gloo",
    "compute_dtype": "auto: fp32 on CPU, bf16 on CUDA",
    "kv_interleave": "the page size in-seq, 1 round-robin",
    "n_layers": "the preset's",
    "chunk_size": "none: one chunk",
    "pool_pages": "none: room for every request, freed between batches",
    "index_topk_pattern": "the preset's; glm-5.2: full on 0, 1, 2, 6, 10, ...",
}


def _run_default(field: str, defaults: dict[str, str]) -> str:
    """A run knob's default as ``--help`` shows it (``defaults``: the command's own, e.g. pd's phases)."""
    if field in defaults:
        return defaults[field]
    if field in _RUN_DEFAULT_WORDS:
        return _RUN_DEFAULT_WORDS[field]
    value = getattr(RunConfig(), field)
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _add_run_flags(p: argparse.ArgumentParser, **defaults: str) -> None:
    defaults = {"requests": "0+96,40+70", "phases": "0", **defaults}
    for field, (parse, help_text) in _RUN_KNOBS.items():
        p.add_argument(
            _flag(field),
            type=parse,
            default=None,
            help=f"{help_text} (default {_run_default(field, defaults)}; env {knob_names(field)[2]})",
        )
    for field, help_text in _RUN_SWITCHES.items():
        p.add_argument(
            _flag(field),
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"{help_text} (default {_run_default(field, defaults)}; env {knob_names(field)[2]})",
        )
    p.add_argument(
        "--batches",
        type=_ascii_text,
        default=None,
        metavar="B1;B2;...",
        help="several batches in sequence on one pool per rank, each a requests spec; requests are numbered "
        "across the run (r0, r1, ...) and rN:P+E starts with the first P tokens of request N "
        "(default: one batch, --requests; env DSACP_BATCHES)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the JSON report instead of the table (default: the table)"
    )


def _knob(args: argparse.Namespace, field: str, default: Any) -> Any:
    """The flag if given, else ``DSACP_<FIELD>`` (parsed, naming the variable on error), else ``default``."""
    value = getattr(args, field)
    if value is not None:
        return value
    if field in _RUN_SWITCHES:
        return env_flag(field, default)
    parse = _RUN_KNOBS[field][0]
    text = env_value(field)
    if text is None:
        return default
    try:
        return parse(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{knob_names(field)[2]}: {exc}") from None


def _source(args: argparse.Namespace, field: str) -> str:
    """Where a knob's value came from: its flag when given, else its environment variable."""
    return knob_names(field)[1] if getattr(args, field, None) is not None else knob_names(field)[2]


def _cli_names(args: argparse.Namespace, fields: Sequence[str]) -> dict[str, str]:
    """Field -> what the user typed to set it: its flag, else its variable, and for a field left at its
    default the flag (what would set it here)."""
    return {
        field: knob_names(field)[2]
        if getattr(args, field, None) is None and env_value(field) is not None
        else knob_names(field)[1]
        for field in fields
    }


@contextmanager
def _as_typed(names: dict[str, str]) -> Iterator[None]:
    """Errors from the library name config fields (``page_size=48``); say them as the user typed them
    (``--page-size=48``, ``DSACP_PAGE_SIZE=48``): a field before ``=``, or opening the message."""
    try:
        yield
    except ConfigError as exc:
        message = str(exc)
        for field, name in names.items():
            message = re.sub(rf"(?<![\w.-]){field}(?==)", name, message)
            message = re.sub(rf"^{field}(?=[ :])", name, message)
        if message == str(exc):
            raise
        raise ConfigError(message) from None


def _parsed(source: str, parse: Callable[[str], Any], text: str) -> Any:
    """``parse(text)``, its error prefixed with the flag or variable it came from."""
    try:
        return parse(text)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _text(text: str) -> str:
    """:func:`_ascii_text` raising :class:`ConfigError` (for :func:`_parsed`)."""
    try:
        return _ascii_text(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(str(exc)) from None


def _run_config(args: argparse.Namespace, **defaults: Any) -> RunConfig:
    base = RunConfig(**{k: v for k, v in defaults.items() if k not in ("requests", "phases")})
    fields: dict[str, Any] = {}
    for field in (*_RUN_KNOBS, *_RUN_SWITCHES):
        value = _knob(args, field, getattr(base, field) if field not in ("requests", "phases") else None)
        if value is not None:
            fields[field] = value
    batches = args.batches if getattr(args, "batches", None) is not None else env_value("batches")
    if batches is not None:
        if "requests" in fields:
            raise ConfigError("--batches lists every batch's requests: give it or --requests, not both")
        source = "--batches" if getattr(args, "batches", None) is not None else knob_names("batches")[2]
        requests, sizes = _parsed(source, lambda text: parse_batches(_text(text)), batches)
        fields["requests"], fields["batch_sizes"] = tuple(requests), sizes
    elif "requests" in fields:
        fields["requests"] = tuple(_parsed(_source(args, "requests"), parse_requests, fields["requests"]))
    else:
        fields["requests"] = tuple(parse_requests(defaults.get("requests", "0+96,40+70")))
    if "phases" in fields:
        fields["phases"] = _parsed(_source(args, "phases"), PhaseSet.parse, fields["phases"])
    else:
        fields["phases"] = PhaseSet.parse(defaults.get("phases", "0"))
    return base.replace(**fields)


def _cmd_run(args: argparse.Namespace) -> int:
    from reference_impl.runner import run_prefill
    from reference_impl.tables import format_table

    with _as_typed(_cli_names(args, [*_RUN_KNOBS, *_RUN_SWITCHES])):
        run = _run_config(args)
        args.debug = run.debug  # the error handler prints a rank's traceback in debug mode
        with _ProgressBar() as bar:
            report = run_prefill(run, progress=bar.update)
    if report is None:  # a torchrun rank other than 0: rank 0 prints the one report
        return EXIT_OK
    _out(json.dumps(report, indent=2) if args.json else format_table([report]))
    return EXIT_DISAGREES if report["matches_oracle"] is False else EXIT_OK


# ---- demo --------------------------------------------------------------------------------------


def _enumerated(args: argparse.Namespace, field: str, choices: Sequence[str], default: str) -> str:
    """An enumerated knob: the flag if given, else ``DSACP_<FIELD>``, else ``default``; a value
    outside ``choices`` (the empty one too) is refused, naming the flag or the variable."""
    value, name = getattr(args, field), knob_names(field)[1]
    if value is None:
        value, name = env_value(field), knob_names(field)[2]
    if value is None:
        return default
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: use {', '.join(choices)}")
    return value


def _cmd_pd(args: argparse.Namespace) -> int:
    from reference_impl.prefill_decode import TRANSPORTS, format_pd, pd_report, run_prefill_and_decode

    with _as_typed(_cli_names(args, [*_RUN_KNOBS, *_RUN_SWITCHES, "transport"])):
        run = _run_config(args, phases="2")
        args.debug = run.debug
        if run.backend not in ("auto", "gloo"):
            raise ConfigError(
                f"pd: {_source(args, 'backend')} {run.backend}: the prefill ranks and the decode talk "
                "over gloo (point-to-point sends); leave the backend out or use gloo"
            )
        transport = _enumerated(args, "transport", TRANSPORTS, "torch")
        with _mooncake_logs(run.debug):
            result = run_prefill_and_decode(run, timeout_s=run.timeout_s, transfer=args.transfer, transport=transport)
    doc = pd_report(run, result)
    _out(json.dumps(doc, indent=2) if args.json else format_pd(doc))
    return EXIT_DISAGREES if False in (doc["decode_matches_oracle"], doc["decode_matches_prefill"]) else EXIT_OK


@contextmanager
def _mooncake_logs(debug: bool) -> Iterator[None]:
    """With ``--debug``, Mooncake's own logs (``MC_LOG_LEVEL=INFO`` unless set) for the ranks this starts;
    without, they stay quiet (:func:`~reference_impl.pd.mooncake_engine.mooncake_unavailable`)."""
    if not debug or "MC_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["MC_LOG_LEVEL"] = "INFO"
    try:
        yield
    finally:
        os.environ.pop("MC_LOG_LEVEL", None)


def _cmd_demo(args: argparse.Namespace) -> int:
    from reference_impl.demo import format_demo, prepare_out_dir, run_demo

    device = args.device if args.device is not None else env_choice("device", DEVICES, "auto")
    if args.out is not None:
        prepare_out_dir(args.out, "--out")
    result = run_demo(device=device, out_dir=args.out, progress=not args.json)
    _out(json.dumps(result, indent=2) if args.json else format_demo(result))
    return EXIT_DISAGREES if not result["all_match_oracle"] else EXIT_OK


# ---- split -------------------------------------------------------------------------------------

MAX_SPLIT_TOKENS = 1 << 20  # split prints every token: 2^20 of them is ~8 MB of text


def _cmd_split(args: argparse.Namespace) -> int:
    from reference_impl.cp.split import build_split

    extend = parse_int_list(args.extend, "--extend", minimum=1)
    prefix = parse_int_list(args.prefix, "--prefix", minimum=0) if args.prefix is not None else [0] * len(extend)
    if len(prefix) != len(extend):
        raise ConfigError(f"--prefix has {len(prefix)} values but --extend has {len(extend)}")
    if sum(extend) > MAX_SPLIT_TOKENS:
        raise ConfigError(
            f"--extend: {sum(extend):,} tokens; split prints every token's rank, at most "
            f"{MAX_SPLIT_TOKENS:,} (a run takes more: `run --requests`)"
        )
    with _as_typed({field: _flag(field) for field in ("split_mode", "cp_size", "page_size")}):  # flags only
        validate_page_size(args.page_size)
        meta = build_split(
            args.split_mode, args.cp_size, extend, prefix, args.page_size, page_aligned=args.page_aligned
        )
    doc = meta.to_json()
    if args.json:
        _out(json.dumps(doc))
        return EXIT_OK
    aligned = f", page-aligned: {meta.page_aligned}" if args.page_aligned else ""
    lines = [
        f"{meta.mode} split, C={meta.cp_size}{aligned}, requests (prefix+extend): "
        + ", ".join(f"{p}+{e}" for p, e in zip(prefix, extend))
    ]
    if meta.block_sizes:
        lines.append(f"  block sizes per request: {[list(b) for b in meta.block_sizes]}")
    lines += [f"  rank {rank['rank']} ({rank['length']} tokens): {rank['tokens']}" for rank in doc["ranks"]]
    lines.append(f"  rerange index: {doc['rerange_index']}")
    _out("\n".join(lines))
    return EXIT_OK


# ---- plan --------------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    """Capacity planner: predictions per phase level (:mod:`reference_impl.planner`); nothing runs."""
    from reference_impl.planner import PlannerConfig, format_plan, load_rates, parse_contexts, plan_capacity

    def knob(field: str, parse: Callable[[str], Any], default: Any) -> Any:
        value = getattr(args, field)
        if value is not None:
            return value
        text = env_value(field)
        if text is None:
            return default
        try:
            return parse(text)
        except (argparse.ArgumentTypeError, ConfigError) as exc:
            raise ConfigError(f"{knob_names(field)[2]}: {exc}") from None

    fields = (
        "preset",
        "cp_size",
        "hbm_gib",
        "reserved_gib",
        "kv_budget_fraction",
        "contexts",
        "kv_dtype",
        "page_size",
        "split_mode",
        "index_topk_pattern",
        "interconnect_gbps",
    )
    with _as_typed(_cli_names(args, fields)):
        config = PlannerConfig(
            preset=knob("preset", _choice_arg(preset_names(), "preset"), "deepseek-v3.2"),
            cp_size=knob("cp_size", _int_arg(1, MAX_PLAN_CP), 8),
            hbm_gib=knob("hbm_gib", _float_arg(maximum=MAX_HBM_GIB, why="1 PiB"), 141.0),
            reserved_gib=knob("reserved_gib", _float_arg(positive=False, maximum=MAX_HBM_GIB, why="1 PiB"), None),
            kv_budget_fraction=knob("kv_budget_fraction", _float_arg(), None),
            contexts=parse_contexts(knob("contexts", _ascii_text, "8192,131072,1048576"), _source(args, "contexts")),
            kv_dtype=knob("kv_dtype", _choice_arg(KV_DTYPES, "kv dtype"), "fp8"),
            page_size=knob("page_size", _int_arg(1), 64),
            split_mode=knob("split_mode", _choice_arg(SPLIT_MODES, "split mode"), "in-seq"),
            index_topk_pattern=knob("index_topk_pattern", _pattern_arg, None),
        )
        env_rates = env_value("rates")
        if args.rates:
            _refuse_boolean_rates(args.rates, "--rates")
            rates = load_rates(args.rates, what="--rates")
        else:
            _refuse_boolean_rates([env_rates] if env_rates is not None else [], knob_names("rates")[2])
            rates = load_rates([env_rates] if env_rates is not None else None, what=knob_names("rates")[2])
        gbps = knob("interconnect_gbps", _interconnect_arg, None)
        if gbps is not None:
            rates = rates.override({"interconnect_gbps": gbps}, _source(args, "interconnect_gbps"))
        plan = plan_capacity(config, rates)
    _out(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return EXIT_OK


PLAN_COMMAND = "python -m reference_impl plan"  # a family's planner_command when this command plans it


_interconnect_arg = _float_arg(minimum=MIN_INTERCONNECT_GBPS, why="1 MB/s: slower, a level's times overflow")
_BENCH_RESULT_KEYS = ("per_rank", "kernels", "bench", "compute_bench")  # a benchmark's results, not {field: value}


def _refuse_boolean_rates(paths: Sequence[str], what: str) -> None:
    """A ``{field: value}`` rates file whose value is a JSON boolean, refused naming the file and the field: a
    boolean is no rate (read as a number, ``true`` would be 1 GB/s). Unreadable files are load_rates' to name."""
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and not any(key in doc for key in _BENCH_RESULT_KEYS):
            for field, value in doc.items():
                if isinstance(value, bool):
                    raise ConfigError(f"{what} {path}: {field} is {json.dumps(value)}, a boolean; a rate is a number")


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    env = lambda field: knob_names(field)[2]  # noqa: E731
    planners = {name: family_of(get_preset(name)).planner_command for name in preset_names()}
    elsewhere = "; ".join(
        sorted(
            {
                f"{', '.join(n for n in planners if planners[n] == c)}: {c}"
                for c in planners.values()
                if c != PLAN_COMMAND
            }
        )
    )
    p.add_argument(
        _flag("preset"),
        type=_choice_arg(preset_names(), "preset"),
        default=None,
        help=f"{' | '.join(n for n in planners if planners[n] == PLAN_COMMAND)} (default deepseek-v3.2; "
        f"env {env('preset')}" + (f"; {elsewhere})" if elsewhere else ")"),
    )
    p.add_argument(
        _flag("cp_size"),
        "--cp",
        dest="cp_size",
        type=_int_arg(1, MAX_PLAN_CP),
        default=None,
        help=f"CP ranks C (default 8; env {env('cp_size')})",
    )
    p.add_argument(
        _flag("hbm_gib"),
        type=_float_arg(maximum=MAX_HBM_GIB, why="1 PiB"),
        default=None,
        help=f"HBM per GPU, GiB (default 141; env {env('hbm_gib')})",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        _flag("reserved_gib"),
        type=_float_arg(positive=False, maximum=MAX_HBM_GIB, why="1 PiB"),
        default=None,
        help="GiB of HBM kept for weights, activations and workspace; KV gets the rest "
        f"(default 93; env {env('reserved_gib')})",
    )
    budget.add_argument(
        _flag("kv_budget_fraction"),
        type=_float_arg(),
        default=None,
        help="instead of --reserved-gib: the fraction of HBM given to the KV cache "
        f"(default none: --reserved-gib decides; env {env('kv_budget_fraction')})",
    )
    p.add_argument(
        _flag("contexts"),
        type=_ascii_text,
        default=None,
        help="request lengths, comma separated (K = 1024, M = 1024^2) "
        f"(default 8192,131072,1048576; env {env('contexts')})",
    )
    p.add_argument(
        _flag("kv_dtype"),
        type=_choice_arg(KV_DTYPES, "kv dtype"),
        default=None,
        help=f"{' | '.join(KV_DTYPES)} (default fp8; env {env('kv_dtype')})",
    )
    p.add_argument(
        _flag("page_size"),
        type=_int_arg(1),
        default=None,
        help=f"tokens per KV page (default 64; env {env('page_size')})",
    )
    p.add_argument(
        _flag("split_mode"),
        type=_choice_arg(SPLIT_MODES, "split mode"),
        default=None,
        help="in-seq | round-robin (KV sharded at interleave 1; its levels skip 4 and 5) "
        f"(default in-seq; env {env('split_mode')})",
    )
    p.add_argument(
        _flag("index_topk_pattern"),
        type=_pattern_arg,
        default=None,
        help="IndexShare: F / S per layer of the preset "
        f"(default the preset's; glm-5.2 shares; env {env('index_topk_pattern')})",
    )
    p.add_argument(
        _flag("rates"),
        action="append",
        default=None,
        metavar="FILE.json",
        help="override rates: a compute_bench.json, a kernels_bench.json or {field: value}; repeatable "
        f"(default: the stored results in docs/results/ where present; env {env('rates')}, one file)",
    )
    p.add_argument(
        _flag("interconnect_gbps"),
        type=_interconnect_arg,
        default=None,
        help="all-gather bandwidth per GPU per direction, GB/s, at least "
        f"{MIN_INTERCONNECT_GBPS:g} (default 450: NVLink 4; env {env('interconnect_gbps')})",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON (default: the table)")


def _plain(text: str) -> str:
    """reST markup dropped, for ``--help``: ``x`` and :role:`~a.b` become x and b."""
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def _invoked_as() -> str:
    """The command as the user typed it: ``python -m reference_impl`` or the console script's name (``dsa-cp``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name == "reference_impl.__main__":
        return "python -m reference_impl"
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and not name.endswith(".py") and name != "-c" else "dsa-cp"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog or _invoked_as(),
        description="Context-parallel prefill of DSA models: one run, a "
        "prefill -> decode transfer, the demo, a split, the capacity planner.",
        epilog=_plain(" ".join(__doc__.split("\n\n")[1].split())),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_run_flags(sub.add_parser("run", help="one CP prefill, compared with the oracle"))
    pd = sub.add_parser(
        "pd",
        help="prefill on C ranks, transfer the KV to a decode process (gloo; --device cuda: rows "
        "staged on a side stream)",
    )
    _add_run_flags(
        pd,
        phases="2",
        device="auto: the CPU; --device cuda for the GPUs",
        backend="auto: gloo, which the prefill ranks and the decode talk over",
    )
    pd.add_argument(
        "--transfer",
        default="rows",
        choices=["rows", "pages"],
        help="rows: the decode allocates its own pages; pages: it mirrors the prefill's page ids (default rows)",
    )
    pd.add_argument(
        _flag("transport"),
        default=None,
        help="torch: gloo point-to-point; mooncake: one-sided writes into the decode's registered pool "
        "through the Mooncake Transfer Engine, rows only "
        f"(default torch; env {knob_names('transport')[2]})",
    )
    demo = sub.add_parser("demo", help="the main job: every phase level, what each buys (memory, time), one folder")
    demo.add_argument(
        "--device",
        type=_choice_arg(DEVICES, "device"),
        default=None,
        help=f"{' | '.join(DEVICES)} (default auto; env DSACP_DEVICE)",
    )
    demo.add_argument("--out", default=None, help="results folder (default results/demo-<device>-<time>)")
    demo.add_argument("--json", action="store_true", help="print the JSON instead of the table (default: the table)")
    sp = sub.add_parser("split", help="show how a batch is split over CP ranks")
    sp.add_argument(
        "--split-mode",
        "--mode",
        dest="split_mode",
        type=_choice_arg(SPLIT_MODES, "split mode"),
        default="in-seq",
        help=f"{' | '.join(SPLIT_MODES)} (default in-seq)",
    )
    sp.add_argument(
        "--cp-size", "--cp", dest="cp_size", type=_int_arg(1), required=True, help="CP ranks C (required: no default)"
    )
    sp.add_argument(
        "--extend", type=_ascii_text, required=True, help="extend lengths, comma separated (required: no default)"
    )
    sp.add_argument(
        "--prefix", type=_ascii_text, default=None, help="prefix lengths, comma separated (default 0 for each request)"
    )
    sp.add_argument(
        "--page-size", type=_int_arg(1), default=64, help="tokens per KV page, a power of two 4..4096 (default 64)"
    )
    sp.add_argument(
        "--page-aligned", action="store_true", help="phase 4: blocks on absolute page boundaries (default off)"
    )
    sp.add_argument("--json", action="store_true", help="print the split as JSON (default: text)")
    _add_plan_flags(sub.add_parser("plan", help="capacity planner: KV per rank, max context, per-layer time per level"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args: argparse.Namespace | None = None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:  # a bare ``python -m reference_impl`` (or ``dsa-cp``): what it can do
        print(parser.format_help(), file=sys.stderr, end="")
        return EXIT_BAD_INPUT
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            hint = (
                " (the demo runs every level; --phases is a flag of `run`)"
                if args.command == "demo" and any(u.startswith("--phases") for u in unknown)
                else ""
            )
            raise ConfigError(f"{args.command}: unrecognized arguments: {' '.join(unknown)}{hint}")
        check_environment()  # every DSACP_* the library reads, whichever command runs
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
        )
        command = {"run": _cmd_run, "pd": _cmd_pd, "demo": _cmd_demo, "split": _cmd_split, "plan": _cmd_plan}[
            args.command
        ]
        return command(args)
    except ConfigError as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RankFailedError as exc:
        line = str(exc).splitlines()[0]
        if getattr(args, "debug", False) and exc.remote_traceback:
            print(f"error: {line}", file=sys.stderr)
            print(f"traceback from rank {exc.rank}:\n{exc.remote_traceback}", file=sys.stderr, end="")
        else:
            print(f"error: {line}{_traceback_note(exc)}", file=sys.stderr)
        return EXIT_RANK_FAILED
    except (RunStopped, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, RunStopped) else signal.SIGINT
        print(f"error: stopped by {signal.Signals(signum).name}; every rank was stopped", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # the reader went away (``... | head``): stop quietly
        _drop_stdout()
        return EXIT_OK
    except _OutputError as exc:  # a full disk: say so, and never exit 1 (which says "disagrees with the oracle")
        _drop_stdout()
        print(f"error: cannot write the output to stdout: {exc}", file=sys.stderr)
        return EXIT_NO_OUTPUT


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that what it still buffers is not written (and fails) again at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _traceback_note(exc: RankFailedError) -> str:
    """Where the failed rank's traceback went (a log file), for the one error line; ``--debug`` prints it instead."""
    if not exc.remote_traceback:
        return ""
    try:
        fd, path = tempfile.mkstemp(prefix=f"dsacp-rank{exc.rank}-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            log.write(f"{exc}\n\ntraceback from rank {exc.rank}:\n{exc.remote_traceback}")
    except OSError:
        return " (--debug prints the rank's traceback)"
    return f" (the rank's traceback: {path})"


class _ProgressBar:
    """The library's progress hook (:data:`~reference_impl.runner.Progress`) drawn as a tqdm bar on
    stderr, where stderr is a terminal (``enabled`` overrides); one bar per stage."""

    def __init__(self, enabled: bool | None = None, file: Any = None) -> None:
        self.file = file if file is not None else sys.stderr
        self.enabled = enabled if enabled is not None else self.file.isatty()
        self.bar: Any = None
        self.stage = ""

    def __enter__(self) -> _ProgressBar:
        return self

    def update(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if stage != self.stage:
            from tqdm import tqdm

            self.close()
            self.stage = stage
            desc = {"ranks": "ranks (model, then layers)", "oracle": "oracle (one device)"}.get(stage, stage)
            self.bar = tqdm(total=total, desc=desc, file=self.file, leave=False, unit="step")
        self.bar.total = total
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())

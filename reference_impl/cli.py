"""Command line: ``python -m reference_impl {run,split,demo,plan} ...``.

Every run flag is a :class:`~reference_impl.config.RunConfig` field: ``--cp-size`` is the field
``cp_size`` and the environment variable ``DSACP_CP_SIZE`` (an environment variable sets the
default; a flag overrides it). Bad input prints one line naming the problem and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from reference_impl.config import (
    ConfigError,
    PhaseSet,
    RunConfig,
    available_levels,
    env_flag,
    knob_names,
    parse_requests,
)

EXIT_BAD_INPUT = 2
EXIT_DISAGREES = 1


def _env_default(field: str, fallback: Any) -> Any:
    value = os.environ.get(knob_names(field)[2])
    return fallback if value is None else value


def _flag(field: str) -> str:
    return knob_names(field)[1]


def _add_run_flags(p: argparse.ArgumentParser, defaults: RunConfig) -> None:
    p.add_argument(_flag("preset"), default=_env_default("preset", None), help="deepseek-v3.2 | glm-5 | tiny")
    p.add_argument(_flag("cp_size"), type=int, default=_env_default("cp_size", None), help="CP ranks C")
    p.add_argument(
        _flag("requests"), default=_env_default("requests", None),
        help="comma-separated PREFIX+EXTEND pairs (or EXTEND), e.g. 0+96,40+70",
    )
    p.add_argument(_flag("kv_dtype"), default=_env_default("kv_dtype", defaults.kv_dtype), help="fp8 | bf16")
    p.add_argument(
        _flag("phases"), default=_env_default("phases", None),
        help="a cumulative level 0..8 (e.g. 1) or an explicit list (e.g. 1,2)",
    )
    p.add_argument(_flag("split_mode"), default=_env_default("split_mode", defaults.split_mode), help="in-seq | round-robin")
    p.add_argument(_flag("page_size"), type=int, default=_env_default("page_size", defaults.page_size))
    p.add_argument(_flag("n_layers"), type=int, default=_env_default("n_layers", None), help="default: the preset's")
    p.add_argument(_flag("chunk_size"), type=int, default=_env_default("chunk_size", None),
                   help="chunked prefill: extend tokens per request per chunk (default: one chunk)")
    p.add_argument(_flag("seed"), type=int, default=_env_default("seed", defaults.seed))
    p.add_argument(_flag("device"), default=_env_default("device", defaults.device), help="auto | cpu | cuda")
    p.add_argument(_flag("backend"), default=_env_default("backend", defaults.backend), help="auto | gloo | nccl")
    p.add_argument(_flag("compute_dtype"), default=_env_default("compute_dtype", defaults.compute_dtype))
    boolean = argparse.BooleanOptionalAction
    p.add_argument(_flag("debug"), action=boolean, default=env_flag("debug"), help="syncing diagnostics, collective recorder")
    p.add_argument(_flag("check"), action=boolean, default=env_flag("check", True), help="compare with the oracle")
    p.add_argument(_flag("input_logprobs"), action=boolean, default=env_flag("input_logprobs"),
                   help="needs every row: full tail gather")
    p.add_argument(_flag("return_hidden_states"), action=boolean, default=env_flag("return_hidden_states"),
                   help="needs every row: full tail gather")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")


def _run_config(args: argparse.Namespace, preset: str, cp_size: int, requests: str, phases: str) -> RunConfig:
    return RunConfig(
        preset=args.preset or preset,
        cp_size=args.cp_size if args.cp_size is not None else cp_size,
        requests=tuple(parse_requests(args.requests or requests)),
        kv_dtype=args.kv_dtype,
        split_mode=args.split_mode,
        phases=PhaseSet.parse(str(args.phases if args.phases is not None else phases)),
        page_size=int(args.page_size),
        n_layers=int(args.n_layers) if args.n_layers is not None else None,
        chunk_size=int(args.chunk_size) if args.chunk_size is not None else None,
        seed=int(args.seed),
        debug=bool(args.debug),
        device=args.device,
        backend=args.backend,
        compute_dtype=args.compute_dtype,
        check=args.check,
        input_logprobs=args.input_logprobs,
        return_hidden_states=args.return_hidden_states,
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from reference_impl.tables import format_table
    from reference_impl.runner import run_prefill

    run = _run_config(args, "tiny", 2, "0+96,40+70", "0")
    report = run_prefill(run)
    print(json.dumps(report, indent=2) if args.json else format_table([report]))
    return EXIT_DISAGREES if report["matches_oracle"] is False else 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """The main job: every available phase level on this machine's device, one table."""
    import torch

    from reference_impl.tables import format_table
    from reference_impl.runner import run_prefill

    cuda = torch.cuda.is_available() and args.device != "cpu"
    preset = "deepseek-v3.2" if cuda else "tiny"
    cp_size = max(2, torch.cuda.device_count()) if cuda else 4
    requests = "0+2048,1024+1024" if cuda else "0+96,40+70,0+37"
    base = _run_config(args, preset, cp_size, requests, "0")
    if base.n_layers is None:
        base = base.replace(n_layers=2)
    reports = [run_prefill(base.replace(phases=PhaseSet.level(level))) for level in available_levels()]
    if args.json:
        print(json.dumps(reports, indent=2))
    else:
        print(format_table(reports))
        print(_level_summary(reports))
        print("layer ms: one run per level, median over its layers, no warm-up: a level whose kernels run for the first "
              "time in the process includes their compilation. Per-layer timings: python -m reference_impl.bench.layer")
    return EXIT_DISAGREES if any(r["matches_oracle"] is False for r in reports) else 0


def _level_summary(reports: list[dict[str, Any]]) -> str:
    lines = ["summary (rank 0): level | matches | KV at rest | tail-gather bytes | layer ms"]
    for rep in reports:
        r0 = rep["per_rank"][0]
        lines.append(
            f"  {rep['phase_level']} | {rep['matches_oracle']} | {r0['kv_bytes'] + r0['index_bytes']:,} B"
            f" | {r0['output_gather_bytes']:,} B | {r0['layer_ms_median']:.2f}"
        )
    return "\n".join(lines)


def _cmd_split(args: argparse.Namespace) -> int:
    from reference_impl.cp.split import build_split

    extend = [int(x) for x in _int_list(args.extend, "--extend")]
    prefix = [int(x) for x in _int_list(args.prefix, "--prefix")] if args.prefix else [0] * len(extend)
    if len(prefix) != len(extend):
        raise ConfigError(f"--prefix has {len(prefix)} values but --extend has {len(extend)}")
    meta = build_split(args.split_mode, args.cp_size, extend, prefix, page_size=args.page_size)
    doc = meta.to_json()
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"{meta.mode} split, C={meta.cp_size}, requests (prefix+extend): "
          + ", ".join(f"{p}+{e}" for p, e in zip(prefix, extend)))
    for rank in doc["ranks"]:
        print(f"  rank {rank['rank']} ({rank['length']} tokens): {rank['tokens']}")
    print(f"  rerange index: {doc['rerange_index']}")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"malformed {flag} {text!r}: use comma-separated integers") from None


def _cmd_plan(args: argparse.Namespace) -> int:
    """Capacity planner: predictions per phase level (:mod:`reference_impl.planner`); nothing runs."""
    from reference_impl.planner import PlannerConfig, format_plan, load_rates, parse_contexts, plan_capacity

    config = PlannerConfig(
        preset=args.preset,
        cp_size=int(args.cp_size),
        hbm_gib=float(args.hbm_gib),
        reserved_gib=None if args.reserved_gib is None else float(args.reserved_gib),
        kv_budget_fraction=None if args.kv_budget_fraction is None else float(args.kv_budget_fraction),
        contexts=parse_contexts(str(args.contexts)),
        kv_dtype=args.kv_dtype,
        page_size=int(args.page_size),
    )
    rates = load_rates(args.rates)
    if args.interconnect_gbps is not None:
        rates = rates.override({"interconnect_gbps": args.interconnect_gbps}, "--interconnect-gbps")
    plan = plan_capacity(config, rates)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(_flag("preset"), default=_env_default("preset", "deepseek-v3.2"), help="deepseek-v3.2 | glm-5 | tiny")
    p.add_argument(_flag("cp_size"), "--cp", dest="cp_size", type=int, default=_env_default("cp_size", 8), help="CP ranks C")
    p.add_argument(_flag("hbm_gib"), type=float, default=_env_default("hbm_gib", 141.0), help="HBM per GPU, GiB")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        _flag("reserved_gib"), type=float, default=_env_default("reserved_gib", None),
        help="GiB of HBM kept for weights, activations and workspace; KV gets the rest (default 93)",
    )
    budget.add_argument(
        _flag("kv_budget_fraction"), type=float, default=_env_default("kv_budget_fraction", None),
        help="instead of --reserved-gib: the fraction of HBM given to the KV cache",
    )
    p.add_argument(_flag("contexts"), default=_env_default("contexts", "8192,131072,1048576"),
                   help="request lengths, comma separated (K = 1024, M = 1024^2 allowed)")
    p.add_argument(_flag("kv_dtype"), default=_env_default("kv_dtype", "fp8"), help="fp8 | bf16")
    p.add_argument(_flag("page_size"), type=int, default=_env_default("page_size", 64))
    env_rates = _env_default("rates", None)
    p.add_argument(_flag("rates"), action="append", default=[env_rates] if env_rates else None, metavar="FILE.json",
                   help="override rates: a compute_bench.json, a kernels_bench.json or {field: value}; repeatable")
    p.add_argument(_flag("interconnect_gbps"), type=float, default=_env_default("interconnect_gbps", None),
                   help="all-gather bandwidth per GPU per direction, GB/s (assumed default 450: NVLink 4)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m reference_impl", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = RunConfig()
    _add_run_flags(sub.add_parser("run", help="one CP prefill, compared with the oracle"), defaults)
    _add_run_flags(sub.add_parser("demo", help="the main job: every available phase level"), defaults)
    sp = sub.add_parser("split", help="show how a batch is split over CP ranks")
    sp.add_argument("--split-mode", "--mode", dest="split_mode", default="in-seq", help="in-seq | round-robin")
    sp.add_argument("--cp-size", "--cp", dest="cp_size", type=int, required=True)
    sp.add_argument("--extend", required=True, help="extend lengths, comma separated")
    sp.add_argument("--prefix", default="", help="prefix lengths, comma separated (default 0)")
    sp.add_argument("--page-size", type=int, default=64)
    sp.add_argument("--json", action="store_true")
    _add_plan_flags(sub.add_parser("plan", help="capacity planner: KV per rank, max context, per-layer time per level"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"run": _cmd_run, "demo": _cmd_demo, "split": _cmd_split, "plan": _cmd_plan}[args.command](args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())

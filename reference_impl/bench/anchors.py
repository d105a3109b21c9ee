"""Anchors: FlashMLA's sparse prefill and DeepGEMM's indexer logits timed beside this site's kernels.

Usage::

    python -m reference_impl.bench.anchors --out docs/results/anchors_h200.json
        [--cases v32-attention,v4-attention,logits-128k,logits-1m] [--repeats 6] [--seed 0]
    python -m reference_impl.bench.anchors --out dry.json --dry-run     # CPU: tiny shapes, the plumbing

**The anchors**, imported when installed (as ``flash_mla`` and ``deep_gemm``), at
the revisions :data:`PINS` names: FlashMLA at ``ba89a34``, the last revision with Hopper (SM90) and
DeepSeek-V3.2 (FlashMLA's 2026-09-30 release removed both and changed the FP8 cache format), and
DeepGEMM at ``54e2261``. Their Python signatures (DeepGEMM's read at the pin; FlashMLA's at
``9241ae3``, 2026-04-29, the newest Hopper-era revision that could be read here, not at the pin
itself: check it there when building)::

    flash_mla.flash_mla_sparse_fwd(
        q: Tensor,                 # [s_q, h_q, d_qk] bf16; h_q in {64, 128}, d_qk in {576, 512}
        kv: Tensor,                # [s_kv, h_kv, d_qk] bf16, h_kv = 1
        indices: Tensor,           # [s_q, h_kv, topk] int32; -1 (or >= s_kv) unused; topk % 128 == 0 on SM90
        sm_scale: float,
        d_v: int = 512,            # only 512
        attn_sink: Tensor | None = None,    # [h_q] f32: out *= exp(lse) / (exp(lse) + exp(sink))
        topk_length: Tensor | None = None,  # [s_q] int32: only the first topk_length[i] indices
    ) -> tuple[Tensor, Tensor, Tensor]  # out [s_q, h_q, d_v] bf16, max_logits [s_q, h_q] f32,
                                        # lse [s_q, h_q] f32 (natural log; +inf for a row with no index)

    deep_gemm.fp8_mqa_logits(      # a legacy wrapper of fp8_fp4_mqa_logits(..., logits_dtype=float32)
        q: Tensor,                 # [T, Hi, D] float8_e4m3fn; 128 % Hi == 0
        kv: tuple[Tensor, Tensor], # (k [S, D] float8_e4m3fn, sf [S] f32), both contiguous
        weights: Tensor,           # [T, Hi] f32 (SM90)
        cu_seq_len_k_start: Tensor,  # [T] int32
        cu_seq_len_k_end: Tensor,    # [T] int32
        clean_logits: bool = True,   # -inf outside [start, end)
        max_seqlen_k: int = 0,       # 0: logits [T, S], column j = key j
    ) -> Tensor                      # [T, S] f32 = sum_h relu(q[t, h] . k[s]) * weights[t, h] * sf[s]

    deep_gemm.fp8_paged_mqa_logits(q [B, next_n, Hi, D], kv_cache [blocks, 64, 1, D + 4], weights,
        context_lens [B, next_n] int32, block_table, schedule_meta, max_context_len, clean_logits=False,
        indices=None) -> [B * next_n, max_context_len] f32   # decode: next_n queries per request

**The cases** (:func:`cases`), each at the shape one rank of ``C = 8`` runs (rank 0's zigzag queries):

* ``v32-attention``: DeepSeek-V3.2 sparse MLA, ``T = 16,384`` queries of a 131,072-token request,
  ``S = 131,072`` keys, top-k 2,048, 128 heads, ``d_qk = 576``, ``d_v = 512``. Ours: the dispatch
  (:func:`reference_impl.kernels.dispatch.sparse_mla_attention`, bf16 output), theirs:
  ``flash_mla_sparse_fwd`` with the ``h_kv = 1`` axis added.
* ``v4-attention``: DeepSeek-V4-Flash CSA attention, 64 heads, ``d = 512`` (K = V), top-k 512 over
  the 32,768 4-token compressed entries of the same request, with the per-head attention sink.
  Ours: :func:`reference_impl.families.deepseek_v4.kernels.dispatch.sparse_attention` (fp32 output),
  theirs: ``flash_mla_sparse_fwd(..., attn_sink=sinks)``.
* ``logits-128k`` and ``logits-1m``: the lightning indexer's logits (64 heads, ``D = 128``, FP8),
  over 131,072 keys, and for the last 131,072-token chunk of a 1,048,576-token request over all
  1,048,576 keys. Ours: :func:`reference_impl.kernels.indexer_triton.indexer_logits_pass` (the
  logits the engine's top-k computes, tile for tile, without the selection); theirs:
  ``fp8_mqa_logits``, called on row slices whose ``[rows, S]`` fp32 output stays under
  ``--logits-budget-gib`` (as an engine budgets it). ``fp8_paged_mqa_logits`` is the decode
  kernel (``next_n`` queries per request): it does not take these prefill shapes, and is not timed.

**Checks** before timing, on ``--check-rows`` rows (first, random, last): ours against theirs, within
:data:`TOLERANCES`. **Timing** (:mod:`reference_impl.bench.paired`): after one warm-up call each,
``--repeats`` rounds, the two implementations interleaved in an order rotated per round; per call
the median of ``triton.testing.do_bench`` (3 CUDA-event-timed calls above ``--slow-ms``). Per case:
each side's median and min-max over the rounds, TFLOPS from an independent FLOP count (attention:
``2 x T x topk x H x (d_qk + d_v)``, every slot, FlashMLA's own count; logits:
``2 x Hi x D x`` the visible keys summed over queries), the paired ratio ours / theirs and the
verdict of :data:`reference_impl.bench.paired.RULE`. An anchor that does not import is recorded
with the reason (the ``ImportError`` text, or ``not built``) and the case carries the published
figure (``docs/results/published_figures.json``), marked published.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from reference_impl.bench import paired
from reference_impl.bench.record import run_record
from reference_impl.config import ConfigError
from reference_impl.tool_args import MAX_REPEATS, ToolParser, float_arg, int_arg, output_file, refusing, require_cuda

PROG = "python -m reference_impl.bench.anchors"
PINS: dict[str, dict[str, str]] = {
    "flash_mla": {
        "repo": "https://github.com/deepseek-ai/FlashMLA",
        "commit": "ba89a3466e9470ad08ab39738d4e7bb66989e1e7",
        "why": "the last revision with SM90 and DeepSeek-V3.2 (its 2026-09-30 release names it)",
    },
    "deep_gemm": {
        "repo": "https://github.com/deepseek-ai/DeepGEMM",
        "commit": "54e22612409371d6364144b69086735beb54e98b",
        "why": "the revision whose attention API this page documents (fp8_mqa_logits kept as a legacy wrapper)",
    },
}
ANCHOR_FUNCTIONS = {"flash_mla": ("flash_mla_sparse_fwd",), "deep_gemm": ("fp8_mqa_logits",)}
TOLERANCES = {
    "attention_out_rel_err": 1e-2,  # Frobenius norm of the difference over that of theirs (both round to bf16)
    "attention_lse_max_abs_err": 1e-2,  # natural log, rows with a valid index
    "logits_rel_err": 1e-3,  # over the visible entries; every other entry -inf on both sides
}
PUBLISHED = Path(__file__).resolve().parents[2] / "docs" / "results" / "published_figures.json"
PUBLISHED_FOR = {"v32-attention": "flashmla_sparse_prefill_h800"}
CASE_NAMES = ("v32-attention", "v4-attention", "logits-128k", "logits-1m")


@dataclass(frozen=True)
class Case:
    """One shape: ``kind`` ``"attention"`` or ``"logits"``; the queries are rank 0's of ``cp_size``
    over a chunk of ``chunk`` tokens that starts at ``start`` (the request is ``start + chunk`` long)."""

    name: str
    kind: str
    what: str
    start: int
    chunk: int
    cp_size: int
    heads: int
    d_qk: int
    d_v: int
    topk: int
    compress: int = 1  # keys per position: 4 for V4's CSA entries
    sink: bool = False


def cases(dry_run: bool) -> dict[str, Case]:
    """The benchmarked shapes, or tiny ones of the same kinds for ``--dry-run``."""
    if dry_run:
        return {
            "v32-attention": Case("v32-attention", "attention", "V3.2 sparse MLA (tiny)", 0, 256, 2, 4, 576, 512, 128),
            "v4-attention": Case(
                "v4-attention", "attention", "V4 CSA + sink (tiny)", 0, 256, 2, 4, 512, 512, 32, 4, True
            ),
            "logits-128k": Case("logits-128k", "logits", "indexer logits (tiny)", 0, 256, 2, 4, 32, 0, 16),
            "logits-1m": Case("logits-1m", "logits", "indexer logits, last chunk (tiny)", 256, 256, 2, 4, 32, 0, 16),
        }
    k128, m1 = 131072, 1048576
    return {
        "v32-attention": Case(
            "v32-attention",
            "attention",
            "DeepSeek-V3.2 sparse MLA, rank 0 of C=8 at 128K",
            0,
            k128,
            8,
            128,
            576,
            512,
            2048,
        ),
        "v4-attention": Case(
            "v4-attention",
            "attention",
            "DeepSeek-V4-Flash CSA attention with the sink, rank 0 of C=8 at 128K",
            0,
            k128,
            8,
            64,
            512,
            512,
            512,
            4,
            True,
        ),
        "logits-128k": Case(
            "logits-128k", "logits", "indexer logits, rank 0 of C=8 at 128K", 0, k128, 8, 64, 128, 0, 2048
        ),
        "logits-1m": Case(
            "logits-1m",
            "logits",
            "indexer logits, rank 0 of C=8, last 128K chunk of 1M",
            m1 - k128,
            k128,
            8,
            64,
            128,
            0,
            2048,
        ),
    }


def positions_of(case: Case) -> torch.Tensor:
    """Rank 0's query positions: zigzag blocks 0 and ``2C - 1`` of the chunk, offset by its start."""
    from reference_impl.bench.compute_cases import zigzag_rank0_positions

    return zigzag_rank0_positions(case.chunk, case.cp_size) + case.start


# ---- the anchors ------------------------------------------------------------------------------


def find_spec(module: str) -> Any:
    """Whether ``module`` is installed: its import spec, or ``None`` (a seam for the tests)."""
    if sys.modules.get(module, False) is None:  # blocked in this process
        return None
    return importlib.util.find_spec(module)


def load_anchor(module: str) -> tuple[Any, dict[str, Any]]:
    """``(module or None, record)``: the record says whether it imported, its version and file, or why not."""
    record: dict[str, Any] = {"module": module, "pin": PINS[module], "functions": list(ANCHOR_FUNCTIONS[module])}
    try:
        spec = find_spec(module)
    except (ImportError, ValueError) as exc:
        spec, record["why"] = None, f"{type(exc).__name__}: {exc}"
    if spec is None:
        record.setdefault("why", f"not built: no module named {module!r} is installed")
        record["available"] = False
        return None, record
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # an extension built for another torch or CUDA raises more than ImportError
        record.update(available=False, why=f"{type(exc).__name__}: {exc}"[:500])
        return None, record
    missing = [name for name in ANCHOR_FUNCTIONS[module] if not hasattr(mod, name)]
    if missing:
        record.update(available=False, why=f"{module} has no {', '.join(missing)} (another revision than the pin?)")
        return None, record
    record.update(available=True, version=getattr(mod, "__version__", None), file=getattr(mod, "__file__", None))
    return mod, record


# ---- inputs and the two sides ------------------------------------------------------------------


def attention_inputs(case: Case, gen: torch.Generator, device: torch.device) -> dict[str, Any]:
    """q [T, H, d_qk], kv [S, d_qk] bf16, indices [T, topk] int32 drawn from each query's visible keys
    (``-1`` past them), the sinks [H] f32 when the case has them, the softmax scale."""
    pos = positions_of(case).to(device)
    n_keys = (case.start + case.chunk) // case.compress
    visible = (pos + 1) // case.compress
    q = torch.randn(pos.numel(), case.heads, case.d_qk, generator=gen, device=device).to(torch.bfloat16)
    kv = torch.randn(n_keys, case.d_qk, generator=gen, device=device).to(torch.bfloat16)
    draw = torch.rand(pos.numel(), case.topk, generator=gen, device=device)
    idx = torch.minimum((draw * visible[:, None]).long(), (visible - 1).clamp(min=0)[:, None])
    slot = torch.arange(case.topk, device=device)
    indices = torch.where(slot[None, :] < visible[:, None], idx, -1).to(torch.int32)
    sinks = torch.randn(case.heads, generator=gen, device=device) if case.sink else None
    scale = (192 if case.d_qk == 576 else case.d_qk) ** -0.5
    return {"q": q, "kv": kv, "indices": indices, "sinks": sinks, "scale": scale}


def logits_inputs(case: Case, gen: torch.Generator, device: torch.device) -> dict[str, Any]:
    """q_fp8 [T, Hi, D], weights [T, Hi] f32, k_fp8 [S, D], k_scale [S] f32, key_start / key_end [T]."""
    pos = positions_of(case).to(device)
    n_q, n_keys = pos.numel(), case.start + case.chunk
    q = (torch.randn(n_q, case.heads, case.d_qk, generator=gen, device=device) * 64).to(torch.float8_e4m3fn)
    weights = torch.randn(n_q, case.heads, generator=gen, device=device) * (case.heads * case.d_qk) ** -0.5 / 64
    k = (torch.randn(n_keys, case.d_qk, generator=gen, device=device) * 64).to(torch.float8_e4m3fn)
    k_scale = torch.rand(n_keys, generator=gen, device=device) / 64 + 1 / 256
    key_start = torch.zeros(n_q, dtype=torch.int64, device=device)
    key_end = pos + 1
    return {"q": q, "weights": weights, "k": k, "k_scale": k_scale, "key_start": key_start, "key_end": key_end}


def attention_sides(case: Case, x: dict[str, Any], flash_mla: Any) -> dict[str, Callable[[Any], Any]]:
    """``{"ours": f, "theirs": f}``, each ``f(rows)`` -> ``(out, lse or None)`` over those query rows
    (``rows=None``: all of them, the timed call)."""

    def pick(rows: Any, t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t[rows]

    def ours(rows: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, ix = pick(rows, x["q"]), pick(rows, x["indices"])
        if case.sink:
            from reference_impl.families.deepseek_v4.kernels import dispatch as v4

            return v4.sparse_attention(q, x["kv"], ix, x["sinks"], x["scale"]), None
        from reference_impl.kernels import dispatch

        return dispatch.sparse_mla_attention(q, x["kv"], ix, x["scale"], case.d_v, out_dtype=torch.bfloat16)

    sides: dict[str, Callable[[Any], Any]] = {"ours": ours}
    if flash_mla is not None:
        kv3 = x["kv"].unsqueeze(1)

        def theirs(rows: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            q, ix = pick(rows, x["q"]), pick(rows, x["indices"]).unsqueeze(1)
            out, _max_logits, lse = flash_mla.flash_mla_sparse_fwd(
                q, kv3, ix, x["scale"], case.d_v, attn_sink=x["sinks"]
            )
            return out, (None if case.sink else lse)

        sides["theirs"] = theirs
    return sides


def logits_sides(
    case: Case, x: dict[str, Any], deep_gemm: Any, budget_bytes: int
) -> tuple[dict[str, Callable[[Any], Any]], int]:
    """``({"ours": f, "theirs": f}, theirs' rows per call)``: ``f(rows)`` -> logits ``[rows, S]`` f32
    for check rows; ``f(None)``: the timed pass over every row (its result not kept)."""
    from reference_impl.kernels.indexer_triton import indexer_logits_pass, indexer_logits_triton

    n_keys = int(x["k"].shape[0])
    full = (x["q"], x["weights"], x["k"], x["k_scale"], x["key_start"], x["key_end"])

    def ours(rows: Any) -> torch.Tensor | None:
        if rows is None:
            indexer_logits_pass(*full, topk=case.topk)
            return None
        q, w, k, k_scale, start, end = full
        return indexer_logits_triton(q[rows], w[rows], k, k_scale, start[rows], end[rows], 0, n_keys)

    sides: dict[str, Callable[[Any], Any]] = {"ours": ours}
    per_call = max(1, min(int(x["q"].shape[0]), budget_bytes // (4 * max(1, n_keys))))
    if deep_gemm is not None:
        start32, end32 = x["key_start"].to(torch.int32), x["key_end"].to(torch.int32)
        kv = (x["k"], x["k_scale"])

        def theirs(rows: Any) -> torch.Tensor | None:
            if rows is not None:
                return deep_gemm.fp8_mqa_logits(x["q"][rows], kv, x["weights"][rows], start32[rows], end32[rows], True)
            for r0 in range(0, int(x["q"].shape[0]), per_call):
                r = slice(r0, r0 + per_call)
                deep_gemm.fp8_mqa_logits(x["q"][r], kv, x["weights"][r], start32[r], end32[r], True)
            return None

        sides["theirs"] = theirs
    return sides, per_call


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def check_attention(out_a: Any, out_b: Any) -> dict[str, Any]:
    """Ours (``out_a``) against theirs (``out_b``): each ``(out, lse or None)``."""
    (oa, la), (ob, lb) = out_a, out_b
    check: dict[str, Any] = {"out_rel_err": _rel(oa, ob)}
    ok = check["out_rel_err"] < TOLERANCES["attention_out_rel_err"]
    if la is not None and lb is not None:
        fa, fb = torch.isfinite(la), torch.isfinite(lb)  # an empty row: -inf here, +inf in FlashMLA
        check["lse_rows_with_no_index_match"] = bool(torch.equal(fa, fb))
        both = fa & fb
        check["lse_max_abs_err"] = float((la[both] - lb[both]).abs().max()) if bool(both.any()) else 0.0
        ok = ok and check["lse_rows_with_no_index_match"]
        ok = ok and check["lse_max_abs_err"] < TOLERANCES["attention_lse_max_abs_err"]
    check["ok"] = bool(ok)
    return check


def check_logits(ours: torch.Tensor, theirs: torch.Tensor, visible: torch.Tensor) -> dict[str, Any]:
    """Ours against theirs over the visible entries; both ``-inf`` elsewhere."""
    check = {
        "logits_rel_err": _rel(ours[visible], theirs[visible]),
        "masked_all_neg_inf": bool(torch.isneginf(ours[~visible]).all() and torch.isneginf(theirs[~visible]).all()),
    }
    check["ok"] = check["logits_rel_err"] < TOLERANCES["logits_rel_err"] and check["masked_all_neg_inf"]
    return check


# ---- one case -----------------------------------------------------------------------------------


def flops_of(case: Case, x: dict[str, Any]) -> dict[str, float]:
    """Independent FLOP counts from the shapes (not from either kernel)."""
    if case.kind == "attention":
        n_q = int(x["q"].shape[0])
        valid = float((x["indices"] >= 0).sum())
        per_slot = 2.0 * case.heads * (case.d_qk + case.d_v)
        return {"flops": per_slot * n_q * case.topk, "flops_valid_slots": per_slot * valid}
    visible = float((x["key_end"] - x["key_start"]).sum())
    return {"flops": 2.0 * case.heads * case.d_qk * visible}


def published_figure(case: Case) -> dict[str, Any] | None:
    """The authors' published figure for this case's kernel, marked published (not measured here)."""
    fid = PUBLISHED_FOR.get(case.name)
    if fid is None or not PUBLISHED.exists():
        return None
    for fig in json.loads(PUBLISHED.read_text())["figures"]:
        if fig["id"] == fid:
            return {**fig, "marked": "published by the kernel's authors, not measured here"}
    return None


def run_case(
    case: Case, anchors: dict[str, Any], args: Any, gen: torch.Generator, device: torch.device
) -> dict[str, Any]:
    """Inputs (drawn with ``gen``, on ``device``), the check, the interleaved timing and the comparison of
    one case -> its JSON row."""
    from reference_impl.bench.compute_cases import _check_rows, _time

    anchor = "flash_mla" if case.kind == "attention" else "deep_gemm"
    row: dict[str, Any] = {"case": case.name, "what": case.what, "shape": asdict(case), "anchor": anchor}
    if case.kind == "attention":
        x = attention_inputs(case, gen, device)
        sides = attention_sides(case, x, anchors[anchor])
        row["shape"].update(T=int(x["q"].shape[0]), S=int(x["kv"].shape[0]))
        row["valid_slot_fraction"] = float((x["indices"] >= 0).float().mean())
    else:
        x = logits_inputs(case, gen, device)
        sides, per_call = logits_sides(case, x, anchors[anchor], int(args.logits_budget_gib * 2**30))
        row["shape"].update(T=int(x["q"].shape[0]), S=int(x["k"].shape[0]))
        if "theirs" in sides:
            row["theirs_rows_per_call"] = per_call
    row.update(flops_of(case, x))
    n_rows = int(x["q"].shape[0])
    rows = _check_rows(n_rows, min(args.check_rows, n_rows), torch.Generator().manual_seed(args.seed)).to(device)
    got: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for side, fn in sides.items():  # the check doubles as each side's first call (compilation)
        try:
            got[side] = fn(rows)
        except Exception as exc:  # recorded: an anchor built for another GPU raises here
            errors[side] = f"{type(exc).__name__}: {exc}"[:500]
    if "ours" in errors:
        row["error"] = errors["ours"]
        return row
    if "theirs" in errors:
        row["theirs_error"] = errors["theirs"]
    if "theirs" in got:
        if case.kind == "attention":
            row["check"] = check_attention(got["ours"], got["theirs"])
        else:
            cols = torch.arange(int(x["k"].shape[0]), device=device)
            visible = (cols >= x["key_start"][rows, None]) & (cols < x["key_end"][rows, None])
            row["check"] = check_logits(got["ours"], got["theirs"], visible)
    del got
    timed = {side: fn for side, fn in sides.items() if side not in errors}
    order = list(timed)
    samples: dict[str, list[float]] = {side: [] for side in order}
    timers: dict[str, str] = {}
    for round_order in paired.rotations(order, args.repeats):
        for side in round_order:
            ms, timers[side] = _time(functools.partial(timed[side], None), args.slow_ms)
            samples[side].append(ms)
    for side in order:
        s = paired.spread(samples[side])
        row[side] = {"ms": s["median"], "ms_rounds": samples[side], "spread": s, "timer": timers[side]}
        row[side]["tflops"] = row["flops"] / s["median"] / 1e9 if s["median"] > 0 else None
    if case.kind == "attention":
        from reference_impl.families.deepseek_v4.kernels.dispatch import attention_kernel_name
        from reference_impl.kernels.dispatch import sparse_mla_kernel

        row["ours"]["kernel"] = (
            attention_kernel_name(device) if case.sink else sparse_mla_kernel(x["q"], x["kv"], case.d_v)
        )
    else:
        row["ours"]["kernel"] = "indexer_logits_pass (Triton)"
    if "theirs" in row:
        row["theirs"]["kernel"] = ANCHOR_FUNCTIONS[anchor][0]
        row["comparison"] = paired.compare("ours", samples["ours"], "theirs", samples["theirs"])
    else:
        why = anchors["records"][anchor].get("why") or row.get("theirs_error")
        row["theirs"] = {"status": "not run", "why": why}
    published = published_figure(case)
    if published is not None:
        row["published"] = published
        if row["ours"]["tflops"]:
            row["published"]["ours_fraction"] = row["ours"]["tflops"] / published["published_tflops"]
    return row


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--cases", default=",".join(CASE_NAMES), help="comma separated, from " + ", ".join(CASE_NAMES))
    parser.add_argument(
        "--repeats", type=int_arg(1, MAX_REPEATS), default=6, help="interleaved rounds (the verdict needs 5 or more)"
    )
    parser.add_argument("--check-rows", type=int_arg(1), default=48, help="query rows checked ours against theirs")
    parser.add_argument("--slow-ms", type=float_arg(), default=250.0, help="above this, time with 3 event-timed runs")
    parser.add_argument(
        "--logits-budget-gib",
        type=float_arg(),
        default=8.0,
        help="DeepGEMM's [rows, S] fp32 logits per call: rows are sliced to stay under it",
    )
    parser.add_argument("--seed", type=int_arg(0, 2**31 - 1), default=0, help="inputs' random seed")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the plumbing, no numbers")
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = output_file(args.out)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CASE_NAMES]
    if not wanted or unknown or len(set(wanted)) < len(wanted):
        raise ConfigError(f"--cases {args.cases!r}: name each once, from {', '.join(CASE_NAMES)}")
    device_name = "cpu" if args.dry_run else "cuda"
    require_cuda(device_name)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels under the interpreter
    device = torch.device(device_name)
    records: dict[str, Any] = {}
    anchors: dict[str, Any] = {"records": records}
    for module in PINS:
        anchors[module], records[module] = load_anchor(module)
    doc: dict[str, Any] = {
        "kind": "dry-run" if args.dry_run else "measured",
        **run_record("anchors", argv, device_name),
        "cuda": torch.version.cuda,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "pins": PINS,
        "anchors": records,
        "tolerances": TOLERANCES,
        "repeats": args.repeats,
        "timing": (
            f"{args.repeats} rounds after a warm-up call each, ours and theirs interleaved in an order rotated "
            "per round; per call the median of triton.testing.do_bench (3 CUDA-event-timed calls above "
            f"{args.slow_ms:g} ms)"
            if not args.dry_run
            else "CPU dry run: one wall-clock call per round; the numbers mean nothing"
        ),
        "rule": paired.RULE,
        "flops": {
            "attention": "2 * T * topk * H * (d_qk + d_v), every slot (FlashMLA's count); "
            "flops_valid_slots: the valid slots only",
            "logits": "2 * Hi * D * sum over queries of visible keys",
        },
        "cases": [],
    }
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shapes = cases(args.dry_run)
    for name in wanted:
        print(f"{name}: {shapes[name].what}", file=sys.stderr, flush=True)
        try:
            row = run_case(shapes[name], anchors, args, gen, device)
        except torch.cuda.OutOfMemoryError as exc:  # recorded; the other cases still run
            row = {"case": name, "error": f"OutOfMemoryError: {exc}"[:500]}
        doc["cases"].append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out.write_text(json.dumps(doc, indent=1) + "\n")
    from reference_impl.kernels.fallback import fallbacks_taken

    doc["fallbacks_taken"] = fallbacks_taken()
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The planner's DeepSeek-V4 terms: KV per token per layer type, gather bytes, capacity, layer time.

Usage::

    python -m reference_impl.planner.v4 --out docs/results/v4_planner.json [--preset deepseek-v4-flash] [--cp-size 8]

Scenario (as :mod:`reference_impl.planner`): one request of ``S`` tokens prefilled in one chunk, the
in-seq split over ``C`` ranks, rank 0 (it holds the request's first and last blocks), FP8 layout.
Everything is arithmetic on :mod:`reference_impl.families.deepseek_v4.cache_layout` and
:mod:`reference_impl.families.deepseek_v4.cp`; nothing is measured.

**Bytes at rest per rank** (all layers):

* CSA: ``(584 + 68) / 4`` B per token per layer, replicated below level 2; from level 2 sharded by
  entry pages (16 entries per 64-token page), rank 0 holding ``ceil(pages / C)`` of them;
* HCA: ``584 / 128`` B per token per layer, replicated;
* every layer: the window tail, ``127 x 584`` B per request; CSA / HCA: the compressor state,
  ``(4 + S % 4) x 10,240`` B (CSA) and ``(S % 128) x 4,096`` B (HCA) per request, replicated.

**Received per layer per rank** (all-gathers, every slot padded to the largest sender):

* window halo: ``(C - 1) x 3 x 127 x 584`` B (each rank sends its two blocks' last 127 tokens;
  rank 0 also the request's window tail);
* compressor halo: ``(C - 1) x 3 x rows x width`` B, ``rows`` 7 x 10,240 B (CSA) or 127 x 4,096 B (HCA);
* entry all-gather: ``(C - 1) x max entries per rank x (584 + 68)`` (CSA) or ``x 584`` (HCA);
* level 2 only: the materialization of the CSA entries, ``(C - 1) x owned entries x 652`` B.

**Time per layer** = projections (GEMM FLOPs / bf16 TFLOPS) + indexer logits
(``2 x Hi x Di x visible entries`` / the V3.2 logits rate) + attention (``2 x T_local x keys x H x
(512 + 512)`` / the V3.2 sparse attention rate: an assumption until the V4 kernel is measured) +
wire (bytes above / interconnect GB/s). Not modeled: elementwise work, the store, top-k.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from reference_impl.config import MAX_HBM_GIB, MAX_PLAN_CP
from reference_impl.cp.capacity import kv_bytes_per_rank
from reference_impl.errors import ConfigError
from reference_impl.families.deepseek_v4.cache_layout import index_entry_bytes, main_entry_bytes
from reference_impl.families.deepseek_v4.config import V4_PRESETS, LayerType, V4ModelConfig
from reference_impl.families.deepseek_v4.model.compressor import state_start
from reference_impl.planner.model import (
    local_queries,
    ms_for_bytes,
    ms_for_flops,
    rank_ranges,
    slowest_rank,
    zigzag_blocks,
)
from reference_impl.planner.plan import MAX_CONTEXT
from reference_impl.planner.rates import PlannerRates, load_rates
from reference_impl.presets import get_preset
from reference_impl.tool_args import ToolParser, choice_arg, float_arg, int_arg, int_list, output_file, refusing

PROG = "python -m reference_impl.planner.v4"
GIB = 1 << 30
# contexts x levels x cp_size: the planner walks every rank of every point (V3.2's terms beside V4's),
# about 0.3 ms a rank; past this a plan takes minutes.
MAX_RANK_POINTS = 1 << 16
LAYER_KINDS: dict[LayerType, int] = {"sliding": 0, "csa": 4, "hca": 128}


def pool_row_bytes(cfg: V4ModelConfig, ratio: int) -> int:
    """Bytes of one token's float32 pre-pool rows: ``4 (D + Di) x 2 x 4`` (CSA), ``2 D x 4`` (HCA)."""
    if ratio == 4:
        return (4 * cfg.head_dim + 4 * cfg.index_head_dim) * 4
    return 2 * cfg.head_dim * 4 if ratio else 0


def bytes_per_token(cfg: V4ModelConfig, codec: str = "fp8") -> dict[str, float]:
    """KV at rest per token per layer of each type (what grows with the context)."""
    entry, key = main_entry_bytes(codec), index_entry_bytes(codec, cfg.index_head_dim)
    return {"sliding": 0.0, "csa": (entry + key) / 4, "hca": entry / 128}


def per_request_bytes(cfg: V4ModelConfig, tokens: int, codec: str = "fp8") -> dict[str, int]:
    """Replicated per request per layer: window tail and compressor state, by layer type."""
    window = min(tokens, cfg.window_size - 1) * main_entry_bytes(codec)
    out: dict[str, int] = {}
    for kind, m in LAYER_KINDS.items():
        state = (tokens - state_start(tokens, m)) * pool_row_bytes(cfg, m) if m else 0
        out[kind] = window + state
    return out


def kv_at_rest(
    cfg: V4ModelConfig, tokens: int, cp_size: int, sharded: bool, codec: str = "fp8", page_size: int = 64
) -> dict[str, int]:
    """Bytes at rest on rank 0, all layers, by part (``csa``, ``hca``, ``window_and_state``, ``total``)."""
    entry, key = main_entry_bytes(codec), index_entry_bytes(codec, cfg.index_head_dim)
    n_csa = tokens // 4
    per_page = page_size // 4
    pages = -(-n_csa // per_page)
    held = min(n_csa, -(-pages // cp_size) * per_page) if sharded else n_csa
    csa = cfg.count("csa") * held * (entry + key)
    hca = cfg.count("hca") * (tokens // 128) * entry
    small = per_request_bytes(cfg, tokens, codec)
    rest = sum(cfg.count(kind) * small[kind] for kind in LAYER_KINDS)
    return {"csa": csa, "hca": hca, "window_and_state": rest, "total": csa + hca + rest}


def gather_bytes(
    cfg: V4ModelConfig, tokens: int, cp_size: int, level: int, ratio: int, codec: str = "fp8", page_size: int = 64
) -> dict[str, int]:
    """Bytes rank 0 receives per layer of compress ``ratio`` (see the module docstring)."""
    c, entry, key = cp_size, main_entry_bytes(codec), index_entry_bytes(codec, cfg.index_head_dim)
    out = {"window_halo": (c - 1) * 3 * min(cfg.window_size - 1, tokens) * entry}
    if ratio:
        rows = 2 * ratio - 1 if ratio == 4 else ratio - 1
        out["compressor_halo"] = (c - 1) * 3 * rows * pool_row_bytes(cfg, ratio)
        blocks = zigzag_blocks(tokens, c, page_size, page_aligned=level >= 4)
        most = max(sum(b - a for a, b in rank_ranges(blocks, r)) for r in range(c)) // ratio + 2
        out["entries"] = (c - 1) * most * (entry + (key if ratio == 4 else 0))
        if ratio == 4 and level == 2:
            pages = -(-(tokens // 4) // (page_size // 4))
            out["materialize"] = (c - 1) * -(-pages // c) * (page_size // 4) * (entry + key)
    return out


def _visible_entries(ranges: tuple[tuple[int, int], ...], ratio: int) -> int:
    """Sum over the queries of ``ranges`` of ``(t + 1) // ratio``."""
    total = 0
    for a, b in ranges:
        total += (
            sum((t + 1) // ratio for t in range(a, b))
            if b - a < 4096
            else int(sum((t + 1) for t in (a, b - 1)) * (b - a) / 2 / ratio)
        )
    return total


def layer_ms(
    cfg: V4ModelConfig, rates: PlannerRates, tokens: int, cp_size: int, level: int, ratio: int, page_size: int = 64
) -> dict[str, float]:
    """Milliseconds of one layer of compress ``ratio`` on rank 0 (see the module docstring)."""
    blocks = zigzag_blocks(tokens, cp_size, page_size, page_aligned=level >= 4)
    ranges = rank_ranges(blocks, 0)
    t_local = sum(b - a for a, b in ranges)
    h, d = cfg.n_heads, cfg.head_dim
    macs = cfg.dim * cfg.q_lora_rank + cfg.q_lora_rank * h * d + cfg.dim * d + h * d * cfg.o_lora_rank
    macs += cfg.o_groups * cfg.o_lora_rank * cfg.dim
    window = min(cfg.window_size, tokens)
    keys = float(t_local * window)
    terms: dict[str, float] = {}
    if ratio == 4:
        macs += 2 * cfg.dim * 2 * d + cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
        macs += cfg.dim * cfg.index_n_heads + 2 * cfg.dim * 2 * cfg.index_head_dim
        visible = _visible_entries(ranges, 4)
        keys += min(visible, t_local * cfg.index_topk)
        terms["indexer_logits"] = ms_for_flops(
            2.0 * cfg.index_n_heads * cfg.index_head_dim * visible, rates.indexer_logits_tflops
        )
    elif ratio == 128:
        macs += 2 * cfg.dim * d
        keys += _visible_entries(ranges, 128)
    terms["projections"] = ms_for_flops(2.0 * t_local * macs, rates.matmul_tflops)
    terms["attention"] = ms_for_flops(2.0 * keys * h * (d + d), rates.attention_tflops)
    terms["wire"] = ms_for_bytes(
        sum(gather_bytes(cfg, tokens, cp_size, level, ratio, page_size=page_size).values()), rates.interconnect_gbps
    )
    return terms


def plan_v4(
    preset: str,
    cp_size: int,
    contexts: list[int],
    levels: list[int],
    kv_budget_gib: float,
    rates: PlannerRates | None = None,
) -> dict[str, Any]:
    """The V4 terms at each context and level, with DeepSeek-V3.2 beside (the planner's own terms).

    Raises :class:`ConfigError` naming the argument: a preset that is not a V4 preset, ``cp_size``
    outside 1..4096, a context outside 1..128M, a level outside 0..8, a KV budget that is not a
    positive number of at most 1 PiB, more than :data:`MAX_RANK_POINTS` ranks to walk."""
    if preset not in V4_PRESETS:
        raise ConfigError(
            f"preset={preset!r}: the V4 planner takes {', '.join(V4_PRESETS)} "
            "(DeepSeek-V3.2 and GLM: python -m reference_impl plan)"
        )
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or not 1 <= cp_size <= MAX_PLAN_CP:
        raise ConfigError(f"cp_size={cp_size!r}: need an integer within 1..{MAX_PLAN_CP}")
    if not contexts or any(
        isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_CONTEXT for c in contexts
    ):
        raise ConfigError(f"contexts={str(contexts)[:80]}: need token counts within 1..{MAX_CONTEXT:,}")
    if not levels or any(isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 8 for k in levels):
        raise ConfigError(f"levels={str(levels)[:80]}: need phase levels within 0..8")
    if (
        isinstance(kv_budget_gib, bool)
        or not isinstance(kv_budget_gib, (int, float))
        or not 0 < kv_budget_gib <= MAX_HBM_GIB
    ):
        raise ConfigError(
            f"kv_budget_gib={kv_budget_gib!r}: need a finite number above 0, at most {MAX_HBM_GIB:,} (1 PiB)"
        )
    if len(contexts) * len(levels) * cp_size > MAX_RANK_POINTS:
        raise ConfigError(
            f"contexts x levels x cp_size = {len(contexts)} x {len(levels)} x {cp_size}: at most "
            f"{MAX_RANK_POINTS:,} ranks to walk"
        )
    cfg = get_preset(preset)
    v32 = get_preset("deepseek-v3.2")
    rates = rates or load_rates()
    budget = int(kv_budget_gib * GIB)
    points = []
    for tokens in contexts:
        for level in levels:
            sharded = level >= 2
            at_rest = kv_at_rest(cfg, tokens, cp_size, sharded)
            per_layer = {kind: layer_ms(cfg, rates, tokens, cp_size, level, m) for kind, m in LAYER_KINDS.items()}
            gathers = {kind: gather_bytes(cfg, tokens, cp_size, level, m) for kind, m in LAYER_KINDS.items()}
            _, v32_terms = slowest_rank(v32, rates, cp_size, tokens, level)
            points.append(
                {
                    "context": tokens,
                    "level": level,
                    "kv_bytes_per_rank": at_rest,
                    "gather_bytes_per_layer": gathers,
                    "layer_ms": {kind: sum(t.values()) for kind, t in per_layer.items()},
                    "terms_ms": per_layer,
                    "forward_ms": sum(cfg.count(kind) * sum(t.values()) for kind, t in per_layer.items()),
                    "local_queries": local_queries(tokens, cp_size, 64, level, 0),
                    "v32": {
                        "kv_bytes_per_rank": kv_bytes_per_rank(v32, tokens, cp_size, sharded),
                        "layer_ms": sum(v32_terms.values()),
                    },
                }
            )
    one_m = 1 << 20
    capacity = {
        "context": one_m,
        "kv_budget_gib": kv_budget_gib,
        "v4_replicated_gib": kv_at_rest(cfg, one_m, cp_size, False)["total"] / GIB,
        "v4_sharded_gib": kv_at_rest(cfg, one_m, cp_size, True)["total"] / GIB,
        "v32_replicated_gib": kv_bytes_per_rank(v32, one_m, cp_size, False) / GIB,
        "v32_sharded_gib": kv_bytes_per_rank(v32, one_m, cp_size, True) / GIB,
        "v4_requests_at_1m_sharded": int(budget // kv_at_rest(cfg, one_m, cp_size, True)["total"]),
        "v4_requests_at_1m_replicated": int(budget // kv_at_rest(cfg, one_m, cp_size, False)["total"]),
    }
    return {
        "modeled": "planner arithmetic, nothing measured (reference_impl.planner.v4)",
        "preset": preset,
        "cp_size": cp_size,
        "rank": 0,
        "codec": "fp8",
        "layer_counts": {kind: cfg.count(kind) for kind in LAYER_KINDS},
        "bytes_per_token_per_layer": bytes_per_token(cfg),
        "per_request_bytes_per_layer": per_request_bytes(cfg, one_m),
        "capacity_1m": capacity,
        "rates": {
            k: rates.values()[k]
            for k in ("matmul_tflops", "attention_tflops", "indexer_logits_tflops", "interconnect_gbps")
        },
        "points": points,
    }


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file to write (default: print it)")
    parser.add_argument(
        "--preset",
        type=choice_arg(tuple(V4_PRESETS), "V4 preset", "DeepSeek-V3.2 and GLM: python -m reference_impl plan"),
        default="deepseek-v4-flash",
        help=", ".join(V4_PRESETS),
    )
    parser.add_argument(
        "--cp-size",
        type=int_arg(1, MAX_PLAN_CP, "the planner walks every rank"),
        default=8,
        help=f"CP ranks C, at most {MAX_PLAN_CP}",
    )
    parser.add_argument(
        "--contexts",
        default="131072,1048576",
        help=f"request lengths in tokens, comma separated (each at most {MAX_CONTEXT:,})",
    )
    parser.add_argument("--levels", default="0,2,3,4,8", help="phase levels 0..8, comma separated")
    parser.add_argument(
        "--kv-budget-gib",
        type=float_arg(MAX_HBM_GIB, "1 PiB"),
        default=48.0,
        help="KV budget per GPU, GiB (the V3.2 planner's default)",
    )
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = output_file(args.out) if args.out is not None else None
    contexts = int_list(args.contexts, "--contexts", 1, MAX_CONTEXT)
    levels = sorted(set(int_list(args.levels, "--levels", 0, 8)))
    walked = len(contexts) * len(levels) * args.cp_size
    if walked > MAX_RANK_POINTS:
        raise ConfigError(
            f"--contexts x --levels x --cp-size = {len(contexts)} x {len(levels)} x {args.cp_size} = "
            f"{walked:,} ranks to walk: at most {MAX_RANK_POINTS:,} (a plan of minutes)"
        )
    doc = plan_v4(args.preset, args.cp_size, contexts, levels, args.kv_budget_gib)
    doc["command"] = "python -m reference_impl.planner.v4 " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(doc, indent=1) + "\n"
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

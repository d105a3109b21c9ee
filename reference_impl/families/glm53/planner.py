"""GLM-5.3's capacity planner: bytes per token per layer type, bytes at rest per rank, capacity per rank.

Usage::

    python -m reference_impl.planner.glm53 --out docs/results/glm53_planner.json [--cp-size 8] [--kv-budget-gib 48]

Scenario (as :mod:`reference_impl.planner`): one request of ``S`` tokens, the in-seq split over ``C``
ranks, rank 0 (it owns pages ``0, C, 2C, ...``, the most of any rank). Everything is arithmetic on
the dims of :class:`~reference_impl.families.glm53.config.Glm53Config` and on what
:class:`~reference_impl.families.glm53.cp.store.Glm53Store` keeps; nothing is measured.

**What a rank keeps, per layer type** (levels 0-1: everything on every rank; from level 2 the rows of
the pages it owns, page ``p`` on rank ``p mod C``):

* KDA layer: per request, the float32 state ``H x Dk x Dv x 4`` B and the convolution tail
  ``(conv - 1) x 3 H Dk x 2`` B (bf16): constant in the length, replicated at every level;
* indexed layer: per token its latent row, ``kv_lora_rank x 2`` B in bf16 (1,024 B on Flash) or, for
  ``--kv-dtype fp8``, ``kv_lora_rank`` FP8 bytes plus a float32 scale per 128 channels (528 B:
  DeepSeek-V3.2's FP8 row without its RoPE part, :mod:`~reference_impl.families.glm53.cache_layout`); per
  complete group of ``index_kpool`` tokens (16) its pooled key, ``index_head_dim x 4`` B (float32,
  as the store keeps it), on the owner of the group's last token; on a layer sharing its selection
  (IndexShare) no key; per request the pending raw indexer rows of its incomplete group, at most
  ``kpool - 1`` rows of key and gate, ``2 x index_head_dim x 2`` B each, replicated.

**Capacity per rank** for a KV budget ``B`` per GPU: the longest single request whose bytes at rest
on rank 0 fit ``B`` (replicated and sharded), the tokens rank 0 then holds, and how many requests of
1M tokens fit. The KDA state is what stays constant: it caps the number of requests a rank can hold,
not their length.

**Per chunk, received by a rank per layer** (the exchange the in-seq split costs): the KDA state maps
``(2C - 2) x H x Dk x (Dk + Dv) x 4`` B and halos ``(2C - 2) x (conv - 1) x 3 H Dk x 2`` B, whatever
the chunk's length; on an indexed layer the chunk's latent and raw indexer rows,
``(C - 1) / C x T x (latent + 2 Di x 2)`` B, and from level 2 the request's rows held elsewhere
(latent rows and group keys), for comparison.

GLM-5.2 (:mod:`reference_impl.cp.capacity`, DSA's layout) and DeepSeek-V4-Flash
(:mod:`reference_impl.families.deepseek_v4.planner`, FP8 only) are computed by their own planners'
functions and put beside GLM-5.3 in one table.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from reference_impl.config import MAX_HBM_GIB, MAX_PLAN_CP, KVDtype
from reference_impl.cp.capacity import kv_bytes_per_rank, max_context_per_rank
from reference_impl.errors import ConfigError
from reference_impl.families.deepseek_v4.planner import kv_at_rest as v4_kv_at_rest
from reference_impl.families.glm53.cache_layout import fp8_row_bytes
from reference_impl.families.glm53.config import DSA, GLM53_PRESETS, KDA, Glm53Config
from reference_impl.planner.plan import MAX_CONTEXT
from reference_impl.presets import get_preset
from reference_impl.tool_args import ToolParser, choice_arg, float_arg, int_arg, int_list, output_file, refusing

PROG = "python -m reference_impl.planner.glm53"
GIB = 1 << 30
ONE_M = 1 << 20
KV_DTYPES = ("bf16", "fp8")
PAGE_SIZE = 64
COMPARED = ("glm-5.2", "deepseek-v4-flash")  # planned by their own families' functions
SEARCH_LIMIT = 1 << 40  # tokens: the longest request the capacity search looks for
V4_STEP = 512  # DeepSeek-V4's capacity is searched over multiples of this (its compressor state wobbles)
ELSEWHERE = (
    "DeepSeek-V3.2 and GLM-5/5.2: python -m reference_impl plan; DeepSeek-V4: python -m reference_impl.planner.v4"
)


# ---- bytes per token and per request ---------------------------------------------------------------


def latent_row_bytes(cfg: Glm53Config, kv_dtype: str) -> int:
    """One token's latent row: ``R x 2`` (bf16), or ``R + R / 128 x 4`` (the FP8 row the store keeps)."""
    if kv_dtype == "bf16":
        return cfg.kv_lora_rank * 2
    return fp8_row_bytes(cfg.kv_lora_rank)


def group_key_bytes(cfg: Glm53Config) -> int:
    """One complete group's pooled key: ``index_head_dim`` float32 values (as the store keeps it)."""
    return cfg.index_head_dim * 4


def conv_tail_bytes(cfg: Glm53Config) -> int:
    """One request's convolution tail on one KDA layer: ``(conv - 1) x 3 H Dk`` bf16 values."""
    return (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * 2


def map_bytes(cfg: Glm53Config) -> int:
    """One block's KDA state map ``[A | B]``: float32 ``H x Dk x (Dk + Dv)``."""
    return cfg.linear_num_heads * cfg.linear_head_dim * 2 * cfg.linear_head_dim * 4


def pending_bytes(cfg: Glm53Config) -> int:
    """One request's pending indexer rows on one full-indexer layer: ``kpool - 1`` rows of key and gate, bf16."""
    return (cfg.index_kpool - 1) * 2 * cfg.index_head_dim * 2


def layer_counts(cfg: Glm53Config) -> dict[str, int]:
    """``kda``, ``indexed`` (all indexed layers) and ``indexers`` (those with their own indexer, that keep keys)."""
    n = cfg.n_layers
    return {
        "kda": cfg.count(KDA),
        "indexed": cfg.count(DSA),
        "indexers": sum(cfg.layer_types[i] == DSA and not cfg.shares_selection(i) for i in range(n)),
    }


def bytes_per_token(cfg: Glm53Config, kv_dtype: str) -> dict[str, float]:
    """What grows with the context, per token per layer of each type (a group key counts ``1 / kpool``)."""
    latent = latent_row_bytes(cfg, kv_dtype)
    return {
        "kda": 0.0,
        "indexed": latent + group_key_bytes(cfg) / cfg.index_kpool,
        "indexed_shared": float(latent),
    }


def per_request_bytes(cfg: Glm53Config) -> dict[str, int]:
    """What does not grow with the context, per request per layer of each type."""
    return {
        "kda_state": cfg.kda_state_bytes,
        "kda_conv_tail": conv_tail_bytes(cfg),
        "indexed_pending": pending_bytes(cfg),
    }


# ---- what rank 0 holds -----------------------------------------------------------------------------


def owned_tokens(tokens: int, cp_size: int, rank: int = 0, page_size: int = PAGE_SIZE) -> int:
    """Tokens of a request of ``tokens`` whose pages ``rank`` owns (page ``p`` on rank ``p mod C``)."""
    pages = -(-tokens // page_size)
    owned = max(0, -(-(pages - rank) // cp_size))
    held = owned * page_size
    if owned and (pages - 1) % cp_size == rank:  # the last page is rank's, and may be partial
        held -= pages * page_size - tokens
    return held


def owned_groups(tokens: int, cp_size: int, kpool: int, rank: int = 0, page_size: int = PAGE_SIZE) -> int:
    """Complete groups whose last token lies on a page ``rank`` owns (``page_size`` a multiple of ``kpool``:
    a group never straddles a page)."""
    if page_size % kpool:
        raise ConfigError(f"page_size={page_size}: the planner needs a multiple of index_kpool={kpool}")
    groups, per_page = tokens // kpool, page_size // kpool
    full_pages = groups // per_page  # pages whose groups are all complete
    owned_full = max(0, -(-(full_pages - rank) // cp_size))
    last = groups - full_pages * per_page  # complete groups on the next page
    return owned_full * per_page + (last if last and full_pages % cp_size == rank else 0)


def at_rest(
    cfg: Glm53Config, tokens: int, cp_size: int, sharded: bool, kv_dtype: str = "bf16", rank: int = 0
) -> dict[str, int]:
    """Bytes at rest on ``rank``, one request of ``tokens`` tokens, all layers, by part (and ``total``)."""
    n = layer_counts(cfg)
    rows = owned_tokens(tokens, cp_size, rank) if sharded else tokens
    groups = owned_groups(tokens, cp_size, cfg.index_kpool, rank) if sharded else tokens // cfg.index_kpool
    out = {
        "kda_state": n["kda"] * (cfg.kda_state_bytes + conv_tail_bytes(cfg)),
        "latent": n["indexed"] * rows * latent_row_bytes(cfg, kv_dtype),
        "group_keys": n["indexers"] * groups * group_key_bytes(cfg),
        "pending": n["indexers"] * (tokens % cfg.index_kpool) * 2 * cfg.index_head_dim * 2,
    }
    out["total"] = sum(out.values())
    return out


def per_layer_at_rest(
    cfg: Glm53Config, tokens: int, cp_size: int, sharded: bool, kv_dtype: str = "bf16", rank: int = 0
) -> dict[str, int]:
    """Bytes at rest on ``rank`` per layer of each type, one request of ``tokens`` tokens."""
    rows = owned_tokens(tokens, cp_size, rank) if sharded else tokens
    groups = owned_groups(tokens, cp_size, cfg.index_kpool, rank) if sharded else tokens // cfg.index_kpool
    shared = rows * latent_row_bytes(cfg, kv_dtype)
    pending = (tokens % cfg.index_kpool) * 2 * cfg.index_head_dim * 2
    return {
        "kda": cfg.kda_state_bytes + conv_tail_bytes(cfg),
        "indexed": shared + groups * group_key_bytes(cfg) + pending,
        "indexed_shared": shared,
    }


def exchange_bytes(cfg: Glm53Config, chunk: int, context: int, cp_size: int, kv_dtype: str = "bf16") -> dict[str, int]:
    """Bytes rank 0 receives per layer for a chunk of ``chunk`` tokens ending at ``context`` (see the
    module docstring); ``kv_all_gather``: level 2's request rows held elsewhere, for comparison."""
    c = cp_size
    blocks = 2 * c - 2  # the other ranks' blocks (two each under the in-seq split)
    latent = latent_row_bytes(cfg, kv_dtype)
    others = context - owned_tokens(context, c)
    other_groups = context // cfg.index_kpool - owned_groups(context, c, cfg.index_kpool)
    return {
        "kda_maps": blocks * map_bytes(cfg) if c > 1 else 0,
        "kda_halos": blocks * conv_tail_bytes(cfg) if c > 1 else 0,
        "indexed_current": (chunk - chunk // c) * (latent + 2 * cfg.index_head_dim * 2),
        "kv_all_gather": others * latent + other_groups * group_key_bytes(cfg),
    }


# ---- capacity --------------------------------------------------------------------------------------


def largest_fitting(bytes_at: Callable[[int], int], budget: int, step: int = 1) -> int:
    """The largest multiple of ``step`` ``S <= SEARCH_LIMIT`` with ``bytes_at(S) <= budget`` (``bytes_at``
    nondecreasing); 0 when even ``step`` tokens do not fit."""
    lo, hi = 0, SEARCH_LIMIT // step
    if bytes_at(step) > budget:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bytes_at(mid * step) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def _glm53_total(cfg: Glm53Config, cp_size: int, sharded: bool, kv_dtype: str, tokens: int) -> int:
    return at_rest(cfg, tokens, cp_size, sharded, kv_dtype)["total"]


def _v4_total(cfg: Any, cp_size: int, sharded: bool, tokens: int) -> int:
    return v4_kv_at_rest(cfg, tokens, cp_size, sharded)["total"]


def glm53_row(cfg: Glm53Config, cp_size: int, budget: int, kv_dtype: str) -> dict[str, Any]:
    n = layer_counts(cfg)
    per_token = bytes_per_token(cfg, kv_dtype)
    row: dict[str, Any] = {
        "model": cfg.name,
        "kv_dtype": kv_dtype,
        "layout": "built (bf16 latent rows)" if kv_dtype == "bf16" else "built (FP8 latent rows, 528 B on Flash)",
        "bytes_per_token": n["indexed"] * per_token["indexed_shared"]
        + n["indexers"] * group_key_bytes(cfg) / cfg.index_kpool,
        "bytes_per_request": at_rest(cfg, 0, cp_size, False, kv_dtype)["total"],
    }
    for sharded, name in ((False, "replicated"), (True, "sharded")):
        max_ctx = largest_fitting(partial(_glm53_total, cfg, cp_size, sharded, kv_dtype), budget)
        row[name] = {
            "gib_at_128k": at_rest(cfg, 131072, cp_size, sharded, kv_dtype)["total"] / GIB,
            "gib_at_1m": at_rest(cfg, ONE_M, cp_size, sharded, kv_dtype)["total"] / GIB,
            "max_context": max_ctx,
            "tokens_on_rank_0": owned_tokens(max_ctx, cp_size) if sharded else max_ctx,
            "requests_at_1m": budget // at_rest(cfg, ONE_M, cp_size, sharded, kv_dtype)["total"],
        }
    return row


def glm52_row(cp_size: int, budget: int, kv_dtype: KVDtype) -> dict[str, Any]:
    """GLM-5.2 by :mod:`reference_impl.cp.capacity` (DSA's paged layout: MLA row, index key per token)."""
    cfg = get_preset("glm-5.2")
    row: dict[str, Any] = {
        "model": "glm-5.2",
        "kv_dtype": kv_dtype,
        "layout": "DSA pages (reference_impl.cp.capacity)",
        "bytes_per_token": kv_bytes_per_rank(cfg, PAGE_SIZE, 1, False, kv_dtype) / PAGE_SIZE,
        "bytes_per_request": 0,
    }
    for sharded, name in ((False, "replicated"), (True, "sharded")):
        max_ctx = max_context_per_rank(cfg, budget, cp_size, sharded, kv_dtype)
        row[name] = {
            "gib_at_128k": kv_bytes_per_rank(cfg, 131072, cp_size, sharded, kv_dtype) / GIB,
            "gib_at_1m": kv_bytes_per_rank(cfg, ONE_M, cp_size, sharded, kv_dtype) / GIB,
            "max_context": max_ctx,
            "tokens_on_rank_0": owned_tokens(max_ctx, cp_size) if sharded else max_ctx,
            "requests_at_1m": budget // kv_bytes_per_rank(cfg, ONE_M, cp_size, sharded, kv_dtype),
        }
    return row


def v4_row(cp_size: int, budget: int) -> dict[str, Any]:
    """DeepSeek-V4-Flash by its planner's :func:`~reference_impl.families.deepseek_v4.planner.kv_at_rest`
    (FP8; sharded means its CSA entries, as at its level 2; its capacity searched over multiples of 512)."""
    cfg = get_preset("deepseek-v4-flash")
    long, longer = (v4_kv_at_rest(cfg, n, 1, False) for n in (1 << 23, 1 << 24))
    row: dict[str, Any] = {
        "model": "deepseek-v4-flash",
        "kv_dtype": "fp8",
        "layout": "V4 entries (reference_impl.planner.v4)",
        "bytes_per_token": (longer["total"] - long["total"]) / (1 << 23),
        "bytes_per_request": long["window_and_state"],
    }
    for sharded, name in ((False, "replicated"), (True, "sharded")):
        max_ctx = largest_fitting(partial(_v4_total, cfg, cp_size, sharded), budget, V4_STEP)
        row[name] = {
            "gib_at_128k": v4_kv_at_rest(cfg, 131072, cp_size, sharded)["total"] / GIB,
            "gib_at_1m": v4_kv_at_rest(cfg, ONE_M, cp_size, sharded)["total"] / GIB,
            "max_context": max_ctx,
            "tokens_on_rank_0": owned_tokens(max_ctx, cp_size) if sharded else max_ctx,
            "requests_at_1m": budget // v4_kv_at_rest(cfg, ONE_M, cp_size, sharded)["total"],
        }
    return row


TABLE_HEAD = (
    "| model | cache dtype | B per token, all layers | B per request (fixed) | GiB on rank 0 at 1M, replicated | "
    "GiB on rank 0 at 1M, sharded | longest request, sharded | its tokens on rank 0 | 1M requests, sharded |\n"
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def markdown_table(doc: dict[str, Any]) -> str:
    """The comparison as a markdown table (what the command prints)."""
    lines = [TABLE_HEAD]
    for r in doc["table"]:
        s, rep = r["sharded"], r["replicated"]
        lines.append(
            f"| {r['model']} | {r['kv_dtype']} | {r['bytes_per_token']:,.0f} | {r['bytes_per_request']:,} | "
            f"{rep['gib_at_1m']:.2f} | {s['gib_at_1m']:.2f} | {s['max_context']:,} | {s['tokens_on_rank_0']:,} | "
            f"{s['requests_at_1m']:,} |"
        )
    return "\n".join(lines) + "\n"


def plan_glm53(
    preset: str = "glm-5.3-flash", cp_size: int = 8, kv_budget_gib: float = 48.0, contexts: list[int] | None = None
) -> dict[str, Any]:
    """The GLM-5.3 terms, capacities and the comparison table (see the module docstring).

    Raises :class:`ConfigError` naming the argument: a preset that is not a GLM-5.3 preset, ``cp_size``
    outside 1..4096, a KV budget that is not a positive number of at most 1 PiB, a context outside 1..128M."""
    if preset not in GLM53_PRESETS:
        raise ConfigError(f"preset={preset!r}: the GLM-5.3 planner takes {', '.join(GLM53_PRESETS)} ({ELSEWHERE})")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or not 1 <= cp_size <= MAX_PLAN_CP:
        raise ConfigError(f"cp_size={cp_size!r}: need an integer within 1..{MAX_PLAN_CP}")
    if (
        isinstance(kv_budget_gib, bool)
        or not isinstance(kv_budget_gib, (int, float))
        or not 0 < kv_budget_gib <= MAX_HBM_GIB
    ):
        raise ConfigError(
            f"kv_budget_gib={kv_budget_gib!r}: need a finite number above 0, at most {MAX_HBM_GIB:,} (1 PiB)"
        )
    contexts = [131072, ONE_M] if contexts is None else contexts
    if not contexts or any(
        isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_CONTEXT for c in contexts
    ):
        raise ConfigError(f"contexts={str(contexts)[:80]}: need token counts within 1..{MAX_CONTEXT:,}")
    cfg = GLM53_PRESETS[preset]
    budget = int(kv_budget_gib * GIB)
    points = []
    for tokens in contexts:
        for sharded in (False, True):
            points.append(
                {
                    "context": tokens,
                    "sharded": sharded,
                    "levels": "2-8" if sharded else "0-1",
                    "bytes_at_rest": {d: at_rest(cfg, tokens, cp_size, sharded, d) for d in KV_DTYPES},
                }
            )
    exchange = {
        name: {"chunk": chunk, "context": ctx, **exchange_bytes(cfg, chunk, ctx, cp_size)}
        for name, chunk, ctx in (("128k", 131072, 131072), ("1m", 8192, ONE_M))
    }
    table = [glm53_row(cfg, cp_size, budget, d) for d in KV_DTYPES]
    table += [glm52_row(cp_size, budget, "bf16"), glm52_row(cp_size, budget, "fp8"), v4_row(cp_size, budget)]
    doc = {
        "modeled": "planner arithmetic, nothing measured (reference_impl.planner.glm53)",
        "preset": preset,
        "cp_size": cp_size,
        "rank": 0,
        "page_size": PAGE_SIZE,
        "kv_budget_gib": kv_budget_gib,
        "layer_counts": layer_counts(cfg),
        "bytes_per_token_per_layer": {d: bytes_per_token(cfg, d) for d in KV_DTYPES},
        "bytes_per_request_per_layer": per_request_bytes(cfg),
        "map_bytes": map_bytes(cfg),
        "exchange_bytes_per_layer": exchange,
        "points": points,
        "table": table,
    }
    doc["table_markdown"] = markdown_table(doc)
    return doc


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file to write (default: none; the table is printed)")
    parser.add_argument(
        "--preset",
        type=choice_arg(
            tuple(GLM53_PRESETS),
            "GLM-5.3 preset",
            ELSEWHERE,
        ),
        default="glm-5.3-flash",
        help=", ".join(GLM53_PRESETS),
    )
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help=f"CP ranks C, at most {MAX_PLAN_CP}")
    parser.add_argument(
        "--kv-budget-gib",
        type=float_arg(MAX_HBM_GIB, "1 PiB"),
        default=48.0,
        help="cache budget per GPU, GiB (the V3.2 and V4 planners' default)",
    )
    parser.add_argument(
        "--contexts",
        default="131072,1048576",
        help=f"request lengths for the bytes at rest, comma separated (each at most {MAX_CONTEXT:,})",
    )
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = output_file(args.out) if args.out is not None else None
    contexts = int_list(args.contexts, "--contexts", 1, MAX_CONTEXT)
    doc = plan_glm53(args.preset, args.cp_size, args.kv_budget_gib, contexts)
    doc["command"] = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
    sys.stdout.write(doc["table_markdown"])
    if out is not None:
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

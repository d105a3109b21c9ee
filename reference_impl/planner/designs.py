"""The planner for the competing KV designs: per design, one layer of one rank, and the KV it keeps.

Usage::

    python -m reference_impl.planner.designs --out docs/results/kv_designs_modeled.json [--cp-size 8] [--rank 0]
        [--layers 61] [--wire-gbps 450] [--peer-gbps 450]

**Scenario.** One request of ``prefix + extend`` tokens, the extend split in-seq (token-balanced
zigzag) over ``C`` ranks, one rank (``--rank``) of the group; DeepSeek-V3.2 by default. The designs
(:mod:`reference_impl.cp.designs`; ``phases`` = this package's level 8) and the one that cannot
run here, ``shared-vmm`` (SGLang's shared CUDA VMM view, same host only), modeled as a **demand
load**: the rank reads the history rows its peers own once per layer straight from their memory,
``(C - 1) / C x prefix x (656 + 132)`` bytes at ``--peer-gbps`` (an assumed NVLink peer-read rate),
with no collective, no padding and nothing prefetched, then builds its view as the others do.

**Per layer** (the average over the model's layers, which matters for layer split: a rank owns
``ceil(L / C)`` or ``floor(L / C)`` of them):

* compute: projections, indexer logits and top-k, sparse MLA and elementwise work of the rank's
  queries (:mod:`reference_impl.planner.model`), the same for every design;
* all-gather #1 of the chunk over the wire, its rerange and the store (fused kernels: designs run
  beside phase 7): the owned tokens of the chunk (shards), the whole chunk on the owned layers
  (layer split), the rank's own tokens (phases, written directly);
* history movement, bytes one rank receives: phases and rotated shard ``(C - 1) x ceil(pages / C)``
  pages (page = MLA + index page); layer split the history pages on each layer it does not own;
  dcp-gather ``(C - 1) x ceil(S / C)`` rows of 788 B (every shard, current included). Prefetched
  movement (layer split, rotated shard; the MLA half of the phases') is hidden up to the layer's
  compute; the rest is exposed;
* view build: history rows dequantized at the fused materialize rate and current rows filled from
  the chunk at the fused fill rate; dcp-gather unpacks every view row on the torch path.

**At rest**, per rank, all layers: the page shards ``ceil(pages / C)`` pages per layer (rotated
shard one trash page more), dcp-gather its ``ceil(S / C)`` tokens per layer, layer split every page
of its owned layers; ``max_context`` is the longest request whose KV fits the budget, counting for
layer split the one pool-sized scratch layer SGLang reserves beside the owned ones.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from reference_impl.config import MAX_HBM_GIB, MAX_PLAN_CP, KVDtype
from reference_impl.cp.capacity import page_bytes
from reference_impl.cp.designs import layer_shard_range
from reference_impl.cp.split import in_seq_block_sizes
from reference_impl.kvcache.layout import KVLayout
from reference_impl.planner.model import (
    activation_bytes,
    compute_terms,
    fill_bytes,
    gather_row_bytes,
    ms_for_bytes,
    rank_ranges,
    rerange_bytes,
    store_bytes,
    view_bytes,
    visible_keys,
)
from reference_impl.planner.rates import PlannerRates, load_rates
from reference_impl.presets import ModelConfig, get_preset
from reference_impl.tool_args import (
    DSA_PRESETS,
    MAX_LAYERS,
    ToolParser,
    dsa_preset_arg,
    float_arg,
    int_arg,
    output_file,
    rank_of,
    refusing,
)

PROG = "python -m reference_impl.planner.designs"

PLANNED_DESIGNS = ("phases", "layer-split", "rotated-shard", "dcp-gather", "shared-vmm")
BUILT = frozenset({"phases", "layer-split", "rotated-shard", "dcp-gather"})
DEFAULT_WORKLOADS = (
    ("current-only", 0, 32768),
    ("current-only", 0, 131072),
    ("prefix-heavy", 24576, 8192),
    ("prefix-heavy", 122880, 8192),
)
GIB = 2**30


def kv_bytes_at_rest(
    cfg: ModelConfig, design: str, tokens: int, cp_size: int, rank: int, kv_dtype: KVDtype = "fp8", page_size: int = 64
) -> int:
    """KV + index bytes ``rank`` keeps for one request of ``tokens`` tokens, all ``cfg.n_layers`` layers."""
    pages = -(-tokens // page_size)
    one_page = page_bytes(cfg, kv_dtype, page_size)
    if design == "layer-split":
        start, end = layer_shard_range(rank, cp_size, cfg.n_layers)
        return (end - start) * pages * one_page
    if design == "dcp-gather":
        layout = KVLayout.from_config(cfg, kv_dtype, page_size)
        held = max(0, -(-(tokens - rank) // cp_size))  # interleave 1: positions rank, rank + C, ...
        return cfg.n_layers * -(-held // page_size) * (layout.mla_page_bytes + layout.index_page_bytes)
    owned = max(0, -(-(pages - rank) // cp_size)) + (1 if design == "rotated-shard" else 0)
    return cfg.n_layers * owned * one_page


def max_context(
    cfg: ModelConfig, design: str, budget: int, cp_size: int, kv_dtype: KVDtype = "fp8", page_size: int = 64
) -> int:
    """Longest request (a multiple of the page size) whose KV fits ``budget`` bytes on every rank; for
    layer split, one pool-sized scratch layer is reserved beside the owned layers (as SGLang sizes it)."""

    def fits(tokens: int) -> bool:
        worst = max(kv_bytes_at_rest(cfg, design, tokens, cp_size, r, kv_dtype, page_size) for r in range(cp_size))
        if design == "layer-split":
            worst += -(-tokens // page_size) * page_bytes(cfg, kv_dtype, page_size)
        return worst <= budget

    lo, hi = 0, 1
    while fits(hi * page_size):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * page_size) else (lo, mid)
    return lo * page_size


def design_layer(
    cfg: ModelConfig,
    rates: PlannerRates,
    design: str,
    cp_size: int,
    prefix: int,
    extend: int,
    rank: int = 0,
    kv_dtype: KVDtype = "fp8",
    page_size: int = 64,
    peer_gbps: float | None = None,
) -> dict[str, Any]:
    """One layer of ``rank`` under ``design``: ``layer_ms`` with its ``terms_ms``, the bytes it moves,
    materializes and holds, its collectives and host syncs (see the module docstring)."""
    if design not in PLANNED_DESIGNS:
        raise ValueError(f"design {design!r}: plan one of {PLANNED_DESIGNS}")
    layout = KVLayout.from_config(cfg, kv_dtype, page_size)
    blocks = in_seq_block_sizes(extend, cp_size)
    ranges = rank_ranges(blocks, rank)
    t_local = sum(b - a for a, b in ranges)
    t_pad = max(blocks[r] + blocks[len(blocks) - 1 - r] for r in range(cp_size))
    context = prefix + extend
    n_visible = visible_keys(tuple((prefix + a, prefix + b) for a, b in ranges))
    compute = compute_terms(cfg, rates, t_local, context, n_visible)
    compute_ms = sum(compute.values())
    wire = rates.interconnect_gbps
    terms = dict(compute)
    terms["allgather1"] = ms_for_bytes((cp_size - 1) * t_pad * gather_row_bytes(cfg), wire)
    kv_b, index_b = rerange_bytes(cfg, extend)
    terms["rerange"] = ms_for_bytes(kv_b, rates.gbps("rerange_kv", True)) + ms_for_bytes(
        index_b, rates.gbps("rerange_index", True)
    )

    start, end = layer_shard_range(rank, cp_size, cfg.n_layers)
    owned_fraction = (end - start) / cfg.n_layers  # layer split: share of layers this rank owns
    if design == "phases":
        rows = t_local  # phase 5: each rank writes the rows it computed
    elif design == "layer-split":
        rows = round(extend * owned_fraction)  # the whole chunk, on the owned layers
    else:
        rows = -(-extend // cp_size)  # the shard's rows of the gathered chunk
    mla_b, idx_b = store_bytes(cfg, layout, rows)
    terms["store"] = ms_for_bytes(mla_b, rates.gbps(f"store_mla_{kv_dtype}", True)) + ms_for_bytes(
        idx_b, rates.gbps("store_index", True)
    )

    history_pages = -(-prefix // page_size)
    one_page = layout.mla_page_bytes + layout.index_page_bytes
    token_bytes = layout.mla_bytes + layout.index_bytes
    per_rank_pages = -(-history_pages // cp_size)
    collectives = 2  # all-gather #1: latent KV, indexer K
    hidden_bytes = exposed_bytes = 0  # history bytes received over the wire: prefetched / synchronous
    peer_bytes = 0
    materialized = 0
    gathered_buffers = 0
    if design in ("phases", "rotated-shard") and history_pages:
        received = (cp_size - 1) * per_rank_pages
        if design == "phases":  # MLA prefetched a layer ahead, index K synchronous
            hidden_bytes, exposed_bytes = received * layout.mla_page_bytes, received * layout.index_page_bytes
            gathered_buffers = cp_size * per_rank_pages * one_page + context * cfg.kv_width * 2  # + 2nd view buffer
        else:
            hidden_bytes = received * one_page
            gathered_buffers = 2 * cp_size * per_rank_pages * one_page  # two slots
        materialized = cp_size * per_rank_pages * one_page
        collectives += 2
    elif design == "layer-split" and history_pages:
        hidden_bytes = round(history_pages * one_page * (1 - owned_fraction))
        materialized = history_pages * one_page
        gathered_buffers = 2 * history_pages * one_page
        collectives += 2  # MLA and index K broadcasts: received, or sent on the layers it owns
    elif design == "dcp-gather":
        n_pad = -(-context // cp_size)
        exposed_bytes = (cp_size - 1) * n_pad * token_bytes
        materialized = gathered_buffers = cp_size * n_pad * token_bytes
        collectives += 2
    elif design == "shared-vmm" and prefix:
        peer_bytes = round(prefix * token_bytes * (cp_size - 1) / cp_size)
        materialized = prefix * token_bytes
        gathered_buffers = peer_bytes
    terms["history_wire_exposed"] = max(0.0, ms_for_bytes(hidden_bytes, wire) - compute_ms) + ms_for_bytes(
        exposed_bytes, wire
    )
    terms["peer_reads"] = ms_for_bytes(peer_bytes, peer_gbps or wire)
    if design == "dcp-gather":
        terms["full_view"] = ms_for_bytes(view_bytes(cfg, layout, context), rates.gbps("materialize", fused=False))
    else:
        terms["full_view"] = ms_for_bytes(
            view_bytes(cfg, layout, prefix), rates.gbps("materialize", fused=True)
        ) + ms_for_bytes(fill_bytes(cfg, layout, extend), rates.fill_current_fused_gbps)
    chunk = cp_size * t_pad * gather_row_bytes(cfg)
    view = context * (cfg.kv_width * 2 + cfg.index_head_dim + 4)
    transient = chunk + view + gathered_buffers
    moved = (cp_size - 1) * t_pad * gather_row_bytes(cfg) + hidden_bytes + exposed_bytes + peer_bytes
    return {
        "design": design,
        "status": "built" if design in BUILT else "modeled (cannot run across ranks on one GPU)",
        "layer_ms": sum(terms.values()),
        "terms_ms": terms,
        "bytes_moved_per_layer": moved,
        "history_bytes_moved_per_layer": hidden_bytes + exposed_bytes + peer_bytes,
        "peer_bytes_read_per_layer": peer_bytes,
        "bytes_materialized_per_layer": materialized,
        "collectives_per_layer": collectives,
        "host_syncs_per_layer": 0,
        "transient_bytes": transient,
        "peak_bytes": transient + activation_bytes(cfg, t_local, context),
        "kv_bytes_at_rest": kv_bytes_at_rest(cfg, design, context, cp_size, rank, kv_dtype, page_size),
    }


def plan_designs(
    preset: str = "deepseek-v3.2",
    cp_size: int = 8,
    rank: int = 0,
    n_layers: int | None = None,
    workloads: tuple[tuple[str, int, int], ...] = DEFAULT_WORKLOADS,
    rates: PlannerRates | None = None,
    peer_gbps: float | None = None,
    budget_gib: float = 48.0,
    kv_dtype: KVDtype = "fp8",
    page_size: int = 64,
) -> dict[str, Any]:
    """Every design at every workload for one rank -> the JSON of ``kv_designs_modeled.json``."""
    cfg = get_preset(preset)
    cfg = cfg.with_layers(n_layers) if n_layers is not None else cfg
    rates = rates or load_rates()
    budget = int(budget_gib * GIB)
    return {
        "kind": "modeled",
        "source": "python -m reference_impl.planner.designs (arithmetic on the planner's rates: nothing ran)",
        "preset": preset,
        "n_layers": cfg.n_layers,
        "cp_size": cp_size,
        "rank": rank,
        "kv_dtype": kv_dtype,
        "page_size": page_size,
        "wire_gbps": rates.interconnect_gbps,
        "peer_gbps": peer_gbps or rates.interconnect_gbps,
        "kv_budget_gib": budget_gib,
        "rates": {k: {"value": v, "source": rates.sources[k]} for k, v in rates.values().items()},
        "workloads": [
            {
                "name": name,
                "prefix": prefix,
                "extend": extend,
                "designs": [
                    design_layer(cfg, rates, d, cp_size, prefix, extend, rank, kv_dtype, page_size, peer_gbps)
                    for d in PLANNED_DESIGNS
                ],
            }
            for name, prefix, extend in workloads
        ],
        "capacity": [
            {"design": d, "max_context": max_context(cfg, d, budget, cp_size, kv_dtype, page_size)}
            for d in PLANNED_DESIGNS
        ],
    }


def one_rank_parser(prog: str, description: str, layers: int | None, layers_help: str) -> ToolParser:
    """The flags the designs' planner and benchmark share: ``--out``, ``--preset``, ``--cp-size``, ``--rank``,
    ``--layers``."""
    parser = ToolParser(prog, description)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--preset", type=dsa_preset_arg(), default="deepseek-v3.2", help=", ".join(DSA_PRESETS))
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="CP ranks C")
    parser.add_argument("--rank", type=int_arg(0), default=0, help="the rank modeled, 0..C-1")
    parser.add_argument(
        "--layers", type=int_arg(1, MAX_LAYERS, "more than any preset's"), default=layers, help=layers_help
    )
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = one_rank_parser(PROG, __doc__.split("\n\n")[0], None, "model layers (default: the preset's)")
    parser.add_argument(
        "--peer-gbps", type=float_arg(), default=None, help="shared VMM peer-read rate, GB/s (default: the wire's)"
    )
    parser.add_argument(
        "--budget-gib",
        type=float_arg(MAX_HBM_GIB, "1 PiB"),
        default=48.0,
        help="KV budget per GPU for max_context, GiB",
    )
    args = parser.parse_args(argv)
    out = output_file(args.out)
    rank_of(args.rank, args.cp_size)
    doc = plan_designs(
        args.preset, args.cp_size, args.rank, args.layers, peer_gbps=args.peer_gbps, budget_gib=args.budget_gib
    )
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

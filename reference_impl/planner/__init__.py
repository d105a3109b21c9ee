"""Capacity planner: KV bytes, max context and per-layer time per rank, for every phase level.

``python -m reference_impl plan --preset deepseek-v3.2 --cp 8 --hbm-gib 141`` prints it. Nothing
here is timed: memory is arithmetic on the real byte layouts (:mod:`reference_impl.cp.capacity`) and
time is FLOPs or bytes divided by rates measured on an H200 (:class:`PlannerRates`, loaded from
``docs/results/compute_bench.json``, ``kernels_bench.json``, ``elementwise_rate.json`` and
``glue_h200.json``), plus
one assumed interconnect bandwidth. Every figure is a prediction, for levels that are built and for those that are not.

**Scenario.** One request of ``S`` tokens prefilled in one chunk (no prefix, so ``T = S`` current
tokens), in-seq (zigzag) split over ``C`` ranks: token-balanced blocks below level 4, page-aligned
blocks from level 4. Times are those of the slowest rank.

**Memory per rank.**

* KV at rest: levels 0-1 replicated (``kv_bytes_per_rank(..., sharded=False)``), levels >= 2
  sharded (rank 0, which owns ``ceil(pages / C)`` pages). Phase 5's allocator slack (a few pages
  of id space) is not counted.
* Max context: :func:`~reference_impl.cp.capacity.max_context_per_rank` for the KV budget
  ``hbm_gib - reserved_gib`` (or ``hbm_gib * kv_budget_fraction``). The reserved part stands for
  weights, activations and workspace. Its default, 93 GiB whatever the preset and ``C``, is an
  assumption (DeepSeek-V3.2's 671e9 FP8 weight bytes over 8 GPUs, 78 GiB, plus 15 GiB): it leaves
  48 GiB of a 141 GiB GPU for KV, the budget the phase 2 walkthrough uses. Pass your own.
* Transient per layer (what a layer holds besides the pool, counted as the engine counts it): the
  gathered chunk ``T x (576 + 128) x 2`` B (bf16), the full view ``S x (576 x 2 + 132)`` B, and at
  level 2 the gathered pages ``pages x page_bytes``. From level 3 a current-only batch gathers no page.
* Activations per layer (:func:`activation_bytes`, JSON ``activation_bytes_per_layer``): the
  projections of the ``T_local`` queries and their top-k, and the larger of the indexer's logits
  tile with the selection's workspace (flat in the context: keys stream through an exact running
  top-k in tiles of 131,072) and the attention output with the products after it.
  Transient + activations is the predicted peak above the pools, which ``bench/layer.py`` compares
  with ``torch.cuda.max_memory_allocated`` (``scripts/memory_peak.py`` lists what is alive there).

**Time per layer per rank** = compute + data movement, added (no overlap assumed):

* sparse MLA: ``2 x T_local x topk x H x (576 + 512)`` FLOPs / attention TFLOPS;
* indexer: ``2 x Hi x D x sum(visible keys of local queries)`` FLOPs / logits TFLOPS, and top-k:
  the measured ms scaled linearly in ``T_local x S``;
* projections: the GEMM FLOPs of the layer's linear maps for ``T_local`` tokens / bf16 matmul TFLOPS;
* elementwise work on the local tokens (norms, RoPE, Hadamard, FP8 quantization, casts, copies):
  ``T_local`` x the device time per token measured by profiling one rank
  (:mod:`~reference_impl.planner.elementwise`);
* all-gather #1: ``(C - 1) x T_pad x 1408`` B received, over the interconnect (assumed, 450 GB/s);
* rerange and store: bytes as the kernel benchmark counts them (each byte read and written once)
  / GB/s of the torch path below level 7, of the fused kernels from level 7;
* full-view build: ``S x (mla_bytes + 132 + 1152 + 132)`` B at the torch materialize GB/s: its rows
  come from the replica (0-1), gathered pages (2) or the gathered chunk (3-6, ``fill_current``);
  from level 7 the fused current-rows fill, ``S x (1152 + 256 + 8 + 1152 + 132)`` B at its
  measured GB/s (``glue_h200.json``);
* level 2 only: the materialize all-gather, ``(C - 1) x max owned pages x page_bytes``, over the
  interconnect (from level 3 a current-only batch materializes nothing);
* levels 2-4: selecting the owned rows from the gathered chunk, at device copy GB/s;
* levels 2-5: remap with sort + searchsorted, two calls per layer (MLA and indexer writes); from
  level 6 the page-inverse remap once per forward, shared by all layers.

Not modeled: the MoE/MLP half of the layer, kernel launch overheads (they dominate short layers:
at 8,192 tokens a rank's layer is about 5 ms), and any overlap of compute with communication. Phase 8 hides history
materialization, which is zero in this scenario, so level 8 predicts the same as level 7. The tail
gather runs once per forward and is reported apart (level 0: ``T_pad`` rows per rank, from level 1
one row).

**Layout.** :mod:`~reference_impl.planner.rates` holds the measured rates and where they come from,
:mod:`~reference_impl.planner.elementwise` the profiled elementwise rate,
:mod:`~reference_impl.planner.model` the formulas (bytes, FLOPs and the milliseconds of one layer on
one rank), :mod:`~reference_impl.planner.plan` the knobs and the plan over every level, and
:mod:`~reference_impl.planner.format` the text table. Every public name is re-exported here.
"""

from __future__ import annotations

from .format import format_plan
from .model import (
    ACT_BYTES,
    activation_bytes,
    allgather1_bytes,
    attention_flops,
    fill_bytes,
    gather_row_bytes,
    indexer_flops,
    layer_terms,
    local_queries,
    materialize_comm_bytes,
    ms_for_bytes,
    ms_for_flops,
    owned_tokens,
    projection_flops,
    projection_macs,
    rank_ranges,
    rerange_bytes,
    slowest_rank,
    store_bytes,
    tail_ms,
    topk_ms,
    transient_bytes,
    view_bytes,
    visible_keys,
    zigzag_blocks,
)
from .plan import (
    DEFAULT_CONTEXTS,
    DEFAULT_RESERVED_GIB,
    GIB,
    LEVELS,
    PlannerConfig,
    level_status,
    parse_contexts,
    plan_capacity,
)
from .rates import RESULTS_DIR, PlannerRates, load_rates, rates_from_bench

__all__ = [
    "ACT_BYTES",
    "DEFAULT_CONTEXTS",
    "DEFAULT_RESERVED_GIB",
    "GIB",
    "LEVELS",
    "RESULTS_DIR",
    "PlannerConfig",
    "PlannerRates",
    "activation_bytes",
    "allgather1_bytes",
    "attention_flops",
    "fill_bytes",
    "format_plan",
    "gather_row_bytes",
    "indexer_flops",
    "layer_terms",
    "level_status",
    "load_rates",
    "local_queries",
    "materialize_comm_bytes",
    "ms_for_bytes",
    "ms_for_flops",
    "owned_tokens",
    "parse_contexts",
    "plan_capacity",
    "projection_flops",
    "projection_macs",
    "rank_ranges",
    "rates_from_bench",
    "rerange_bytes",
    "slowest_rank",
    "store_bytes",
    "tail_ms",
    "topk_ms",
    "transient_bytes",
    "view_bytes",
    "visible_keys",
    "zigzag_blocks",
]

"""The planner's formulas: the split, FLOPs and bytes of one layer, and its milliseconds per rank.

Every function is arithmetic on one request of ``S`` tokens prefilled in one chunk (the scenario of
:mod:`reference_impl.planner`): the zigzag blocks and the keys each rank's queries see, the FLOPs
of the attention slice, the bytes each CP data movement reads and writes (counted as
``bench/kernels.py`` counts them), and :func:`layer_terms`, which divides them by the
:class:`~reference_impl.planner.rates.PlannerRates` of the path each phase level takes.
"""

from __future__ import annotations

import functools

from reference_impl.config import KVDtype
from reference_impl.cp.capacity import page_bytes
from reference_impl.cp.ownership import Ownership, owned_page_count
from reference_impl.cp.page_aligned import page_aligned_block_sizes
from reference_impl.cp.split import in_seq_block_sizes
from reference_impl.kvcache.layout import KVLayout
from reference_impl.planner.rates import PlannerRates
from reference_impl.presets import ModelConfig

ACT_BYTES = 2  # bf16 activations on the GPU


# --------------------------------------------------------------------------------------------
# The split: local queries per rank
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def zigzag_blocks(context: int, cp_size: int, page_size: int, page_aligned: bool, prefix: int = 0) -> tuple[int, ...]:
    """The ``2C`` block sizes of the ``context - prefix`` extend tokens of one request whose first
    ``prefix`` tokens are cached (a later chunk of a chunked prefill; 0: the whole request).

    Page-aligned on absolute positions (level >= 4) where the extend spans at least ``2C`` pages,
    else token-balanced.
    """
    if page_aligned:
        sizes = page_aligned_block_sizes(prefix, context - prefix, cp_size, page_size)
        if sizes is not None:
            return sizes
    return in_seq_block_sizes(context - prefix, cp_size)


@functools.lru_cache(maxsize=256)
def padded_rank_tokens(context: int, cp_size: int, page_size: int, page_aligned: bool, prefix: int = 0) -> int:
    """``T_pad``: the most tokens any rank computes (its two zigzag blocks of the extend), what every
    rank pads its all-gather to (cached by the arguments: a C-wide loop once per level and context,
    not per rank)."""
    blocks = zigzag_blocks(context, cp_size, page_size, page_aligned, prefix)
    n = len(blocks)
    return max(blocks[r] + blocks[n - 1 - r] for r in range(n // 2))


def rank_ranges(blocks: tuple[int, ...], rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Positions ``[start, stop)`` of rank ``r``'s two blocks: ``r`` ("prev") and ``2C-1-r`` ("next")."""
    other = len(blocks) - 1 - rank
    start, other_start = sum(blocks[:rank]), sum(blocks[:other])
    return (start, start + blocks[rank]), (other_start, other_start + blocks[other])


def local_queries(
    context: int, cp_size: int, page_size: int, level: int, rank: int, split_mode: str = "in-seq", prefix: int = 0
) -> int:
    """Tokens ``rank`` computes at phase ``level``: its two zigzag blocks of the extend (page-aligned
    from level 4), or round-robin's positions ``rank (mod C)``."""
    if split_mode == "round-robin":
        return round_robin_queries(context - prefix, cp_size, rank)
    blocks = zigzag_blocks(context, cp_size, page_size, level >= 4, prefix)
    return sum(b - a for a, b in rank_ranges(blocks, rank))


def round_robin_queries(context: int, cp_size: int, rank: int) -> int:
    """Positions ``rank, rank + C, ...`` below ``context``: what round-robin gives ``rank``."""
    return max(0, -(-(context - rank) // cp_size))


def round_robin_visible_keys(context: int, cp_size: int, rank: int) -> int:
    """Causal keys seen by round-robin's queries on ``rank``: ``sum(t + 1)`` over ``t = rank + i C``,
    ``n (rank + 1) + C n (n - 1) / 2`` for its ``n`` queries."""
    n = round_robin_queries(context, cp_size, rank)
    return n * (rank + 1) + cp_size * n * (n - 1) // 2


def visible_keys(ranges: tuple[tuple[int, int], ...]) -> int:
    """Causal keys seen by the queries at positions ``[a, b)``: query ``j`` sees ``j + 1`` keys.

    ``sum(j + 1 for j in [a, b)) = (b (b + 1) - a (a + 1)) / 2``; for ``[0, 8192)`` that is
    ``8192 x 8193 / 2 = 33,558,528``.
    """
    return sum((b * (b + 1) - a * (a + 1)) // 2 for a, b in ranges)


def owned_tokens(context: int, rank: int, cp_size: int, page_size: int) -> int:
    """Tokens of the request stored on ``rank`` when pages are sharded: owned pages x ``P``, less
    the unfilled tail of the last page when ``rank`` owns it."""
    pages = -(-context // page_size)
    tokens = owned_page_count(pages, rank, cp_size) * page_size
    return tokens - (pages * page_size - context) if pages and (pages - 1) % cp_size == rank else tokens


# --------------------------------------------------------------------------------------------
# Compute: FLOPs, and time at a rate
# --------------------------------------------------------------------------------------------


def ms_for_flops(flops: float, tflops: float) -> float:
    """``flops / (tflops x 1e12)`` seconds, in ms: ``flops / tflops / 1e9``."""
    return flops / tflops / 1e9


def ms_for_bytes(nbytes: float, gbps: float) -> float:
    """``nbytes / (gbps x 1e9)`` seconds, in ms: ``nbytes / gbps / 1e6``."""
    return nbytes / gbps / 1e6


def attention_flops(cfg: ModelConfig, t_local: int, context: int) -> float:
    """Sparse MLA FLOPs as FlashMLA counts them: ``2 x T_local x K x H x (576 + 512)``, ``K = min(topk, S)``.

    DeepSeek-V3.2, ``T_local = 16384``: ``2 x 16384 x 2048 x 128 x 1088 = 9.35e12``.
    """
    topk = min(cfg.index_topk, context)
    return 2.0 * t_local * topk * cfg.n_heads * (cfg.kv_width + cfg.kv_lora_rank)


def indexer_flops(cfg: ModelConfig, n_visible: int) -> float:
    """Indexer logits FLOPs: ``2 x Hi x D x sum(visible keys)`` (``2 x 64 x 128 x ...`` for V3.2)."""
    return 2.0 * cfg.index_n_heads * cfg.index_head_dim * n_visible


def topk_ms(rates: PlannerRates, t_local: int, context: int) -> float:
    """Top-k time scaled linearly in the logits matrix size: ``topk_ms x (T_local x S) / (T_ref x S_ref)``."""
    return rates.topk_ms * (t_local * context) / (rates.topk_ref_queries * rates.topk_ref_keys)


def projection_macs(cfg: ModelConfig, indexer: bool = True) -> dict[str, int]:
    """Multiply-adds per token of each linear map of the attention slice (DeepSeek-V3.2 names).

    ``wkv_b`` runs absorbed: ``q_nope`` (``H x nope``) into the latent (``H x nope x kv_lora``) and
    the attention output back (``H x kv_lora x v``). V3.2 sums to 201,064,448 per token.
    ``indexer=False``: an IndexShare shared layer, without the indexer's three maps.
    """
    h, c = cfg.n_heads, cfg.kv_lora_rank
    macs = {
        "wq_a": cfg.dim * cfg.q_lora_rank,
        "wq_b": cfg.q_lora_rank * h * cfg.qk_head_dim,
        "wkv_a": cfg.dim * cfg.kv_width,
        "wkv_b (absorb q)": h * cfg.qk_nope_head_dim * c,
        "wkv_b (absorb out)": h * c * cfg.v_head_dim,
        "wo": h * cfg.v_head_dim * cfg.dim,
        "indexer.wq_b": cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim,
        "indexer.wk": cfg.dim * cfg.index_head_dim,
        "indexer.weights_proj": cfg.dim * cfg.index_n_heads,
    }
    return macs if indexer else {k: v for k, v in macs.items() if not k.startswith("indexer.")}


def projection_flops(cfg: ModelConfig, t_local: int, indexer: bool = True) -> float:
    """GEMM FLOPs for ``T_local`` tokens: ``2 x T_local x sum(projection_macs)``."""
    return 2.0 * t_local * sum(projection_macs(cfg, indexer).values())


# --------------------------------------------------------------------------------------------
# Data movement: bytes per layer (counted as bench/kernels.py counts them)
# --------------------------------------------------------------------------------------------


def gather_row_bytes(cfg: ModelConfig, indexer: bool = True) -> int:
    """Bytes of one token in all-gather #1: ``(576 + 128) x 2 = 1408`` (bf16); ``576 x 2`` on an
    IndexShare shared layer (``indexer=False``), which gathers no index K."""
    return (cfg.kv_width + (cfg.index_head_dim if indexer else 0)) * ACT_BYTES


def allgather1_bytes(cfg: ModelConfig, cp_size: int, t_pad: int, indexer: bool = True) -> int:
    """Bytes one rank receives in all-gather #1: ``(C - 1) x T_pad x 1408`` (every slot padded to ``T_pad``)."""
    return (cp_size - 1) * t_pad * gather_row_bytes(cfg, indexer)


def rerange_bytes(cfg: ModelConfig, tokens: int) -> tuple[int, int]:
    """(KV, index) bytes of the rerange to sequence order, read + written: ``T x 576 x 2 x 2``, ``T x 128 x 2 x 2``."""
    return tokens * cfg.kv_width * ACT_BYTES * 2, tokens * cfg.index_head_dim * ACT_BYTES * 2


def store_bytes(cfg: ModelConfig, layout: KVLayout, rows: int) -> tuple[int, int]:
    """(MLA, index) bytes of quantize + pack + scatter of ``rows`` tokens: bf16 in, cache bytes out.

    FP8: ``rows x (1152 + 656)`` and ``rows x (256 + 132)``.
    """
    return rows * (cfg.kv_width * ACT_BYTES + layout.mla_bytes), rows * (
        cfg.index_head_dim * ACT_BYTES + layout.index_bytes
    )


def fill_bytes(cfg: ModelConfig, layout: KVLayout, rows: int, indexer: bool = True) -> int:
    """Bytes of phase 7's fused current-rows fill of ``rows`` view rows, as ``bench.glue`` counts them:
    the gathered bf16 row and index K and the row id read, the bf16 view row, FP8 index K and scale
    written (the index K parts not on an IndexShare shared layer)."""
    index = 128 * 2 + layout.index_bytes if indexer else 0
    return rows * (cfg.kv_width * 2 + 8 + cfg.kv_width * 2 + index)


def view_bytes(cfg: ModelConfig, layout: KVLayout, rows: int, indexer: bool = True) -> int:
    """Bytes of building ``rows`` full-view rows from cache bytes: ``rows x (656 + 132 + 1152 + 132)`` in FP8
    (packed MLA and index read, bf16 view and index written), as ``materialize_fp8`` is benchmarked
    (without the index K parts on an IndexShare shared layer)."""
    index = 2 * layout.index_bytes if indexer else 0
    return rows * (layout.mla_bytes + cfg.kv_width * 2 + index)


def materialize_comm_bytes(
    context: int, cp_size: int, page_size: int, one_page_bytes: int, interleave: int | None = None
) -> int:
    """Bytes one rank receives in phase 2's materialize all-gather of every page:
    ``(C - 1) x ceil(pages / C) x page_bytes`` (slots padded to the largest owner; at another
    ``interleave``, the physical pages rank 0 holds)."""
    pages = -(-context // page_size)
    held = Ownership(cp_size, interleave or page_size, page_size).pages_held(pages, 0)
    return (cp_size - 1) * held * one_page_bytes


def transient_bytes(
    cfg: ModelConfig,
    context: int,
    level: int,
    kv_dtype: KVDtype = "fp8",
    page_size: int = 64,
    act_bytes: int = ACT_BYTES,
    cp_size: int = 1,
    interleave: int | None = None,
    prefix: int = 0,
) -> int:
    """Transient bytes of one layer, as the engine's ``transient_peak_bytes`` counts them, for a
    chunk of ``context - prefix`` tokens after ``prefix`` cached ones (0: current-only).

    ``T x (576 + 128) x act_bytes`` (gathered chunk, ``T = context - prefix``) + ``S x (576 x 2 +
    132)`` (bf16 full view and FP8 index, ``S = context``) + the gathered pages: at level 2 every
    page (at a finer ``interleave``, every rank's physical pages: up to one more per rank); from
    level 3 the history pages (those holding the prefix; none for a current-only batch), and at
    level 8 also the second alternating view buffer of the prefetch (``S x 576 x 2``).
    """
    gathered = (context - prefix) * (cfg.kv_width + cfg.index_head_dim) * act_bytes
    view = context * (cfg.kv_width * 2 + cfg.index_head_dim + 4)
    one_page = page_bytes(cfg, kv_dtype, page_size)
    if level == 2:
        n_pages = -(-context // page_size)
        if interleave not in (None, page_size):
            n_pages = sum(Ownership(cp_size, interleave, page_size).pages_held(n_pages, r) for r in range(cp_size))
        return gathered + view + n_pages * one_page
    if level < 3 or prefix == 0:
        return gathered + view
    history = -(-prefix // page_size) * one_page
    second_view = context * cfg.kv_width * 2 if level >= 8 else 0
    return gathered + view + history + second_view


def activation_bytes(cfg: ModelConfig, t_local: int, context: int, act_bytes: int = ACT_BYTES) -> int:
    """Peak bytes of one layer's activations on a rank besides the transient buffers, as the engine
    allocates them (``DSAAttention.project`` / ``attend``), for ``t_local`` queries over ``context`` keys.

    Live through the layer: the residual ``x``, the projections (``q [T, H, 576]``, ``kv``, index
    K, FP8 index q and head weights) and the top-k result ``[T, K]`` int32. Then the larger of two
    phases: the indexer's tile (:func:`reference_impl.kernels.indexer_triton.indexer_tile_bytes`:
    one row chunk's fp32 logits buffer under 1 GiB, at most ``131072 + K`` columns however long the
    context, the selection kernel's candidate slots and, past one tile, the running top-k), or the
    attention's output ``[T, H, 512]``, the ``[T, H, 128]`` value product and the output
    projection's ``[T, dim]``. ``scripts/memory_peak.py`` lists what is alive at the measured peak:
    these tensors.
    """
    from reference_impl.kernels.indexer_triton import indexer_tile_bytes

    h, hi, k = cfg.n_heads, cfg.index_n_heads, cfg.index_topk
    live = t_local * (
        cfg.dim * act_bytes
        + h * cfg.kv_width * act_bytes
        + (cfg.kv_width + cfg.index_head_dim) * act_bytes
        + hi * cfg.index_head_dim
        + hi * 4
        + k * 4
    )
    indexer = indexer_tile_bytes(t_local, context, k)
    attention = t_local * (h * cfg.kv_lora_rank + h * cfg.v_head_dim + cfg.dim) * act_bytes
    return live + max(indexer, attention)


# --------------------------------------------------------------------------------------------
# Per-layer time of one rank at one phase level
# --------------------------------------------------------------------------------------------


def compute_terms(
    cfg: ModelConfig, rates: PlannerRates, t_local: int, context: int, n_visible: int, indexer: bool = True
) -> dict[str, float]:
    """Milliseconds of a layer's compute on a rank: ``t_local`` queries over ``context`` keys, ``n_visible``
    causal (query, key) pairs for the indexer; what every phase level and KV design shares. An IndexShare
    shared layer (``indexer=False``) projects no indexer query or key and runs no logits or top-k."""
    return {
        "projections": ms_for_flops(projection_flops(cfg, t_local, indexer), rates.matmul_tflops),
        "indexer_logits": ms_for_flops(indexer_flops(cfg, n_visible), rates.indexer_logits_tflops) if indexer else 0.0,
        "indexer_topk": topk_ms(rates, t_local, context) if indexer else 0.0,
        "attention": ms_for_flops(attention_flops(cfg, t_local, context), rates.attention_tflops),
        # Norms, RoPE, casts, quantization, copies of the rank's tokens (planner.elementwise).
        "elementwise": rates.elementwise_us_per_token * t_local / 1e3,
    }


def layer_terms(
    cfg: ModelConfig,
    rates: PlannerRates,
    cp_size: int,
    context: int,
    level: int,
    rank: int,
    kv_dtype: KVDtype = "fp8",
    page_size: int = 64,
    split_mode: str = "in-seq",
    *,
    indexer: bool = True,
    prefix: int = 0,
) -> dict[str, float]:
    """Milliseconds of each part of one layer on ``rank`` at phase ``level`` (see the module docstring).

    ``split_mode="round-robin"``: rank ``r`` computes positions ``t = r (mod C)`` and, with the KV
    sharded at interleave 1 (level >= 2), writes them directly; its level ``k`` runs phases
    ``1..k`` without 4 and 5. ``indexer=False``: an IndexShare shared layer, which projects,
    gathers, stores and materializes no indexer K and computes no logits or top-k (its elementwise
    term keeps the full layer's rate: an overestimate).

    ``prefix > 0``: a later chunk of a chunked prefill (in-seq), ``context - prefix`` new tokens
    after ``prefix`` cached ones. Its queries see the prefix too; from level 3 the history (the
    prefix's pages) is materialized into the view (levels 3-6 at the torch rate, 7 by the fused
    kernel; at level 8 the prefetch hides its MLA part behind the layer before, counted as fully
    hidden) and, on a real group, its pages cross the interconnect.
    """
    layout = KVLayout.from_config(cfg, kv_dtype, page_size)
    round_robin = split_mode == "round-robin"
    extend = context - prefix
    if round_robin:
        if prefix:
            raise ValueError("the planner models a prefix for the in-seq split only")
        t_local = round_robin_queries(context, cp_size, rank)
        t_pad = round_robin_queries(context, cp_size, 0)
        n_visible = round_robin_visible_keys(context, cp_size, rank)
    else:
        blocks = zigzag_blocks(context, cp_size, page_size, level >= 4, prefix)
        ranges = rank_ranges(blocks, rank)
        t_local = sum(b - a for a, b in ranges)
        t_pad = padded_rank_tokens(context, cp_size, page_size, level >= 4, prefix)
        n_visible = visible_keys(ranges) + prefix * t_local  # extend position j sees prefix + j + 1 keys
    fused, sharded = level >= 7, level >= 2
    direct = sharded and (round_robin or level >= 5)
    terms = {
        **compute_terms(cfg, rates, t_local, context, n_visible, indexer),
        "allgather1": ms_for_bytes(allgather1_bytes(cfg, cp_size, t_pad, indexer), rates.interconnect_gbps),
    }
    kv_b, index_b = rerange_bytes(cfg, extend)
    index_b = index_b if indexer else 0
    terms["rerange"] = ms_for_bytes(kv_b, rates.gbps("rerange_kv", fused)) + ms_for_bytes(
        index_b, rates.gbps("rerange_index", fused)
    )
    # Rows this rank writes: the whole chunk (replica), its owned pages' tokens picked from the
    # gathered chunk (in-seq levels 2-4), or the rows it computed, written directly (in-seq level
    # >= 5, round-robin level >= 2).
    owned_new = owned_tokens(context, rank, cp_size, page_size) - owned_tokens(prefix, rank, cp_size, page_size)
    rows = extend if not sharded else t_local if direct else owned_new
    mla_b, index_b = store_bytes(cfg, layout, rows)
    index_b = index_b if indexer else 0
    terms["select"] = (
        ms_for_bytes(rows * gather_row_bytes(cfg, indexer) * 2, rates.copy_gbps) if sharded and not direct else 0.0
    )
    terms["store"] = ms_for_bytes(mla_b, rates.gbps(f"store_mla_{kv_dtype}", fused)) + ms_for_bytes(
        index_b, rates.gbps("store_index", fused)
    )
    remap_scale = extend / rates.remap_ref_tokens
    if not sharded:
        terms["remap"] = 0.0  # physical == logical
    elif level < 6:
        terms["remap"] = 2 * rates.remap_sort_ms * remap_scale
    else:
        terms["remap"] = rates.remap_page_inverse_ms * remap_scale / cfg.n_layers
    one_page = page_bytes(cfg, kv_dtype, page_size, index=indexer)
    index_page = layout.index_bytes * page_size if indexer else 0
    if level == 2:
        comm = materialize_comm_bytes(context, cp_size, page_size, one_page, 1 if round_robin else None)
    elif sharded and prefix:  # the history pages; at level 8 their MLA part is prefetched (hidden)
        comm = materialize_comm_bytes(prefix, cp_size, page_size, one_page if level < 8 else index_page)
    else:
        comm = 0
    terms["materialize_comm"] = ms_for_bytes(comm, rates.interconnect_gbps)
    # The view's S rows come from the local replica (levels 0-1), gathered pages (level 2) or the
    # gathered chunk and the history pages (level >= 3), on the torch path below level 7; from
    # level 7 phase 7's fused current-rows fill writes the chunk's rows and the fused materialize
    # the history's (at level 8 only its index part: the prefetch wrote the MLA rows).
    if fused:
        history = (
            view_bytes(cfg, layout, prefix, indexer)
            if level < 8
            else prefix * 2 * (layout.index_bytes if indexer else 0)
        )
        terms["full_view"] = ms_for_bytes(
            fill_bytes(cfg, layout, extend, indexer), rates.fill_current_fused_gbps
        ) + ms_for_bytes(history, rates.gbps("materialize", fused=True))
    else:
        terms["full_view"] = ms_for_bytes(
            view_bytes(cfg, layout, context, indexer), rates.gbps("materialize", fused=False)
        )
    return terms


def mean_layer_terms(
    cfg: ModelConfig,
    rates: PlannerRates,
    cp_size: int,
    context: int,
    level: int,
    rank: int,
    kv_dtype: KVDtype = "fp8",
    page_size: int = 64,
    split_mode: str = "in-seq",
) -> dict[str, float]:
    """:func:`layer_terms` averaged over the model's layers: IndexShare's full and shared layers
    weighted by their counts (every layer full: the full layer's terms)."""
    share = cfg.index_share
    full = layer_terms(cfg, rates, cp_size, context, level, rank, kv_dtype, page_size, split_mode)
    if not share.shares:
        return full
    shared = layer_terms(cfg, rates, cp_size, context, level, rank, kv_dtype, page_size, split_mode, indexer=False)
    n_full, n = share.n_full, share.n_layers
    return {k: (n_full * full[k] + (n - n_full) * shared[k]) / n for k in full}


def slowest_rank(
    cfg: ModelConfig,
    rates: PlannerRates,
    cp_size: int,
    context: int,
    level: int,
    kv_dtype: KVDtype = "fp8",
    page_size: int = 64,
    split_mode: str = "in-seq",
) -> tuple[int, dict[str, float]]:
    """The rank with the longest layer (averaged over the model's layers, :func:`mean_layer_terms`)
    and its terms (ties: the lowest rank)."""
    best: tuple[int, dict[str, float]] | None = None
    for rank in range(cp_size):
        terms = mean_layer_terms(cfg, rates, cp_size, context, level, rank, kv_dtype, page_size, split_mode)
        if best is None or sum(terms.values()) > sum(best[1].values()) + 1e-12:
            best = (rank, terms)
    assert best is not None
    return best


def tail_ms(
    cfg: ModelConfig, rates: PlannerRates, cp_size: int, context: int, level: int, page_size: int = 64
) -> float:
    """All-gather #2 once per forward: ``(C - 1) x rows x hidden x 2`` B over the interconnect,
    ``rows = T_pad`` at level 0 and 1 (the last token of the one request) from level 1."""
    rows = padded_rank_tokens(context, cp_size, page_size, level >= 4) if level == 0 else 1
    return ms_for_bytes((cp_size - 1) * rows * cfg.dim * ACT_BYTES, rates.interconnect_gbps)

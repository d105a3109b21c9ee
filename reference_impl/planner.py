"""Capacity planner: KV bytes, max context and per-layer time per rank, for every phase level.

``python -m reference_impl plan --preset deepseek-v3.2 --cp 8 --hbm-gib 141`` prints it. Nothing
here is timed: memory is arithmetic on the real byte layouts (:mod:`reference_impl.capacity`) and
time is FLOPs or bytes divided by rates measured on an H200 (:class:`PlannerRates`, loaded from
``docs/results/compute_bench.json`` and ``kernels_bench.json``), plus one assumed interconnect
bandwidth. Every figure is a prediction, for levels that are built and for those that are not.

**Scenario.** One request of ``S`` tokens prefilled in one chunk (no prefix, so ``T = S`` current
tokens), in-seq (zigzag) split over ``C`` ranks: token-balanced blocks below level 4, page-aligned
blocks from level 4. Times are those of the slowest rank.

**Memory per rank.**

* KV at rest: levels 0-1 replicated (``kv_bytes_per_rank(..., sharded=False)``), levels >= 2
  sharded (rank 0, which owns ``ceil(pages / C)`` pages). Phase 5's allocator slack (a few pages
  of id space) is not counted.
* Max context: :func:`~reference_impl.capacity.max_context_per_rank` for the KV budget
  ``hbm_gib - reserved_gib`` (or ``hbm_gib * kv_budget_fraction``). The reserved part stands for
  weights, activations and workspace. Its default, 93 GiB whatever the preset and ``C``, is an
  assumption (DeepSeek-V3.2's 671e9 FP8 weight bytes over 8 GPUs, 78 GiB, plus 15 GiB): it leaves
  48 GiB of a 141 GiB GPU for KV, the budget the phase 2 walkthrough uses. Pass your own.
* Transient per layer (what a layer holds besides the pool, counted as the engine counts it): the
  gathered chunk ``T x (576 + 128) x 2`` B (bf16), the full view ``S x (576 x 2 + 132)`` B, and at
  level 2 the gathered pages ``pages x page_bytes``. From level 3 a current-only batch gathers no page.

**Time per layer per rank** = compute + data movement, added (no overlap assumed):

* sparse MLA: ``2 x T_local x topk x H x (576 + 512)`` FLOPs / attention TFLOPS;
* indexer: ``2 x Hi x D x sum(visible keys of local queries)`` FLOPs / logits TFLOPS, and top-k:
  the measured ms scaled linearly in ``T_local x S``;
* projections: the GEMM FLOPs of the layer's linear maps for ``T_local`` tokens / bf16 matmul TFLOPS;
* all-gather #1: ``(C - 1) x T_pad x 1408`` B received, over the interconnect (assumed, 450 GB/s);
* rerange and store: bytes as the kernel benchmark counts them (each byte read and written once)
  / GB/s of the torch path below level 7, of the fused kernels from level 7, except the FP8 MLA
  store, which this package keeps on torch (:data:`FUSED_FP8_MLA_STORE`);
* full-view build: ``S x (mla_bytes + 132 + 1152 + 132)`` B at the torch materialize GB/s at every
  level: its rows come from the replica (0-1), gathered pages (2) or the gathered chunk (>= 3),
  none through the fused materialize kernel, which serves history pages only;
* level 2 only: the materialize all-gather, ``(C - 1) x max owned pages x page_bytes``, over the
  interconnect (from level 3 a current-only batch materializes nothing);
* levels 2-4: selecting the owned rows from the gathered chunk, at device copy GB/s;
* levels 2-5: remap with sort + searchsorted, two calls per layer (MLA and indexer writes); from
  level 6 the page-inverse remap once per forward, shared by all layers.

Not modeled: the MoE/MLP half of the layer, norms, RoPE, the Hadamard rotation and q quantization,
kernel launch overheads, and any overlap of compute with communication. Phase 8 hides history
materialization, which is zero in this scenario, so level 8 predicts the same as level 7. The tail
gather runs once per forward and is reported apart (level 0: ``T_pad`` rows per rank, from level 1
one row).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference_impl.capacity import kv_bytes_per_rank, max_context_per_rank, page_bytes
from reference_impl.config import IMPLEMENTED_PHASES, PHASE_NAMES, ConfigError, KVDtype, ModelConfig, get_preset
from reference_impl.cp.ownership import owned_page_count
from reference_impl.cp.page_aligned import page_aligned_block_sizes
from reference_impl.cp.split import in_seq_block_sizes
from reference_impl.kvcache.layout import KVLayout, validate_page_size

GIB = 2**30
ACT_BYTES = 2  # bf16 activations on the GPU
RESULTS_DIR = Path(__file__).resolve().parent.parent / "docs" / "results"
DEFAULT_RESERVED_GIB = 93.0
DEFAULT_CONTEXTS = (8192, 131072, 1048576)
LEVELS = tuple(range(9))
# Phase 7 keeps the FP8 MLA store on the torch path on CUDA (kernels/cp_dispatch.fused_store: the
# kernel's bytes differed from torch's on the H200); the BF16 MLA and index stores are fused.
FUSED_FP8_MLA_STORE = False

# --------------------------------------------------------------------------------------------
# Inputs: measured rates and assumptions
# --------------------------------------------------------------------------------------------

_COMPUTE, _KERNELS = "compute_bench.json", "kernels_bench.json"
# Where each measured rate lives in the benchmark JSONs. "list[k=v,T=max]" picks, among the list's
# entries with k == v, the one with the largest T (the longest measured sequence).
_RATE_PATHS: dict[str, tuple[str, str]] = {
    "attention_tflops": (_COMPUTE, "per_rank.attention.triton_tflops"),
    "indexer_logits_tflops": (_COMPUTE, "per_rank.indexer.logits_tflops"),
    "topk_ms": (_COMPUTE, "per_rank.indexer.topk_ms"),
    "topk_ref_queries": (_COMPUTE, "per_rank.indexer.T"),
    "topk_ref_keys": (_COMPUTE, "per_rank.indexer.S"),
    "matmul_tflops": (_COMPUTE, "bf16_matmul_8192_tflops"),
    "copy_gbps": (_KERNELS, "copy.gbps"),
    **{
        f"{op}_{impl}_gbps": (_KERNELS, f"kernels[op={bench_op},T=max].{bench_impl}_gbps")
        for op, bench_op in (
            ("store_mla_fp8", "store_mla_fp8"), ("store_mla_bf16", "store_mla_bf16"), ("store_index", "store_index"),
            ("rerange_kv", "rerange_kv"), ("rerange_index", "rerange_index"), ("materialize", "materialize_fp8"),
        )
        for impl, bench_impl in (("torch", "torch"), ("fused", "triton"))
    },
    "remap_sort_ms": (_KERNELS, "remap[T=max].sorted_ms"),
    "remap_page_inverse_ms": (_KERNELS, "remap[T=max].page_inverse_ms"),
    "remap_ref_tokens": (_KERNELS, "remap[T=max].T"),
}
_ASSUMED = {
    "interconnect_gbps": "assumption: NVLink 4, 450 GB/s per direction per GPU (peak, not measured; "
    "NCCL all-gathers reach less)",
}


@dataclass(frozen=True)
class PlannerRates:
    """Rates the time model divides by. Defaults: H200 values (rounded copies of the JSONs).

    TFLOPS are 1e12 FLOP/s, GB/s are 1e9 B/s, ms are milliseconds. ``sources`` maps each field to
    where its value came from (``file: json path``, a built-in copy, or an assumption).
    """

    attention_tflops: float = 235.9  # sparse MLA, one rank of C=8 at 128K
    indexer_logits_tflops: float = 931.4
    topk_ms: float = 13.36  # torch.topk of [topk_ref_queries, topk_ref_keys] logits
    topk_ref_queries: float = 16384
    topk_ref_keys: float = 131072
    matmul_tflops: float = 783.7  # bf16 8192^3
    copy_gbps: float = 4221.1  # device copy, read + write
    store_mla_fp8_torch_gbps: float = 158.7
    store_mla_fp8_fused_gbps: float = 2340.6
    store_mla_bf16_torch_gbps: float = 713.6
    store_mla_bf16_fused_gbps: float = 3419.3
    store_index_torch_gbps: float = 123.4
    store_index_fused_gbps: float = 2653.2
    rerange_kv_torch_gbps: float = 3298.6
    rerange_kv_fused_gbps: float = 3705.2
    rerange_index_torch_gbps: float = 797.9
    rerange_index_fused_gbps: float = 3075.0
    materialize_torch_gbps: float = 159.0
    materialize_fused_gbps: float = 2993.6
    remap_sort_ms: float = 0.1155  # one sort + searchsorted call over remap_ref_tokens locs
    remap_page_inverse_ms: float = 0.0464
    remap_ref_tokens: float = 131072
    interconnect_gbps: float = 450.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "sources" and not getattr(self, f.name) > 0:
                raise ConfigError(f"rate {f.name}={getattr(self, f.name)!r} must be a positive number")
        sources = {
            f.name: _ASSUMED.get(f.name) or "built-in copy of the H200 value in {}: {}".format(*_RATE_PATHS[f.name])
            if getattr(self, f.name) == f.default else "given in code"
            for f in dataclasses.fields(self) if f.name != "sources"
        }
        sources.update(self.sources)
        object.__setattr__(self, "sources", sources)

    def gbps(self, op: str, fused: bool) -> float:
        """GB/s of a memory-bound op (``store_mla_fp8``, ``rerange_kv``, ...) on the chosen path."""
        return float(getattr(self, f"{op}_{'fused' if fused else 'torch'}_gbps"))

    def values(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sources"}

    def override(self, values: dict[str, Any], source: str) -> PlannerRates:
        """Replace some rates (``{field: number}``), recording ``source: field`` as their origin."""
        unknown = sorted(set(values) - set(self.values()))
        if unknown:
            raise ConfigError(f"{source}: unknown rate(s) {unknown}; known: {', '.join(sorted(self.values()))}")
        try:
            sourced = {k: (float(v), f"{source}: {k}") for k, v in values.items()}
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: rates must be numbers") from None
        return self.with_sourced(sourced)

    def with_sourced(self, sourced: dict[str, tuple[float, str]]) -> PlannerRates:
        """Replace rates from ``{field: (value, source)}``."""
        values = {k: v for k, (v, _) in sourced.items()}
        return dataclasses.replace(self, **values, sources={**self.sources, **{k: s for k, (_, s) in sourced.items()}})


def _lookup(doc: Any, path: str) -> tuple[Any, str]:
    """Resolve a ``_RATE_PATHS`` path in a benchmark JSON -> ``(value, path with T=max resolved)``."""
    resolved = []
    for part in path.split("."):
        key, _, flt = part.partition("[")
        doc = doc[key]
        if flt:
            conds = dict(c.split("=") for c in flt.rstrip("]").split(","))
            rows = [r for r in doc if all(str(r.get(k)) == v for k, v in conds.items() if v != "max")]
            doc = max(rows, key=lambda r: r["T"])
            part = part.replace("T=max", f"T={doc['T']}")
        resolved.append(part)
    return doc, ".".join(resolved)


def rates_from_bench(doc: dict[str, Any], file: str, label: str) -> dict[str, tuple[float, str]]:
    """The rates a benchmark JSON (``file`` is its kind, by name) provides -> ``{field: (value, source)}``."""
    out = {}
    for name, (kind, path) in _RATE_PATHS.items():
        if kind != file:
            continue
        try:
            value, where = _lookup(doc, path)
        except (KeyError, TypeError, ValueError, IndexError):
            raise ConfigError(f"{label}: no {path} in this {file}") from None
        out[name] = (float(value), f"{label}: {where}")
    return out


def load_rates(paths: list[str] | None = None, results_dir: Path | None = RESULTS_DIR) -> PlannerRates:
    """Defaults from ``results_dir`` (where the files exist), then each of ``paths`` in order.

    A file in ``paths`` is a ``compute_bench.json`` (has ``per_rank``), a ``kernels_bench.json``
    (has ``kernels``), or a flat ``{field: value}`` object of :class:`PlannerRates` fields.
    """
    rates = PlannerRates()
    found: dict[str, tuple[float, str]] = {}
    for name in (_COMPUTE, _KERNELS) if results_dir is not None else ():
        path = results_dir / name
        if path.is_file():
            label = f"docs/results/{name}" if results_dir == RESULTS_DIR else str(path)
            found.update(rates_from_bench(json.loads(path.read_text()), name, label))
    rates = rates.with_sourced(found)
    for path_str in paths or []:
        try:
            doc = json.loads(Path(path_str).read_text())
        except OSError as exc:
            raise ConfigError(f"--rates {path_str}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--rates {path_str}: not JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"--rates {path_str}: expected a JSON object")
        kind = _COMPUTE if "per_rank" in doc else _KERNELS if "kernels" in doc else None
        if kind is None:
            rates = rates.override(doc, path_str)
        else:
            rates = rates.with_sourced(rates_from_bench(doc, kind, path_str))
    return rates


# --------------------------------------------------------------------------------------------
# The split: local queries per rank
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def zigzag_blocks(context: int, cp_size: int, page_size: int, page_aligned: bool) -> tuple[int, ...]:
    """The ``2C`` block sizes of one request of ``context`` tokens (no prefix).

    Page-aligned (level >= 4) where the request has at least ``2C`` pages, else token-balanced.
    """
    if page_aligned:
        sizes = page_aligned_block_sizes(0, context, cp_size, page_size)
        if sizes is not None:
            return sizes
    return in_seq_block_sizes(context, cp_size)


def rank_ranges(blocks: tuple[int, ...], rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Positions ``[start, stop)`` of rank ``r``'s two blocks: ``r`` ("prev") and ``2C-1-r`` ("next")."""
    starts = [sum(blocks[:b]) for b in range(len(blocks))]
    other = len(blocks) - 1 - rank
    return (starts[rank], starts[rank] + blocks[rank]), (starts[other], starts[other] + blocks[other])


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


def projection_macs(cfg: ModelConfig) -> dict[str, int]:
    """Multiply-adds per token of each linear map of the attention slice (DeepSeek-V3.2 names).

    ``wkv_b`` runs absorbed: ``q_nope`` (``H x nope``) into the latent (``H x nope x kv_lora``) and
    the attention output back (``H x kv_lora x v``). V3.2 sums to 201,064,448 per token.
    """
    h, c = cfg.n_heads, cfg.kv_lora_rank
    return {
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


def projection_flops(cfg: ModelConfig, t_local: int) -> float:
    """GEMM FLOPs for ``T_local`` tokens: ``2 x T_local x sum(projection_macs)``."""
    return 2.0 * t_local * sum(projection_macs(cfg).values())


# --------------------------------------------------------------------------------------------
# Data movement: bytes per layer (counted as bench/kernels.py counts them)
# --------------------------------------------------------------------------------------------


def gather_row_bytes(cfg: ModelConfig) -> int:
    """Bytes of one token in all-gather #1: ``(576 + 128) x 2 = 1408`` (bf16)."""
    return (cfg.kv_width + cfg.index_head_dim) * ACT_BYTES


def allgather1_bytes(cfg: ModelConfig, cp_size: int, t_pad: int) -> int:
    """Bytes one rank receives in all-gather #1: ``(C - 1) x T_pad x 1408`` (every slot padded to ``T_pad``)."""
    return (cp_size - 1) * t_pad * gather_row_bytes(cfg)


def rerange_bytes(cfg: ModelConfig, tokens: int) -> tuple[int, int]:
    """(KV, index) bytes of the rerange to sequence order, read + written: ``T x 576 x 2 x 2``, ``T x 128 x 2 x 2``."""
    return tokens * cfg.kv_width * ACT_BYTES * 2, tokens * cfg.index_head_dim * ACT_BYTES * 2


def store_bytes(cfg: ModelConfig, layout: KVLayout, rows: int) -> tuple[int, int]:
    """(MLA, index) bytes of quantize + pack + scatter of ``rows`` tokens: bf16 in, cache bytes out.

    FP8: ``rows x (1152 + 656)`` and ``rows x (256 + 132)``.
    """
    return rows * (cfg.kv_width * ACT_BYTES + layout.mla_bytes), rows * (cfg.index_head_dim * ACT_BYTES + layout.index_bytes)


def view_bytes(cfg: ModelConfig, layout: KVLayout, rows: int) -> int:
    """Bytes of building ``rows`` full-view rows from cache bytes: ``rows x (656 + 132 + 1152 + 132)`` in FP8
    (packed MLA and index read, bf16 view and index written), as ``materialize_fp8`` is benchmarked."""
    return rows * (layout.mla_bytes + layout.index_bytes + cfg.kv_width * 2 + layout.index_bytes)


def materialize_comm_bytes(context: int, cp_size: int, page_size: int, one_page_bytes: int) -> int:
    """Bytes one rank receives in phase 2's materialize all-gather of every page:
    ``(C - 1) x ceil(pages / C) x page_bytes`` (slots padded to the largest owner)."""
    pages = -(-context // page_size)
    return (cp_size - 1) * owned_page_count(pages, 0, cp_size) * one_page_bytes


def transient_bytes(
    cfg: ModelConfig, context: int, level: int, kv_dtype: KVDtype = "fp8", page_size: int = 64, act_bytes: int = ACT_BYTES
) -> int:
    """Transient bytes of one layer, as the engine's ``transient_peak_bytes`` counts them.

    ``T x (576 + 128) x act_bytes`` (gathered chunk) + ``S x (576 x 2 + 132)`` (bf16 full view and
    FP8 index) + at level 2 ``pages x page_bytes`` (every page gathered; none from level 3 when the
    batch is current-only).
    """
    gathered = context * (cfg.kv_width + cfg.index_head_dim) * act_bytes
    view = context * (cfg.kv_width * 2 + cfg.index_head_dim + 4)
    pages = -(-context // page_size) * page_bytes(cfg, kv_dtype, page_size) if level == 2 else 0
    return gathered + view + pages


# --------------------------------------------------------------------------------------------
# Per-layer time of one rank at one phase level
# --------------------------------------------------------------------------------------------


def level_status(level: int) -> str:
    """``"built"`` when every phase of the cumulative level exists in this version."""
    return "built" if set(range(1, level + 1)) <= IMPLEMENTED_PHASES else "predicted, not built"


def layer_terms(
    cfg: ModelConfig, rates: PlannerRates, cp_size: int, context: int, level: int, rank: int,
    kv_dtype: KVDtype = "fp8", page_size: int = 64,
) -> dict[str, float]:
    """Milliseconds of each part of one layer on ``rank`` at phase ``level`` (see the module docstring)."""
    layout = KVLayout.from_config(cfg, kv_dtype, page_size)
    blocks = zigzag_blocks(context, cp_size, page_size, page_aligned=level >= 4)
    ranges = rank_ranges(blocks, rank)
    t_local = sum(b - a for a, b in ranges)
    t_pad = max(blocks[r] + blocks[len(blocks) - 1 - r] for r in range(cp_size))
    fused, sharded = level >= 7, level >= 2
    terms = {
        "projections": ms_for_flops(projection_flops(cfg, t_local), rates.matmul_tflops),
        "indexer_logits": ms_for_flops(indexer_flops(cfg, visible_keys(ranges)), rates.indexer_logits_tflops),
        "indexer_topk": topk_ms(rates, t_local, context),
        "attention": ms_for_flops(attention_flops(cfg, t_local, context), rates.attention_tflops),
        "allgather1": ms_for_bytes(allgather1_bytes(cfg, cp_size, t_pad), rates.interconnect_gbps),
    }
    kv_b, index_b = rerange_bytes(cfg, context)
    terms["rerange"] = ms_for_bytes(kv_b, rates.gbps("rerange_kv", fused)) + ms_for_bytes(
        index_b, rates.gbps("rerange_index", fused)
    )
    # Rows this rank writes: the whole chunk (replica), its owned pages' tokens picked from the
    # gathered chunk (levels 2-4), or the rows it computed, written directly (level >= 5).
    rows = context if not sharded else owned_tokens(context, rank, cp_size, page_size) if level < 5 else t_local
    mla_b, index_b = store_bytes(cfg, layout, rows)
    terms["select"] = ms_for_bytes(rows * gather_row_bytes(cfg) * 2, rates.copy_gbps) if 2 <= level < 5 else 0.0
    mla_fused = fused and (kv_dtype != "fp8" or FUSED_FP8_MLA_STORE)
    terms["store"] = ms_for_bytes(mla_b, rates.gbps(f"store_mla_{kv_dtype}", mla_fused)) + ms_for_bytes(
        index_b, rates.gbps("store_index", fused)
    )
    remap_scale = context / rates.remap_ref_tokens
    if not sharded:
        terms["remap"] = 0.0  # physical == logical
    elif level < 6:
        terms["remap"] = 2 * rates.remap_sort_ms * remap_scale
    else:
        terms["remap"] = rates.remap_page_inverse_ms * remap_scale / cfg.n_layers
    one_page = page_bytes(cfg, kv_dtype, page_size)
    comm = materialize_comm_bytes(context, cp_size, page_size, one_page) if level == 2 else 0
    terms["materialize_comm"] = ms_for_bytes(comm, rates.interconnect_gbps)
    # The view's S rows come from the local replica (levels 0-1), gathered pages (level 2) or the
    # gathered chunk (level >= 3, fill_current): all on the torch path. The fused materialize
    # kernel serves gathered history pages only, and a current-only batch has none from level 3.
    terms["full_view"] = ms_for_bytes(view_bytes(cfg, layout, context), rates.gbps("materialize", fused=False))
    return terms


def slowest_rank(
    cfg: ModelConfig, rates: PlannerRates, cp_size: int, context: int, level: int, kv_dtype: KVDtype = "fp8", page_size: int = 64
) -> tuple[int, dict[str, float]]:
    """The rank with the longest layer and its terms (ties: the lowest rank)."""
    best: tuple[int, dict[str, float]] | None = None
    for rank in range(cp_size):
        terms = layer_terms(cfg, rates, cp_size, context, level, rank, kv_dtype, page_size)
        if best is None or sum(terms.values()) > sum(best[1].values()) + 1e-12:
            best = (rank, terms)
    assert best is not None
    return best


def tail_ms(cfg: ModelConfig, rates: PlannerRates, cp_size: int, context: int, level: int, page_size: int = 64) -> float:
    """All-gather #2 once per forward: ``(C - 1) x rows x hidden x 2`` B over the interconnect,
    ``rows = T_pad`` at level 0 and 1 (the last token of the one request) from level 1."""
    blocks = zigzag_blocks(context, cp_size, page_size, page_aligned=level >= 4)
    rows = max(blocks[r] + blocks[len(blocks) - 1 - r] for r in range(cp_size)) if level == 0 else 1
    return ms_for_bytes((cp_size - 1) * rows * cfg.dim * ACT_BYTES, rates.interconnect_gbps)


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


def parse_contexts(spec: str) -> tuple[int, ...]:
    """``"8192,128K,1M"`` -> ``(8192, 131072, 1048576)`` (``K`` = 1024, ``M`` = 1024^2)."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        scale = {"k": 1024, "m": 1024**2}.get(item[-1].lower(), 1)
        try:
            out.append(int(item[:-1] if scale > 1 else item) * scale)
        except ValueError:
            raise ConfigError(f"malformed context {item!r} in --contexts: use integers like 8192, 128K or 1M") from None
    if not out:
        raise ConfigError(f"malformed --contexts {spec!r}: no context")
    return tuple(out)


@dataclass(frozen=True)
class PlanConfig:
    """The planner's knobs (each field is a CLI flag ``--field-name`` and ``DSACP_FIELD_NAME``).

    The KV budget per GPU is ``hbm_gib - reserved_gib`` GiB, or ``hbm_gib x kv_budget_fraction``
    when the fraction is given (then ``reserved_gib`` must be ``None``). ``reserved_gib`` stands for
    weights, activations and workspace; ``None`` for both means ``DEFAULT_RESERVED_GIB`` (93).
    """

    preset: str = "deepseek-v3.2"
    cp_size: int = 8
    hbm_gib: float = 141.0
    reserved_gib: float | None = None
    kv_budget_fraction: float | None = None
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    kv_dtype: KVDtype = "fp8"
    page_size: int = 64

    def __post_init__(self) -> None:
        get_preset(self.preset)
        if self.cp_size < 1:
            raise ConfigError(f"cp_size={self.cp_size}: need at least one rank")
        if not self.hbm_gib > 0:
            raise ConfigError(f"hbm_gib={self.hbm_gib}: HBM per GPU must be a positive number of GiB")
        if self.reserved_gib is not None and self.kv_budget_fraction is not None:
            raise ConfigError("give reserved_gib or kv_budget_fraction, not both")
        if self.kv_budget_fraction is not None and not 0 < self.kv_budget_fraction <= 1:
            raise ConfigError(f"kv_budget_fraction={self.kv_budget_fraction}: need a fraction in (0, 1]")
        if self.reserved_gib is not None and self.reserved_gib < 0:
            raise ConfigError(f"reserved_gib={self.reserved_gib}: need >= 0 GiB")
        if self.kv_budget_fraction is None and self.reserved >= self.hbm_gib:
            raise ConfigError(
                f"reserved_gib={self.reserved:g} (weights, activations) is not below hbm_gib={self.hbm_gib:g}: "
                "no HBM left for the KV cache"
            )
        if self.kv_dtype not in ("bf16", "fp8"):
            raise ConfigError(f"kv_dtype={self.kv_dtype!r}: use 'bf16' or 'fp8'")
        validate_page_size(self.page_size)
        small = [c for c in self.contexts if c < 2 * self.cp_size]
        if not self.contexts or small:
            raise ConfigError(f"contexts {small or '()'}: each needs at least 2C = {2 * self.cp_size} tokens")

    @property
    def reserved(self) -> float:
        return DEFAULT_RESERVED_GIB if self.reserved_gib is None else self.reserved_gib

    @property
    def kv_budget_bytes(self) -> int:
        if self.kv_budget_fraction is not None:
            return int(self.hbm_gib * self.kv_budget_fraction * GIB)
        return int((self.hbm_gib - self.reserved) * GIB)

    @property
    def budget_rule(self) -> str:
        if self.kv_budget_fraction is not None:
            return f"{self.hbm_gib:g} GiB HBM x {self.kv_budget_fraction:g}"
        default = " (default)" if self.reserved_gib is None else ""
        return f"{self.hbm_gib:g} GiB HBM - {self.reserved:g} GiB reserved for weights and activations{default}"


def plan_capacity(config: PlanConfig, rates: PlannerRates) -> dict[str, Any]:
    """Predictions for every phase level 0..8 at every context -> a JSON-ready dict.

    Per level: ``max_context`` (tokens of one request whose KV fits the budget on every rank) and,
    per context, ``kv_bytes_per_rank``, ``transient_bytes_per_layer``, ``fits`` (KV + transient
    within the budget), ``layer_ms`` with its ``terms_ms`` on ``slowest_rank``, and
    ``tail_ms_per_forward``.
    """
    cfg, c, dt, ps = get_preset(config.preset), config.cp_size, config.kv_dtype, config.page_size
    budget = config.kv_budget_bytes
    levels = []
    for level in LEVELS:
        sharded = level >= 2
        points = []
        for ctx in config.contexts:
            rank, terms = slowest_rank(cfg, rates, c, ctx, level, dt, ps)
            kv = kv_bytes_per_rank(cfg, ctx, c, sharded, dt, ps)
            transient = transient_bytes(cfg, ctx, level, dt, ps)
            points.append({
                "context": ctx, "kv_bytes_per_rank": kv, "transient_bytes_per_layer": transient,
                "fits": kv + transient <= budget, "layer_ms": sum(terms.values()), "slowest_rank": rank,
                "terms_ms": terms, "tail_ms_per_forward": tail_ms(cfg, rates, c, ctx, level, ps),
            })
        levels.append({
            "level": level, "adds": PHASE_NAMES.get(level, "baseline"), "status": level_status(level),
            "kv_at_rest": "sharded" if sharded else "replicated",
            "max_context": max_context_per_rank(cfg, budget, c, sharded, dt, ps), "contexts": points,
        })
    return {
        "inputs": {**dataclasses.asdict(config), "reserved_gib": None if config.kv_budget_fraction else config.reserved,
                   "kv_budget_bytes": budget, "budget_rule": config.budget_rule, "n_layers": cfg.n_layers,
                   "page_bytes": page_bytes(cfg, dt, ps), "max_seq_len": cfg.max_seq_len},
        "rates": {k: {"value": v, "source": rates.sources[k]} for k, v in rates.values().items()},
        "scenario": "one request of S tokens prefilled in one chunk (no prefix), in-seq split; slowest rank",
        "assumptions": _assumptions(config, cfg),
        "levels": levels,
    }


def _assumptions(config: PlanConfig, cfg: ModelConfig) -> list[str]:
    out = [
        f"KV budget: {config.budget_rule}; the reserved part is not modeled, only subtracted.",
        ("Terms are added: no overlap of compute and communication. Not modeled: the MoE/MLP half of the layer, "
         "norms, RoPE, Hadamard and q quantization, launch overheads."),
        (f"Projections: {sum(projection_macs(cfg).values()):,} multiply-adds per token at the bf16 8192^3 matmul "
         "rate (skinny or FP8 GEMMs run at other rates)."),
        "Top-k and remap scale linearly from their measured points (T_local x S, and T).",
        ("Levels 0-1 rebuild the full view from the local replica; from level 3 it is filled from the gathered "
         "chunk (no history), so phase 8 has nothing to prefetch and level 8 equals level 7."),
        ("Level >= 7: fused rerange and index store; the FP8 MLA store and the full-view fill stay on the torch "
         "path, as in this package."),
        ("Levels 2-5 remap with sort + searchsorted per layer (the production baseline phase 6 replaces; "
         "this package computes locs arithmetically)."),
    ]
    if config.kv_dtype == "bf16":
        out.append("The full-view build of a bf16 cache runs at the measured fp8 materialize rate (bf16 not measured).")
    if max(config.contexts) > cfg.max_seq_len:
        out.append(
            f"Contexts above the preset's max_seq_len ({cfg.max_seq_len:,}) exceed the model's trained context; "
            "the arithmetic still holds."
        )
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _rule(n_cells: int) -> str:
    return "|" + " --- |" * n_cells


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as text: memory, time and a per-term breakdown (one row per level), then the inputs."""
    inp, levels = plan["inputs"], plan["levels"]
    ctxs = [f"{c:,}" for c in inp["contexts"]]
    lines = [
        (f"Capacity plan: {inp['preset']}, C={inp['cp_size']}, {inp['kv_dtype']} KV, page {inp['page_size']}, "
         f"{inp['n_layers']} layers. Scenario: {plan['scenario']}."),
        (f"KV budget per GPU: {inp['budget_rule']} = {_gib(inp['kv_budget_bytes'])} GiB. "
         "Every figure is a prediction from the inputs listed at the end."),
        "",
        ("Memory per rank (GiB): KV at rest, all layers (* = KV + one layer's transient exceed the budget); "
         "transient of one layer; max context = longest request whose KV fits (tokens)"),
        _row("level", "adds", "status", *(f"KV @ {c}" for c in ctxs), *(f"transient @ {c}" for c in ctxs), "max context"),
        _rule(4 + 2 * len(ctxs)),
    ]
    for lv in levels:
        kv = [_gib(p["kv_bytes_per_rank"]) + ("" if p["fits"] else " *") for p in lv["contexts"]]
        tr = [_gib(p["transient_bytes_per_layer"]) for p in lv["contexts"]]
        lines.append(_row(lv["level"], lv["adds"], lv["status"], *kv, *tr, f"{lv['max_context']:,}"))
    lines += [
        "",
        ("Time (ms): one layer on the slowest rank (attention slice + CP data movement); "
         "all-gather #2 (tail) once per forward"),
        _row("level", "status", *(f"layer @ {c}" for c in ctxs), *(f"tail @ {c}" for c in ctxs)),
        _rule(2 + 2 * len(ctxs)),
    ]
    for lv in levels:
        layer = [f"{p['layer_ms']:.2f}" for p in lv["contexts"]]
        tail = [f"{p['tail_ms_per_forward']:.3g}" for p in lv["contexts"]]
        lines.append(_row(lv["level"], lv["status"], *layer, *tail))
    last = inp["contexts"][-1]
    names = list(levels[0]["contexts"][-1]["terms_ms"])
    lines += ["", f"Per-layer terms at {last:,} tokens (ms, slowest rank)", _row("level", *names), _rule(1 + len(names))]
    for lv in levels:
        terms = lv["contexts"][-1]["terms_ms"]
        lines.append(_row(lv["level"], *(f"{terms[n]:.3f}" for n in names)))
    lines += ["", "Inputs (rate = value: source)"]
    lines += [f"  {k} = {v['value']:g}: {v['source']}" for k, v in plan["rates"].items()]
    lines += ["Assumptions"] + [f"  {a}" for a in plan["assumptions"]]
    return "\n".join(lines)

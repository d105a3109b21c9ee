"""The DSA family's memory model: an upper bound of a run's peak per process, by arithmetic
(:func:`reference_impl.footprint.check_fits` compares it with what the machine has free).

**The model** (bytes; ``b`` the compute dtype's bytes, 4 for float32 on CPU, 2 for bf16; ``L``
layers; ``row`` one token's cache bytes in one layer, MLA row + index K + scale; ``T``, ``S`` the
queries and keys of one layer call). Every process of a run holds

* ``base``: what a process costs before any tensor (:data:`PROCESS_BASE`: a forked CPU rank's own
  pages, gloo's buffers and threads; a spawned one imports torch again; a CUDA context) and the
  host metadata of every token (:data:`METADATA_PER_TOKEN`), then
* the model's weights and every request's layer-0 inputs (each rank builds them all from the seed);

and on top of that the largest of its stages (they follow one another; each stage is bounded by
all it holds at once):

* a **rank** first installs the prefixes: the single-device oracle over every prefix (dense caches
  of all of them, ``2 x L x P x row`` with the append's copy, plus one layer's work :func:`layer_bytes`
  over the longest prefix); then holds its pools (replicated, or its owned pages with phase 2) and
  runs the layer loop: one layer's work over its local queries ``T_local`` (an upper bound over
  every chunk) against the chunk's full view, the gathered chunk and the full view itself
  (bf16 plus the dequantization's float32 rows); then ships its result, every row it stores (check
  runs) with its hidden states and top-k, pickled (twice: the objects and their bytes).
* the **parent** (the launching process) runs the oracle when ``check`` is on: dense caches of every
  token of every layer, the extend tokens' projections it keeps for the comparison, one layer's work
  over the longest span; and it holds every rank's result (unpickled) while comparing.

:func:`layer_bytes` is one layer's work on the torch paths (what CPU ranks run; the GPU kernels hold
less): the projections of ``T`` tokens (queries, the absorbed query ``[T, H, 576]``, the indexer's
query in float32 before its FP8 cast), the indexer's top-k, which works on chunks of query rows
whose float32 logits ``[rows, Hi, S]`` stay under 512 MiB (twice: the einsum's copy) plus the keys
in float32 ``[S, D]``, and the sparse attention, chunked the same way, with its outputs.

Then a safety factor, :data:`SAFETY` (1.25), over everything: allocator slack and temporaries too
small to list. ``tests/test_footprint.py`` measures the peak resident memory of each process of
real runs (fork, ``/proc/self/status`` ``VmHWM``) and checks that the estimate is above it, and
not absurdly so. A run this lets through can still fail to fit when other programs take memory
while it runs; one it refuses would not have fit.

What is compared (:func:`free_bytes`): on CPU the host's available memory (``MemAvailable``, within
the cgroup's limit when one is set), against the sum over every process; on CUDA each device's
free memory against the ranks sharing it plus the oracle (on device 0), and the host against the
processes' host side.
"""

from __future__ import annotations

from reference_impl.config import RunConfig
from reference_impl.cp.ownership import Ownership
from reference_impl.footprint import (
    CHUNK_CAP,
    CUDA_CONTEXT,
    METADATA_PER_TOKEN,
    PROCESS_BASE,
    SAFETY,
    Footprint,
    local_queries,
)
from reference_impl.kvcache.layout import KVLayout
from reference_impl.presets import ModelConfig


def param_count(cfg: ModelConfig) -> int:
    """Parameters of ``cfg``'s model: ``n_layers`` DSA layers (MLA + indexer), the norms, the LM head."""
    h, qk, c, r = cfg.n_heads, cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    per_layer = (
        cfg.dim * cfg.q_lora_rank
        + cfg.q_lora_rank * h * qk  # wq_a, wq_b
        + cfg.dim * (c + r)
        + c * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # wkv_a, wkv_b
        + h * cfg.v_head_dim * cfg.dim  # wo
        + 3 * cfg.dim
        + cfg.q_lora_rank
        + c  # norms
    )
    indexer = (  # IndexShare: full layers only
        cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
        + cfg.dim * cfg.index_head_dim
        + cfg.dim * cfg.index_n_heads
        + 2 * cfg.index_head_dim  # wq_b, wk, weights_proj, k_norm
    )
    return cfg.n_layers * per_layer + cfg.index_share.n_full * indexer + cfg.vocab_size * cfg.dim + cfg.dim


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> tuple[int, int]:
    """``(the parameters in the compute dtype, the transient of their initialization)``: each
    parameter is drawn in float32 and cast (:func:`~reference_impl.model.oracle.init_weights`)."""
    largest = max(
        cfg.vocab_size * cfg.dim,
        cfg.n_heads * cfg.v_head_dim * cfg.dim,
        cfg.q_lora_rank * cfg.n_heads * cfg.qk_head_dim,
        cfg.kv_lora_rank * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
    )
    return param_count(cfg) * dtype_bytes, largest * (4 + (dtype_bytes if dtype_bytes != 4 else 0))


def projection_bytes(cfg: ModelConfig, tokens: int, b: int) -> int:
    """What :meth:`~reference_impl.model.attention.DSAAttention.project` holds for ``tokens`` tokens at
    its peak, with the layer's input and output rows (every tensor counted, none freed early)."""
    h, c, r, hi, d = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_n_heads, cfg.index_head_dim
    per_token = (
        cfg.dim * (3 * b + 4)  # x, its norm, x + out; x in float32 for weights_proj
        + cfg.q_lora_rank * b * 2  # wq_a's output and q_norm's
        + h * cfg.qk_head_dim * (b + 8)  # wq_b's output; RoPE of its rope part in float32
        + h * (c + r) * b * 2  # the absorbed query and the product before it lands
        + (c + r) * (b * 4 + 8)  # wkv_a's output, kv_norm, the cat, RoPE in float32
        + hi * d * (b + 4 * 4 + 1)  # the indexer's query: RoPE, Hadamard and the scale in float32, FP8
        + hi * 4 * 4  # head weights
        + d * (b * 4 + 8)  # the indexer's key: wk, k_norm, RoPE, Hadamard
    )
    return tokens * per_token


def projection_held_bytes(cfg: ModelConfig, tokens: int, b: int) -> int:
    """What a layer keeps of its projections while it attends: the input rows and the
    :class:`~reference_impl.model.attention.Projection` (absorbed query, KV row, the indexer's FP8
    query, head weights and key)."""
    h, c, r, hi, d = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_n_heads, cfg.index_head_dim
    return tokens * (cfg.dim * 2 * b + h * (c + r) * b + (c + r) * b + hi * (d + 4) + d * b)


def indexer_bytes(cfg: ModelConfig, queries: int, keys: int, b: int) -> int:
    """The torch indexer top-k at its peak: its output, one chunk of rows' float32 logits (twice)
    and scores, and the keys in float32."""
    hi, d, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    keys = max(keys, 1)
    rows = min(queries, max(1, CHUNK_CAP // (hi * keys * 4)))
    logits = rows * hi * keys * 4
    return (
        queries * k * 4 * 2  # the int32 output, the chunk's indices
        + logits  # [rows, Hi, S] float32 (ReLU in place; the reduction over heads runs without a copy)
        + rows * keys * (4 * 4 + 8 + 3)  # scores, masked, scaled; the visible mask; topk's values
        + keys * (d * 4 + 8 + 4)  # keys in float32, their columns, scales
        + rows * hi * d * 4  # the chunk's query in float32
    )


def attention_bytes(cfg: ModelConfig, queries: int, b: int) -> int:
    """The torch sparse MLA attention at its peak: outputs and one chunk of gathered rows and scores."""
    h, c, r, k, v = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_topk, cfg.v_head_dim
    rows = min(queries, max(1, CHUNK_CAP // (k * (c + r + h) * 4)))
    return (
        queries * h * (c * (4 + b) + (c + r) * 2 + v * b)  # float32 out and its cast; q in the view's dtype; o
        + queries * (cfg.dim * b + h * 4)  # wo's output; lse
        + rows * k * ((c + r) * 4 * 2 + c * 4 + 8 * 2 + 1)  # gathered rows (float32, a copy), the value slice, indices
        + rows * h * k * 4 * 3  # scores, masked, probabilities
        + rows * h * (c + r) * 4  # the chunk's q in float32
    )


def view_bytes(cfg: ModelConfig, keys: int, layout: KVLayout) -> int:
    """A full view of ``keys`` rows: bf16 KV, FP8 index K and scales, the float32 rows the
    dequantization makes, and the packed rows it reads (gathered pages or the replica's slice)."""
    return keys * ((cfg.kv_width) * (2 + 4 * 2) + layout.index_head_dim + 4 + _row_bytes(layout))


def layer_bytes(cfg: ModelConfig, queries: int, keys: int, layout: KVLayout, b: int) -> int:
    """One layer's work for ``queries`` queries against ``keys`` keys: the projection at its peak, or
    what it keeps plus the full view plus the indexer and the attention (both counted, though the
    indexer's chunks are freed before the attention's)."""
    return max(
        projection_bytes(cfg, queries, b),
        projection_held_bytes(cfg, queries, b)
        + view_bytes(cfg, keys, layout)
        + indexer_bytes(cfg, queries, keys, b)
        + attention_bytes(cfg, queries, b),
    )


def _row_bytes(layout: KVLayout) -> int:
    return layout.mla_bytes + layout.index_head_dim + 4


def estimate(
    run: RunConfig,
    device_type: str,
    start_method: str,
    cuda_devices: int,
    extra_process: int,
    b: int,
) -> Footprint:
    """The run's peak memory per process (the module docstring has the model). Arithmetic only.

    ``start_method`` is how the ranks start (:class:`~reference_impl.launch.LaunchSpec`);
    ``extra_process``: the bytes of one more process that runs beside the ranks (a PD decode).
    """
    cfg, c, layers = run.model, run.cp_size, run.model.n_layers
    layout = KVLayout.from_config(cfg, run.kv_dtype, run.page_size)
    row = _row_bytes(layout)
    totals = [r.total for r in run.requests]
    extends = [r.extend for r in run.requests]
    prefixes = [r.prefix for r in run.requests]
    step = run.chunk_size or max(extends)
    chunk_extends = [min(step, e) for e in extends]
    # Per chunk at most every request's chunk share, against every request's whole context.
    t_chunk, keys = sum(chunk_extends), sum(totals)
    t_local = local_queries(run, chunk_extends) if c > 1 else t_chunk
    weights, draw = weight_bytes(cfg, b)
    inputs = sum(totals) * cfg.dim * b + max(totals) * cfg.dim * 4  # every request; one float32 draw
    pages = sum(-(-n // run.page_size) for n in totals)
    page_bytes = layers * layout.mla_page_bytes + cfg.index_share.n_full * layout.index_page_bytes
    if run.phases.sharded_kv and c > 1:
        ownership = Ownership(c, run.interleave, run.page_size)
        owned = [ownership.pages_held(pages, r) + 2 * len(totals) for r in range(c)]  # + lane slack per request
    else:
        owned = [pages] * c
    install = (
        2 * layers * sum(prefixes) * row + layer_bytes(cfg, max(prefixes), max(prefixes), layout, b)
        if max(prefixes)
        else 0
    )
    gathered = t_chunk * (cfg.kv_width + cfg.index_head_dim) * b * 3  # padded gather, trimmed, reranged
    loop = layer_bytes(cfg, t_local, keys, layout, b) + gathered
    logits = len(run.requests) * cfg.vocab_size * 4 * 2
    outputs = (t_local * cfg.dim * 4 + layers * t_local * cfg.index_topk * 4 * 2) if run.check else 0
    metadata = sum(totals) * METADATA_PER_TOKEN  # the chunk schedule and split metadata: Python ints
    # On CUDA a process's interpreter and metadata live on the host (counted in ``host``); its device holds a context.
    base = CUDA_CONTEXT if device_type == "cuda" else PROCESS_BASE[start_method if c > 1 else "inline"] + metadata
    rank_terms: list[dict[str, int]] = []
    results = []
    for r in range(c):
        held = owned[r] * page_bytes
        result = (2 * held + outputs if run.check else 0) + logits  # stored rows (check), hidden, top-k, logits
        results.append(result)
        stages = {"install prefixes": held + install, "layer loop": held + loop + outputs, "result": held + 2 * result}
        rank_terms.append({"base": base, "weights": weights, "inputs": inputs, "weight init": draw, **stages})
    ranks = tuple(
        int(
            SAFETY
            * (
                t["base"]
                + t["weights"]
                + max(t["weight init"], t["inputs"] + max(t["install prefixes"], t["layer loop"], t["result"]))
            )
        )
        for t in rank_terms
    )
    received = sum(results)
    parent_terms = {"base": PROCESS_BASE["parent"] + metadata, "rank results": received}
    if run.check:
        longest_span = max(max(prefixes), max(chunk_extends))
        kept = (
            layers
            * sum(extends)
            * (
                cfg.n_heads * cfg.kv_width * b
                + cfg.kv_width * b
                + cfg.index_n_heads * (cfg.index_head_dim + 4)
                + cfg.index_head_dim * b
            )
        )
        parent_terms.update(
            {
                "oracle weights": weights,
                "oracle weight init": draw,
                "oracle inputs": inputs,
                "oracle caches": 2 * layers * sum(totals) * row,
                "oracle projections": kept,
                "oracle layer": layer_bytes(cfg, longest_span, max(totals), layout, b),
            }
        )
    during = int(SAFETY * (parent_terms["base"] + 2 * max(results))) + extra_process
    after = int(
        SAFETY
        * (
            parent_terms["base"]
            + received
            + parent_terms.get("oracle weights", 0)
            + max(
                parent_terms.get("oracle weight init", 0),
                sum(
                    parent_terms.get(k, 0)
                    for k in ("oracle inputs", "oracle caches", "oracle projections", "oracle layer")
                ),
            )
        )
    )
    host = sum(ranks) + during
    if device_type == "cuda":  # the host side of CUDA processes: the interpreter, results on their way back
        host = (c + 1) * (PROCESS_BASE["spawn"] + metadata) + int(SAFETY * 2 * received) + extra_process
    ranks_per_device = -(-c // max(1, cuda_devices)) if device_type == "cuda" else c
    terms = {f"rank 0 {k}": v for k, v in rank_terms[0].items()} | {f"parent {k}": v for k, v in parent_terms.items()}
    return Footprint(ranks, during, after, host, device_type, ranks_per_device, terms)


def decode_bytes(run: RunConfig) -> int:
    """A PD decode process beside the ranks (:mod:`reference_impl.prefill_decode`): its own cache of
    every request's tokens in every layer, as it receives them (twice: the rows and their pages)."""
    layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
    tokens = sum(r.total for r in run.requests)
    return int(SAFETY * (PROCESS_BASE["spawn"] + 2 * run.model.n_layers * tokens * _row_bytes(layout)))

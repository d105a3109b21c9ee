"""Lightning-indexer top-k on GPU: a Triton logits kernel, then a Triton selection (or ``torch.topk``).

Contract: the same as :func:`reference_impl.model.sparse_attention.indexer_topk`: for query row
``t`` and the full-view keys ``[key_start[t], key_end[t])``,
``I[t, s] = k_scale[s] * sum_h weights[t, h] * ReLU(q_fp8[t, h] . k_fp8[s])`` and the result is the
top-``min(topk, visible)`` rows by ``I``, ``[T, topk]`` int32, ``-1`` padded. ``torch.topk`` lists
a row's rows by descending ``I``, as the reference; the selection kernel in ascending order; the
set is the same, up to which of several rows tied at the k-th score is kept.

Where Triton is used and where it is not:

* **Logits: Triton.** The torch reference materializes ``[rows, Hi, keys]`` fp32 logits and then
  reduces over heads (``Hi`` x the bytes of the result, through device memory, twice). The kernel
  keeps the head reduction in registers: a program owns a ``[BLOCK_T rows x BLOCK_S keys]`` tile,
  loads its key tile once, and loops over the ``Hi`` heads, each a ``[BLOCK_T, D] x [D, BLOCK_S]``
  product (fp8 x fp8 -> fp32 on GPU by default, or bf16 products of the exactly upcast fp8 values;
  fp32 under the CPU interpreter), then ReLU and the per-row head weight. Key tiles that no row of
  the block can see are not computed, only filled with ``-inf``; visible-range masking is exact.
* **Top-k: Triton, or torch.** ``selector="triton"`` (what the dispatch picks by default): the
  exact selection kernels of :mod:`reference_impl.kernels.topk_select` over each row's visible
  columns (ties at the boundary go to the lower key; a kernel that raises falls back to
  ``torch.topk``, :func:`~reference_impl.kernels.fallback.run_with_fallback`). With
  ``fused_bound=True`` (opt-in) the logits kernel also writes each row's group maxima
  (:func:`~reference_impl.kernels.topk_select.span_maxima`, 1/16 of the logits' bytes), so that the
  selection's first kernel reads those instead of every logit of a long row (measured:
  ``docs/compute-kernels.md#top-k-selection``). ``selector="torch"``
  (this function's default, and the dispatch's with ``DSACP_TRITON_TOPK=0``): ``torch.topk`` over
  the masked ``[rows, keys]`` logits of a chunk of rows, as the reference does.
* **Memory: a tile, not the context.** The rows are processed in chunks so the fp32 logits buffer
  stays under ``max_chunk_bytes`` (1 GiB by default). A chunk whose rows see more than
  :data:`KEY_TILE` keys never holds their ``[rows, keys]`` logits at once: the keys stream in tiles,
  right to left, through an exact running top-k (:func:`_select_streamed`;
  :mod:`reference_impl.model.streaming_topk` states why the merge is exact, ties included), so a
  rank's transient memory stays flat as the context grows (:func:`indexer_tile_bytes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.kernels import fallback
from reference_impl.kernels.topk_select import (
    MAXIMA_SPAN,
    first_group,
    groups_below,
    maxima_width,
    order_keys,
    span_maxima,
    topk_select_triton,
    workspace_bytes,
)
from reference_impl.kernels.triton_helpers import pow2_at_least_16
from reference_impl.model.sparse_attention import HostKeyBounds, chunk_key_range
from reference_impl.model.streaming_topk import RunningTopK, key_tiles

# (BLOCK_T, BLOCK_S, num_warps, num_stages, dot dtype) used on GPU unless the caller overrides them.
GPU_DEFAULT_CONFIG: tuple[int, int, int, int, str] = (64, 128, 4, 3, "fp8")
# The interpreter's: small row tiles; one 128-column span per tile, as the group maxima need.
CPU_DEFAULT_CONFIG: tuple[int, int, int, int, str] = (16, 128, 4, 1, "fp8")
GPU_BLOCK_POINTERS = False
"""Whether the logits kernel loads its q and key tiles through block pointers. Built for sm_90
(``scripts/inspect_logits_kernel.py``), the default config with per-element address tensors spills
under Triton 3.7: the ``[64, 128]`` q tile's 64-bit addresses stay live across the head loop.
Through block pointers nothing spills. Off by default (registers, spills and times:
``docs/long-context.md#the-indexers-logits``)."""


@triton.jit
def _indexer_logits_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    k_scale_ptr,
    key_start_ptr,
    key_end_ptr,
    out_ptr,
    maxima_ptr,
    n_rows,
    n_cols,
    col0,
    n_heads,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_wh,
    stride_k,
    stride_ot,
    stride_mt,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_BF16: tl.constexpr,
    UPCAST: tl.constexpr,
    WRITE_MAXIMA: tl.constexpr,
    BLOCK_PTRS: tl.constexpr = False,
    DOT_IEEE: tl.constexpr = False,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)  # relative to col0
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D

    key_start = tl.load(key_start_ptr + rows, mask=row_mask, other=2**62)
    key_end = tl.load(key_end_ptr + rows, mask=row_mask, other=0)
    abs_cols = col0 + cols
    tile_lo = col0 + pid_s * BLOCK_S
    tile_hi = tile_lo + BLOCK_S

    acc = tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.float32)
    # Skip the products for a key tile outside every row's causal range (about half the tiles
    # of a causal prefill); it still gets its -inf fill below.
    if (tile_lo < tl.max(key_end)) & (tile_hi > tl.min(key_start)):
        if BLOCK_PTRS:  # no [BLOCK_S, BLOCK_D] tensor of 64-bit addresses (registers, see the docstring)
            k_block = tl.make_block_ptr(
                k_ptr + col0.to(tl.int64) * stride_k,
                (n_cols, D),
                (stride_k, 1),
                (pid_s * BLOCK_S, 0),
                (BLOCK_S, BLOCK_D),
                (1, 0),
            )
            k = tl.load(k_block, boundary_check=(0, 1), padding_option="zero")
        else:
            k = tl.load(
                k_ptr + abs_cols.to(tl.int64)[:, None] * stride_k + offs_d[None, :],
                mask=col_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
        if UPCAST:
            k = k.to(tl.float32)
        elif DOT_BF16:
            k = k.to(tl.bfloat16)
        k_t = tl.trans(k)
        q_rows = q_ptr + rows[:, None] * stride_qt + offs_d[None, :]
        qd_mask = row_mask[:, None] & d_mask[None, :]
        for h in range(n_heads):
            if BLOCK_PTRS:
                q_block = tl.make_block_ptr(
                    q_ptr + h * stride_qh, (n_rows, D), (stride_qt, 1), (pid_t * BLOCK_T, 0), (BLOCK_T, BLOCK_D), (1, 0)
                )
                q = tl.load(q_block, boundary_check=(0, 1), padding_option="zero")
            else:
                q = tl.load(q_rows + h * stride_qh, mask=qd_mask, other=0.0)
            w = tl.load(w_ptr + rows * stride_wt + h * stride_wh, mask=row_mask, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            elif DOT_BF16:
                q = q.to(tl.bfloat16)
            if DOT_IEEE:  # float32 products as IEEE float32 (a float32 dot is TF32 on the GPU by default)
                s = tl.dot(q, k_t, input_precision="ieee")
            else:
                s = tl.dot(q, k_t)
            acc += tl.maximum(s, 0.0) * w[:, None]
        k_scale = tl.load(k_scale_ptr + abs_cols, mask=col_mask, other=0.0)
        acc = acc * k_scale[None, :]

    visible = (abs_cols[None, :] >= key_start[:, None]) & (abs_cols[None, :] < key_end[:, None])
    logits = tl.where(visible, acc, float("-inf"))
    tl.store(
        out_ptr + rows[:, None] * stride_ot + cols[None, :],
        logits,
        mask=row_mask[:, None] & col_mask[None, :],
    )
    if WRITE_MAXIMA:  # the fused bound's group maxima: write 4 B per 16 keys (BLOCK_S holds whole spans)
        keys = tl.where(visible & col_mask[None, :], order_keys(logits), 0)
        groups = first_group(pid_s * BLOCK_S) + tl.arange(0, BLOCK_S // 16)
        tl.store(
            maxima_ptr + rows[:, None] * stride_mt + groups[None, :],
            span_maxima(keys, BLOCK_T, BLOCK_S),
            mask=row_mask[:, None] & (groups[None, :] < groups_below(n_cols)),
        )


def indexer_logits_triton(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    key_start: torch.Tensor,
    key_end: torch.Tensor,
    col_lo: int,
    col_hi: int,
    *,
    block_t: int | None = None,
    block_s: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dot_dtype: str | None = None,
    maxima: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_pointers: bool | None = None,
) -> torch.Tensor:
    """Masked index logits of all rows of ``q_fp8`` against keys ``[col_lo, col_hi)`` -> [T, col_hi-col_lo] f32.

    Entry ``[t, j]`` is ``I[t, col_lo + j]`` where ``key_start[t] <= col_lo + j < key_end[t]`` and
    ``-inf`` elsewhere. ``q_fp8 [T, Hi, D]``, ``weights [T, Hi]`` f32, ``k_fp8 [S, D]`` (float8_e4m3fn,
    or both bf16: DeepSeek-V4's FP4-valued indexer, :mod:`reference_impl.families.deepseek_v4.kernels.dispatch`),
    ``k_scale [S]`` f32, ``key_start/key_end [T]`` int64. ``dot_dtype``: ``"fp8"`` or ``"bf16"``
    (GPU only; the interpreter always computes in fp32), or ``"fp32"``: both operands upcast to float32
    and multiplied in IEEE float32, not TF32 (GLM-5.3's float32 pooled keys,
    :mod:`reference_impl.families.glm53.kernels.dispatch`). ``maxima``: a
    ``[T, maxima_width(col_hi - col_lo)]`` uint32 tensor that receives the rows' group maxima for
    the fused bound (:func:`~reference_impl.kernels.topk_select.span_maxima`; ``block_s`` a
    multiple of 128). ``out``: an ``[T, col_hi - col_lo]`` f32 view to write into, contiguous along
    the keys (e.g. the first columns of a wider buffer); a new tensor otherwise. ``block_pointers``
    (default :data:`GPU_BLOCK_POINTERS` on a GPU): load the q and key tiles through block pointers
    instead of a tensor of per-element addresses (the same values; see :data:`GPU_BLOCK_POINTERS`).
    """
    n_rows, n_heads, d = q_fp8.shape
    n_cols = col_hi - col_lo
    if out is None:
        out = torch.empty(n_rows, max(n_cols, 0), dtype=torch.float32, device=q_fp8.device)
    elif out.shape != (n_rows, max(n_cols, 0)) or out.dtype != torch.float32 or (n_cols > 0 and out.stride(1) != 1):
        raise ValueError(f"out must be an [{n_rows}, {max(n_cols, 0)}] float32 tensor contiguous along the keys")
    on_gpu = q_fp8.device.type == "cuda"
    dflt_t, dflt_s, dflt_warps, dflt_stages, dflt_dot = GPU_DEFAULT_CONFIG if on_gpu else CPU_DEFAULT_CONFIG
    block_t = block_t or dflt_t
    block_s = block_s or dflt_s
    if maxima is not None:
        width = maxima_width(max(n_cols, 0))
        if maxima.shape != (n_rows, width) or maxima.dtype != torch.uint32 or maxima.stride(-1) != 1:
            raise ValueError(f"maxima must be an [{n_rows}, {width}] uint32 tensor contiguous along the groups")
        if block_s % MAXIMA_SPAN:
            raise ValueError(f"block_s={block_s}: the group maxima need whole {MAXIMA_SPAN}-column spans per tile")
    if n_rows == 0 or n_cols <= 0:
        return out
    dot_dtype = dot_dtype or dflt_dot
    if dot_dtype not in ("fp8", "bf16", "fp32"):
        raise ValueError(f"dot_dtype={dot_dtype!r}: use 'fp8', 'bf16' or 'fp32'")
    if q_fp8.stride(-1) != 1:
        q_fp8 = q_fp8.contiguous()
    if k_fp8.stride(-1) != 1:
        k_fp8 = k_fp8.contiguous()
    grid = (triton.cdiv(n_rows, block_t), triton.cdiv(n_cols, block_s))
    _indexer_logits_kernel[grid](
        q_fp8,
        weights,
        k_fp8,
        k_scale.contiguous(),
        key_start.to(torch.int64).contiguous(),
        key_end.to(torch.int64).contiguous(),
        out,
        out if maxima is None else maxima,  # not written unless WRITE_MAXIMA
        n_rows,
        n_cols,
        col_lo,
        n_heads,
        q_fp8.stride(0),
        q_fp8.stride(1),
        weights.stride(0),
        weights.stride(1),
        k_fp8.stride(0),
        out.stride(0),
        0 if maxima is None else maxima.stride(0),
        D=d,
        BLOCK_D=pow2_at_least_16(d),
        BLOCK_T=block_t,
        BLOCK_S=block_s,
        DOT_BF16=dot_dtype == "bf16" or q_fp8.dtype != k_fp8.dtype,
        UPCAST=not on_gpu or dot_dtype == "fp32",
        WRITE_MAXIMA=maxima is not None,
        BLOCK_PTRS=GPU_BLOCK_POINTERS if block_pointers is None else block_pointers,
        DOT_IEEE=dot_dtype == "fp32",
        num_warps=num_warps or dflt_warps,
        num_stages=num_stages or dflt_stages,
    )
    return out


KEY_TILE = 131072
"""Keys per logits tile on the GPU: a row chunk that sees more keys streams them in tiles of this
width (right to left) through the exact running top-k; one that sees fewer (every row at 128K
tokens) takes one tile, as before tiling."""
MAX_TILE_BYTES = 1 << 30
"""Budget of one tile's fp32 logits buffer (rows x columns x 4 B)."""
RUNNING_BYTES_PER_SLOT = 28
"""Bytes per ``[rows, topk]`` slot of a streamed merge besides the buffer: the selection's int32
positions, their int64 copy, the gathered f32 scores and int64 keys, the int32 running keys."""


def logits_tile_shape(
    n_keys: int, topk: int, max_chunk_bytes: int = MAX_TILE_BYTES, key_tile: int = KEY_TILE
) -> tuple[int, int]:
    """``(rows, columns)`` of the fp32 logits buffer :func:`indexer_topk_triton` allocates for a
    full view of ``n_keys`` keys: ``n_keys`` columns when they fit one tile, else ``key_tile`` keys
    plus the ``topk`` running scores; as many rows as keep it under ``max_chunk_bytes``."""
    cols = max(n_keys, 1) if n_keys <= key_tile else key_tile + topk
    return max(1, max_chunk_bytes // (cols * 4)), cols


def indexer_tile_bytes(
    n_rows: int, n_keys: int, topk: int, max_chunk_bytes: int = MAX_TILE_BYTES, key_tile: int = KEY_TILE
) -> int:
    """Transient bytes of :func:`indexer_topk_triton` (the Triton selector) for ``n_rows`` queries
    over a full view of ``n_keys`` keys: one row chunk's logits buffer, the selection's candidate
    slots (:func:`~reference_impl.kernels.topk_select.workspace_bytes`) and, when the keys take
    several tiles, the running top-k. Flat in ``n_keys`` past one tile."""
    rows, cols = logits_tile_shape(n_keys, topk, max_chunk_bytes, key_tile)
    rows = min(rows, max(n_rows, 1))
    running = rows * topk * RUNNING_BYTES_PER_SLOT if n_keys > key_tile else 0
    return rows * cols * 4 + workspace_bytes(rows, cols, topk) + running


def indexer_topk_triton(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    key_start: torch.Tensor,
    key_end: torch.Tensor,
    topk: int,
    rows_per_chunk: int = 0,
    host_bounds: HostKeyBounds | None = None,
    *,
    max_chunk_bytes: int = MAX_TILE_BYTES,
    key_tile: int = KEY_TILE,
    selector: str = "torch",
    fused_bound: bool = False,
    **launch: object,
) -> torch.Tensor:
    """Top-``min(topk, visible)`` full-view rows per query -> [T, topk] int32, -1 padded.

    Within a row: descending score with ``selector="torch"``, ascending rows with ``"triton"``.
    ``rows_per_chunk <= 0`` sizes the chunks so each chunk's fp32 logits buffer stays under
    ``max_chunk_bytes`` (:func:`logits_tile_shape`). A chunk whose rows see more than ``key_tile``
    keys streams them in tiles through an exact running top-k (:func:`_select_streamed`): memory
    is flat in the context. ``selector``: ``"triton"`` (the selection kernel, falling back to
    ``torch.topk`` or the torch merge if it raises) or ``"torch"``. ``fused_bound`` (``"triton"``,
    one-tile chunks only): the logits kernel writes the group maxima the selection's bound reads
    (``block_s`` a multiple of 128); by default the bound reads the logits. ``launch`` is passed to
    :func:`indexer_logits_triton`.
    """
    if selector not in ("triton", "torch"):
        raise ValueError(f"selector={selector!r}: use 'triton' or 'torch'")
    with_maxima = selector == "triton" and fused_bound
    n_rows = q_fp8.shape[0]
    out = torch.full((n_rows, topk), -1, dtype=torch.int32, device=q_fp8.device)
    if n_rows == 0 or topk <= 0:
        return out
    if rows_per_chunk <= 0:
        rows_per_chunk = logits_tile_shape(int(k_fp8.shape[0]), topk, max_chunk_bytes, key_tile)[0]
    key_start = key_start.to(torch.int64)
    key_end = key_end.to(torch.int64)
    for r0 in range(0, n_rows, rows_per_chunk):
        r1 = min(n_rows, r0 + rows_per_chunk)
        lo, hi = chunk_key_range(key_start, key_end, r0, r1, host_bounds)
        if hi <= lo:
            continue
        rows = slice(r0, r1)
        chunk = (q_fp8[rows], weights[rows], k_fp8, k_scale, key_start[rows], key_end[rows])
        if hi - lo > key_tile:
            _select_streamed(out[rows], chunk, lo, hi, topk, key_tile, selector, launch)
            continue
        maxima = None
        if with_maxima:
            maxima = torch.empty(r1 - r0, maxima_width(hi - lo), dtype=torch.uint32, device=q_fp8.device)
        logits = indexer_logits_triton(*chunk, lo, hi, maxima=maxima, **launch)  # type: ignore[arg-type]
        if selector == "triton":
            _select_into(out[rows], logits, key_start[rows] - lo, key_end[rows] - lo, lo, topk, maxima)
        else:
            _torch_topk_into(out[rows], logits, lo, topk)
    return out


def indexer_logits_pass(
    *inputs: torch.Tensor, topk: int, max_chunk_bytes: int = MAX_TILE_BYTES, key_tile: int = KEY_TILE, **launch: object
) -> None:
    """The logits :func:`indexer_topk_triton` computes for ``inputs`` (its first six arguments:
    ``q_fp8, weights, k_fp8, k_scale, key_start, key_end``), tile for tile into a buffer of the same
    shape, without the selection: the logits' share of its time (benchmarks)."""
    q_fp8, weights, k_fp8, k_scale, key_start, key_end = inputs
    rows_per_chunk, cols = logits_tile_shape(int(k_fp8.shape[0]), topk, max_chunk_bytes, key_tile)
    buf = torch.empty(min(rows_per_chunk, q_fp8.shape[0]), cols, dtype=torch.float32, device=q_fp8.device)
    for r0 in range(0, q_fp8.shape[0], rows_per_chunk):
        r1 = min(q_fp8.shape[0], r0 + rows_per_chunk)
        lo, hi = chunk_key_range(key_start, key_end, r0, r1, None)
        rows = (q_fp8[r0:r1], weights[r0:r1], k_fp8, k_scale, key_start[r0:r1], key_end[r0:r1])
        for t0, t1 in key_tiles(lo, hi, key_tile):
            indexer_logits_triton(*rows, t0, t1, out=buf[: r1 - r0, : t1 - t0], **launch)  # type: ignore[arg-type]


def _select_streamed(
    out: torch.Tensor,
    chunk: tuple[torch.Tensor, ...],
    lo: int,
    hi: int,
    topk: int,
    key_tile: int,
    selector: str,
    launch: dict[str, object],
) -> None:
    """The top-k of one row chunk over keys ``[lo, hi)`` (more than one tile) into ``out [R, topk]``.

    ``"torch"``: each tile's logits merged into a :class:`~reference_impl.model.streaming_topk.RunningTopK`
    (descending score). ``"triton"``: the selection kernel on one buffer ``[R, key_tile + topk]``
    whose first columns hold a tile's logits and whose last ``topk`` hold the running top-k's scores,
    tiles taken **right to left**. Buffer position order is then key order (the running keys lie
    right of the tile), so the kernel's lowest-column ties are the lowest keys, and each row's
    candidates form one range of columns: the tile's visible keys, which reach the tile's end
    whenever the row sees keys further right, then its running count. The kernel returns
    positions in ascending order (ascending keys); a kernel that raises falls back to the torch merge.
    """
    q_fp8, weights, k_fp8, k_scale, key_start, key_end = chunk
    tiles = key_tiles(lo, hi, key_tile)

    def torch_merge() -> torch.Tensor:
        best = RunningTopK.empty(q_fp8.shape[0], topk, q_fp8.device)
        buf = torch.empty(q_fp8.shape[0], key_tile, dtype=torch.float32, device=q_fp8.device)
        for t0, t1 in tiles:
            best = best.merge(indexer_logits_triton(*chunk, t0, t1, out=buf[:, : t1 - t0], **launch), t0)  # type: ignore[arg-type]
        return out.copy_(best.by_score())

    def kernel_merge() -> torch.Tensor:
        buf = torch.empty(q_fp8.shape[0], key_tile + topk, dtype=torch.float32, device=q_fp8.device)
        run_keys: torch.Tensor | None = None  # [R, topk] int64 keys of the running top-k, -1 unused
        for t0, t1 in reversed(tiles):
            width = t1 - t0
            indexer_logits_triton(*chunk, t0, t1, out=buf[:, :width], **launch)  # type: ignore[arg-type]
            col_start = (key_start - t0).clamp(0, width)
            col_end = (key_end - t0).clamp(0, width)
            view = buf[:, :width]
            if run_keys is not None:  # a full tile (only the rightmost may be short) and the running scores
                n_run = (key_end.clamp(max=hi) - key_start.clamp(min=t1)).clamp(0, topk)
                col_end = torch.where(n_run > 0, key_tile + n_run, col_end)
                view = buf
            pos = topk_select_triton(view, col_start, col_end, topk).long()  # [R, topk] ascending, -1 padded
            at = pos.clamp(min=0)
            keys = at + t0
            if run_keys is not None:
                keys = torch.where(at < key_tile, keys, run_keys.gather(1, (at - key_tile).clamp(min=0)))
            run_keys = torch.where(pos >= 0, keys, -1)
            buf[:, key_tile:] = view.gather(1, at)
        assert run_keys is not None
        return out.copy_(run_keys)

    if selector == "torch":
        torch_merge()
        return
    fallback.run_with_fallback("Triton top-k selection", kernel_merge, torch_merge, to="the torch merge")


def _select_into(
    out: torch.Tensor,
    logits: torch.Tensor,
    col_start: torch.Tensor,
    col_end: torch.Tensor,
    lo: int,
    topk: int,
    maxima: torch.Tensor | None,
) -> None:
    """The selection kernel into ``out`` (keys ``lo + column``), or ``torch.topk`` if it raises."""
    fallback.run_with_fallback(
        "Triton top-k selection",
        lambda: topk_select_triton(logits, col_start, col_end, topk, col_offset=lo, out=out, maxima=maxima),
        lambda: _torch_topk_into(out, logits, lo, topk),
        to="torch.topk",
    )


def _torch_topk_into(out: torch.Tensor, logits: torch.Tensor, lo: int, topk: int) -> torch.Tensor:
    """``torch.topk`` of masked ``logits [R, N]`` -> ``out [R, topk]`` (columns + ``lo``, ``-1`` for ``-inf``)."""
    k = min(topk, logits.shape[1])
    vals, idx = logits.topk(k, dim=-1)
    idx = torch.where(torch.isinf(vals), torch.full_like(idx, -1 - lo), idx) + lo
    out[:, :k] = idx.to(torch.int32)
    out[:, k:] = -1
    return out

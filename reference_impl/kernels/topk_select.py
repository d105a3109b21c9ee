"""Exact row-wise top-k over masked index logits: a Triton selection instead of ``torch.topk``.

Contract (:func:`topk_select_triton`): for each row ``r`` of ``logits [R, N]`` f32 and its visible
columns ``[col_start[r], col_end[r])`` (clipped to ``[0, N)``), the ``min(k, visible)`` columns of
largest value, written in **ascending column order** as ``col + col_offset`` into ``out [R, k]``
int32, ``-1`` in the unused slots. Where several columns tie at the k-th largest value, the lowest
columns are kept. As a set this is ``torch.topk``'s result (whose choice among boundary ties is
unspecified); the order differs: ``torch.topk`` sorts by value, which sparse attention does not need
(the top-k feeds a softmax over a set) and which would cost a sort per row. NaN logits are not
supported (the logits kernel never writes one).

Why: at one rank of C=8 at 128K (16K rows over up to 128K keys) ``torch.topk`` spends its time
in radix digit counting, gathers and sorts over the whole ``[rows, keys]`` buffer, the invisible
``-inf`` columns included. Here each row's visible keys are read twice, and the second read is
split across several programs per row so that it can run near the HBM rate (measured against
``torch.topk``: ``docs/compute-kernels.md#top-k-selection``).

Three kernels, each row's keys read twice in all:

1. **A lower bound from column maxima** (``_topk_select_bound_kernel``, one program per row; read
   4 B per key). The visible keys are folded into ``G = 2 * next_pow2(k)`` columns by a running
   max, block ``i`` of ``G`` keys rotated by ``i * 1031`` columns (so that scores repeating with a
   period of ``G`` do not pile their copies into the same columns). The k-th largest of the ``G``
   maxima has at least ``k`` keys at or above it (those maxima), so every top-k key is at or above
   it, and so at or above ``L``: its top 16 bits, the rest zero (4 radix steps on the GPU, half of
   an exact select; :class:`SelectConfig`). On scores without structure about ``0.7 * G`` keys
   reach ``L``.

   **Fused bound** (``maxima=``, opt-in): the logits kernel, which has each tile in registers, also
   writes the row's *group maxima* (:func:`span_maxima`: each 128-column span's 8 groups of every
   8th column, 16 keys a group, 0 where no key is visible; ``1/16`` of the logits' bytes). A row
   with at least ``G`` group maxima folds those instead of its keys (read 4 B per 16 keys): a
   folded column is still the largest of a disjoint set of visible keys, so the bound is as valid,
   and as tight (about ``visible / G`` keys per column either way). Shorter rows read their keys.
   Off by default: the logits kernel is already out of registers, and the epilogue costs it more
   than the bound's pass saves (``python -m reference_impl.bench.topk`` times both; measured:
   ``docs/compute-kernels.md#top-k-selection``).

2. **Candidates** (``_topk_select_compact_kernel``, ``S`` programs per row, each a segment of the
   row; read 4 B per key, write 4 B per candidate): the columns of the keys ``>= L``, in column
   order, into the segment's own ``G`` slots, and the segment's count. Segment order is column
   order, so the row's candidates are in column order without a sort or an atomic.

3. **The k-th key and the result** (``_topk_select_finish_kernel``, one program per row). (a) When
   the row's candidates fit in ``G`` slots (the common case): the exact k-th key among them, in
   registers, then the keys above it and the lowest-column ties at it. (b) When ties at ``L``
   overflow (e.g. many equal scores) and fewer than ``k`` keys lie above ``L`` (one more read
   counts them): ``L`` is the k-th key; one more read of the row selects. (c) Otherwise
   (adversarial scores): radix select over the whole row (8 more reads), then that selection.
   Exact on every path; only the time differs. ``paths=`` records which one each row took.

The k-th largest key by radix select, 4 bits per step: one ``tl.histogram`` of the next digit
among the keys that match the digits chosen so far picks the largest digit that still leaves at
least ``k`` keys at or above it; 8 steps for 32 bits, without a sort.

Order key: the fp32 bit pattern mapped so that unsigned order is float order (negative values have
all bits flipped, non-negative ones the sign bit set); ``-0.0`` is first folded into ``+0.0`` as
``torch.topk`` compares them equal. Every finite value and ``-inf`` maps above 0 (0 marks "no key").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class SelectConfig:
    """Launch parameters of the three kernels. ``bound_steps``: radix steps of the bound (8: the
    exact k-th column maximum; fewer: its top ``4 * bound_steps`` bits, a slightly lower bound for
    fewer steps; a bound below a run of equal scores sends rows with many ties from path (b) to
    (c), still exact). ``segment_keys``: about how many keys one compact
    program reads (a row of ``N`` keys gets ``S = next_pow2(N / segment_keys)`` programs, at most
    ``max_segments``); ``compact_block``: keys per step of a compact program (a power of two)."""

    bound_warps: int
    bound_steps: int
    compact_block: int
    compact_warps: int
    segment_keys: int
    max_segments: int
    finish_warps: int


GPU_CONFIG = SelectConfig(
    bound_warps=32,
    bound_steps=4,
    compact_block=512,
    compact_warps=1,
    segment_keys=8192,
    max_segments=16,
    finish_warps=8,
)
"""The GPU config, tuned on an H200: the fastest exact candidate of ``python -m reference_impl.bench.topk
--sweep`` (measured: ``docs/compute-kernels.md#top-k-selection``)."""
CPU_CONFIG = SelectConfig(
    bound_warps=4, bound_steps=8, compact_block=64, compact_warps=1, segment_keys=256, max_segments=4, finish_warps=4
)
"""The interpreter's: small segments, so that toy rows still take several segments."""

MAXIMA_SPAN = 128
"""Columns per span of the group maxima (:func:`span_maxima`); a logits tile that writes maxima holds whole spans."""
MAXIMA_PER_SPAN = 8
"""Groups per span: group ``g`` of span ``s`` holds columns ``128 s + g + 8 i`` for ``i < 16``, so a run
of up to 8 adjacent high scores lands in as many groups."""

PATHS = ("candidates", "ties at the bound", "whole row")
"""Names of the values ``paths=`` receives: 0, 1, 2 = steps 3a, 3b, 3c of the module docstring."""


@triton.jit
def _order_key(v):
    """fp32 -> uint32 whose unsigned order is the float order (``-0.0`` folded into ``+0.0``)."""
    bits = (v + 0.0).to(tl.uint32, bitcast=True)
    negative = (bits >> 31) != 0
    return tl.where(negative, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def span_maxima(keys, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """``[BLOCK_T, BLOCK_S]`` order keys (0 where not visible) of ``BLOCK_S // 128`` whole spans ->
    their ``[BLOCK_T, BLOCK_S // 16]`` group maxima (:data:`MAXIMA_PER_SPAN` per span, in span order)."""
    SPANS: tl.constexpr = BLOCK_S // 128
    by_group = tl.reshape(keys, [BLOCK_T, SPANS, 16, 8])  # [t, s, i, g] = column 128 s + 8 i + g
    return tl.reshape(tl.max(by_group, axis=2), [BLOCK_T, SPANS * 8])


@triton.jit
def first_group(col):
    """Index of the first group maximum of the span holding column ``col`` (the literals are
    :data:`MAXIMA_SPAN` and :data:`MAXIMA_PER_SPAN`)."""
    return col // 128 * 8


@triton.jit
def groups_below(n_cols):
    """Group maxima of the spans that cover columns ``[0, n_cols)``: :func:`maxima_width` on the device."""
    return (n_cols + 127) // 128 * 8


@triton.jit
def _choose_digit(hist, prefix, remaining, SHIFT: tl.constexpr):
    """One 4-bit step of radix select from ``hist`` ([32] counts of the next digit among the keys
    that match ``prefix`` above it; bins 16..31 hold the keys that do not). Picks the largest digit
    ``d`` with at least ``remaining`` keys at or above it -> ``(prefix | d << SHIFT, remaining - keys
    above d)``. With fewer than ``remaining`` keys in all, ``d = 0``."""
    bins = tl.arange(0, 32)
    counted = tl.where(bins < 16, hist, 0)
    # at_or_above[d] = sum of counted[j] for j >= d: a [32, 32] masked sum, no scan needed
    at_or_above = tl.sum(tl.where(bins[None, :] >= bins[:, None], counted[None, :], 0), axis=1)
    digit = tl.max(tl.where((at_or_above >= remaining) & (bins < 16), bins, 0), axis=0)
    above = tl.sum(tl.where(bins == digit + 1, at_or_above, 0), axis=0)
    return prefix | (digit.to(tl.uint32) << SHIFT), remaining - above


@triton.jit
def _digit_of(keys, valid, prefix, SHIFT: tl.constexpr):
    """The 4-bit digit at ``SHIFT`` of the valid keys that match ``prefix`` above it; 16 for the rest."""
    HIGH: tl.constexpr = (0xFFFFFFFF << (SHIFT + 4)) & 0xFFFFFFFF
    match = valid & ((keys & HIGH) == prefix)
    return tl.where(match, (keys >> SHIFT) & 15, 16).to(tl.int32)


@triton.jit
def _kth_largest_in_registers(keys, valid, k, STEPS: tl.constexpr = 8):
    """``(k-th largest valid uint32 key, how many keys equal to it are among the top k)``: radix
    select, 4 bits per step, one ``tl.histogram`` per step. ``(0, k - valid)`` with fewer than ``k``.
    With ``STEPS < 8``: the k-th key's top ``4 * STEPS`` bits, the rest zero (a lower bound on it)."""
    kth = tl.full([], 0, tl.uint32)
    remaining = k
    for step in tl.static_range(STEPS):
        hist = tl.histogram(_digit_of(keys, valid, kth, 28 - 4 * step), 32)
        kth, remaining = _choose_digit(hist, kth, remaining, 28 - 4 * step)
    return kth, remaining


@triton.jit
def order_keys(v):
    """:func:`_order_key` for callers outside this module (the logits kernel's group maxima)."""
    return _order_key(v)


@triton.jit
def _row_keys(row_logits, cols, hi):
    in_row = cols < hi
    return _order_key(tl.load(row_logits + cols, mask=in_row, other=0.0)), in_row


@triton.jit
def _visible(col_start_ptr, col_end_ptr, row, n_cols):
    return tl.maximum(tl.load(col_start_ptr + row), 0), tl.minimum(tl.load(col_end_ptr + row), n_cols)


@triton.jit
def _topk_select_bound_kernel(
    logits_ptr,
    col_start_ptr,
    col_end_ptr,
    maxima_ptr,
    bound_ptr,
    n_cols,
    k,
    stride_l,
    stride_m,
    G: tl.constexpr,
    STEPS: tl.constexpr,
    USE_MAXIMA: tl.constexpr,
):
    """Step 1, one program per row: the k-th largest of the row's ``G`` rotated column maxima, to
    its top ``4 * STEPS`` bits (a lower bound on it is a bound too, and costs half the radix steps).
    With ``USE_MAXIMA``, a row with at least ``G`` group maxima folds those instead of its keys."""
    row = tl.program_id(0).to(tl.int64)
    lo, hi = _visible(col_start_ptr, col_end_ptr, row, n_cols)
    offs = tl.arange(0, G)
    col_max = tl.zeros([G], dtype=tl.uint32)
    # The groups of the spans the row's keys touch (invisible keys are 0 in their maxima).
    g_lo = first_group(lo)
    g_hi = tl.minimum(groups_below(hi), groups_below(n_cols))
    if USE_MAXIMA and g_hi - g_lo >= G:
        row_maxima = maxima_ptr + row * stride_m
        for b in range(g_lo, g_hi, G):  # read 4 B per 16 keys
            rotation = ((b - g_lo) // G * 1031) % G
            groups = b + (offs + rotation) % G
            col_max = tl.maximum(col_max, tl.load(row_maxima + groups, mask=groups < g_hi, other=0))
    else:
        row_logits = logits_ptr + row * stride_l
        # Read 4 B per visible key. (Issuing the next block's load before this block's max, by hand,
        # costs registers and so programs per SM; measured: docs/compute-kernels.md#top-k-selection.)
        for b in range(lo, hi, G):
            rotation = ((b - lo) // G * 1031) % G
            key, in_row = _row_keys(row_logits, b + (offs + rotation) % G, hi)
            col_max = tl.maximum(col_max, tl.where(in_row, key, 0))
    bound = tl.full([], 0, tl.uint32)
    if hi - lo > k:  # otherwise every visible key is a candidate
        bound, _ = _kth_largest_in_registers(col_max, col_max > 0, k, STEPS)
    tl.store(bound_ptr + row, bound)


@triton.jit
def _topk_select_compact_kernel(
    logits_ptr,
    col_start_ptr,
    col_end_ptr,
    bound_ptr,
    cand_ptr,
    count_ptr,
    n_cols,
    segment_keys,
    stride_l,
    G: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Step 2, program (row, segment): the columns of the segment's keys ``>= bound`` in column
    order into the segment's ``G`` slots (read 4 B per key, write 4 B per candidate), and their
    count (every candidate counted, only the first ``G`` stored)."""
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    n_segments = tl.num_programs(1)
    lo, hi = _visible(col_start_ptr, col_end_ptr, row, n_cols)
    seg_lo = lo + segment * segment_keys
    seg_hi = tl.minimum(hi, seg_lo + segment_keys)
    bound = tl.load(bound_ptr + row)
    offs = tl.arange(0, BLOCK)
    row_logits = logits_ptr + row * stride_l
    slots = cand_ptr + (row * n_segments + segment) * G
    n_cand = 0
    for b in range(seg_lo, seg_hi, BLOCK):
        cols = b + offs
        key, in_row = _row_keys(row_logits, cols, seg_hi)
        take = in_row & (key >= bound)
        slot = n_cand + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(slots + slot, cols.to(tl.int32), mask=take & (slot < G))
        n_cand += tl.sum(take.to(tl.int32), axis=0)
    tl.store(count_ptr + row * n_segments + segment, n_cand)


@triton.jit
def _topk_select_finish_kernel(
    logits_ptr,
    col_start_ptr,
    col_end_ptr,
    bound_ptr,
    cand_ptr,
    count_ptr,
    out_ptr,
    path_ptr,
    n_cols,
    col_offset,
    k,
    stride_l,
    stride_o,
    G: tl.constexpr,
    N_SEGMENTS: tl.constexpr,
    WRITE_PATH: tl.constexpr,
):
    """Step 3, one program per row: the exact k-th key and the selection, in column order."""
    row = tl.program_id(0).to(tl.int64)
    lo, hi = _visible(col_start_ptr, col_end_ptr, row, n_cols)
    bound = tl.load(bound_ptr + row)
    offs = tl.arange(0, G)
    row_logits = logits_ptr + row * stride_l
    row_out = out_ptr + row * stride_o

    # The row's candidates: the segments' slots one after another (segment order is column order).
    cand_cols = tl.zeros([G], dtype=tl.int32)
    n_cand = 0
    for segment in tl.static_range(N_SEGMENTS):
        n_seg = tl.load(count_ptr + row * N_SEGMENTS + segment)
        here = (offs >= n_cand) & (offs < n_cand + n_seg)
        slots = cand_ptr + (row * N_SEGMENTS + segment) * G
        cand_cols = tl.where(here, tl.load(slots + offs - n_cand, mask=here, other=0), cand_cols)
        n_cand += n_seg

    if n_cand <= G:
        # 3a. Every candidate fits in registers: the exact k-th key among them, then the keys above
        #     it and the lowest-column ties at it, stored in column order. With at most k
        #     candidates (a row of at most k keys) all of them.
        path = tl.full([], 0, tl.int32)
        valid = offs < n_cand
        take = valid
        if n_cand > k:
            keys = tl.where(valid, _order_key(tl.load(row_logits + cand_cols, mask=valid, other=0.0)), 0)
            kth, ties_wanted = _kth_largest_in_registers(keys, valid, k)
            tie = valid & (keys == kth)
            take = valid & (keys >= kth)
            if tl.sum(tie.to(tl.int32), axis=0) > ties_wanted:  # the lowest-column ties only
                take = (valid & (keys > kth)) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= ties_wanted))
        slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(row_out + slot, (cand_cols.to(tl.int64) + col_offset).to(tl.int32), mask=take)
        n_out = tl.sum(take.to(tl.int32), axis=0)
    else:
        n_above_bound = 0  # one more read: how many keys lie strictly above the bound
        for b in range(lo, hi, G):
            key, in_row = _row_keys(row_logits, b + offs, hi)
            n_above_bound += tl.sum((in_row & (key > bound)).to(tl.int32), axis=0)
        if n_above_bound < k:
            # 3b. Ties at the bound overflow the slots: the bound is itself the k-th key.
            path = tl.full([], 1, tl.int32)
            kth = bound
            ties_wanted = k - n_above_bound
        else:
            # 3c. Adversarial scores: radix select over the whole row (8 more reads).
            path = tl.full([], 2, tl.int32)
            kth = tl.full([], 0, tl.uint32)
            ties_wanted = k
            for step in tl.static_range(8):
                hist = tl.zeros([32], dtype=tl.int32)
                for b in range(lo, hi, G):
                    key, in_row = _row_keys(row_logits, b + offs, hi)
                    hist += tl.histogram(_digit_of(key, in_row, kth, 28 - 4 * step), 32)
                kth, ties_wanted = _choose_digit(hist, kth, ties_wanted, 28 - 4 * step)
        # The keys above the k-th and the lowest-column ties at it, in column order (one more read).
        n_out = 0
        n_ties = 0
        for b in range(lo, hi, G):
            cols = b + offs
            key, in_row = _row_keys(row_logits, cols, hi)
            tie = in_row & (key == kth)
            take = (in_row & (key > kth)) | (tie & (n_ties + tl.cumsum(tie.to(tl.int32), axis=0) <= ties_wanted))
            slot = n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(row_out + slot, (cols + col_offset).to(tl.int32), mask=take)
            n_out += tl.sum(take.to(tl.int32), axis=0)
            n_ties += tl.sum(tie.to(tl.int32), axis=0)

    tl.store(row_out + offs, tl.full([G], -1, tl.int32), mask=(offs >= n_out) & (offs < k))
    if WRITE_PATH:
        tl.store(path_ptr + row, path.to(tl.int8))


def candidate_slots(k: int) -> int:
    """``G``: candidate slots per segment (and column-maxima width) per row for top-``k``: ``2 * next_pow2(k)``."""
    return 2 * triton.next_power_of_2(max(int(k), 1))


def segment_count(n_cols: int, block: int, segment_keys: int, max_segments: int) -> tuple[int, int]:
    """``(S, keys per segment)`` for rows of up to ``n_cols`` keys: ``S`` the power of two (at most
    ``max_segments``) that splits them into segments of about ``segment_keys``, each a whole number
    of ``block``-key blocks."""
    n_segments = min(triton.next_power_of_2(max(1, triton.cdiv(n_cols, segment_keys))), max_segments)
    return n_segments, triton.cdiv(triton.cdiv(max(n_cols, 1), n_segments), block) * block


def maxima_width(n_cols: int) -> int:
    """Group maxima per row of ``n_cols`` logits columns: 8 per 128-column span (the last one partial)."""
    return triton.cdiv(max(int(n_cols), 0), MAXIMA_SPAN) * MAXIMA_PER_SPAN


def group_maxima_reference(logits: torch.Tensor, col_start: torch.Tensor, col_end: torch.Tensor) -> torch.Tensor:
    """The group maxima the fused bound expects, in torch (tests): the order keys of each row's
    visible columns, 0 elsewhere, maxed per group (:data:`MAXIMA_PER_SPAN`) -> ``[R, maxima_width(N)]``
    int64 holding the uint32 values."""
    n_rows, n_cols = logits.shape
    bits = (logits.float() + 0.0).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    keys = torch.where(bits >> 31 != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    cols = torch.arange(n_cols, device=logits.device)
    lo, hi = col_start.to(logits.device).clamp(min=0), col_end.to(logits.device).clamp(max=n_cols)
    keys = keys.masked_fill((cols[None] < lo[:, None]) | (cols[None] >= hi[:, None]), 0)
    spans = triton.cdiv(n_cols, MAXIMA_SPAN)
    keys = torch.nn.functional.pad(keys, (0, spans * MAXIMA_SPAN - n_cols))
    by_group = keys.view(n_rows, spans, MAXIMA_SPAN // MAXIMA_PER_SPAN, MAXIMA_PER_SPAN)
    return by_group.amax(dim=2).reshape(n_rows, spans * MAXIMA_PER_SPAN)


def workspace_bytes(n_rows: int, n_cols: int, k: int, config: SelectConfig | None = None) -> int:
    """Bytes of the candidate slots one selection of top-``k`` over ``[n_rows, n_cols]`` allocates
    (``R x S x G`` int32, :func:`select_launches`; the per-row bound and counts are small), with
    ``config`` (:data:`GPU_CONFIG` by default)."""
    n_segments, _, slots = _candidate_layout(n_cols, k, config or GPU_CONFIG)
    return n_rows * n_segments * slots * 4


def _candidate_layout(n_cols: int, k: int, cfg: SelectConfig) -> tuple[int, int, int]:
    """``(S segments per row, keys per segment, G slots per segment)`` of one selection's workspace."""
    n_segments, segment_keys = segment_count(n_cols, cfg.compact_block, cfg.segment_keys, cfg.max_segments)
    return n_segments, segment_keys, candidate_slots(k)


def topk_select_triton(
    logits: torch.Tensor,
    col_start: torch.Tensor,
    col_end: torch.Tensor,
    k: int,
    *,
    col_offset: int = 0,
    out: torch.Tensor | None = None,
    paths: torch.Tensor | None = None,
    config: SelectConfig | None = None,
    maxima: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-``k`` columns of each row of ``logits [R, N]`` f32 within ``[col_start, col_end)`` -> ``[R, k]`` int32.

    See the module docstring for the contract. ``col_start`` / ``col_end``: ``[R]`` column bounds
    relative to ``logits`` (clipped to ``[0, N)``); ``col_offset`` is added to every column written
    (e.g. the chunk's first key). ``out``: an ``[R, k]`` int32 view to write into (e.g. a slice of a
    larger result); a new tensor otherwise. ``paths``: an ``[R]`` int8 tensor that receives each
    row's path (:data:`PATHS`), for tests and benchmarks. ``config``: launch parameters
    (:class:`SelectConfig`); :data:`GPU_CONFIG` or :data:`CPU_CONFIG` by default. Workspace:
    ``R x S x G`` int32 candidate slots (``S`` segments per row, ``G`` = :func:`candidate_slots`).
    ``maxima``: the rows' group maxima, ``[R, maxima_width(N)]`` uint32 as the logits kernel writes
    them (:func:`group_maxima_reference` in torch; of the visible columns only): the fused bound.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be a 2-D float32 tensor, got {tuple(logits.shape)} {logits.dtype}")
    if logits.shape[1] and logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the key dimension")
    if k <= 0:
        raise ValueError(f"k={k}: the top-k selection needs k >= 1")
    n_rows, n_cols = logits.shape
    if n_cols + col_offset >= 1 << 31:
        raise ValueError(f"columns up to {n_cols + col_offset}: the result is int32")
    if out is None:
        out = torch.empty(n_rows, k, dtype=torch.int32, device=logits.device)
    elif out.shape != (n_rows, k) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"out must be an [{n_rows}, {k}] int32 tensor contiguous along k")
    if paths is not None and (paths.shape != (n_rows,) or paths.dtype != torch.int8):
        raise ValueError(f"paths must be an [{n_rows}] int8 tensor")
    width = maxima_width(n_cols)
    if maxima is not None and (
        maxima.shape != (n_rows, width) or maxima.dtype != torch.uint32 or maxima.stride(1) != 1
    ):
        raise ValueError(f"maxima must be an [{n_rows}, {width}] uint32 tensor contiguous along the groups")
    if n_rows == 0:
        return out
    for launch in select_launches(logits, col_start, col_end, k, col_offset, out, paths, config, maxima).values():
        launch()
    return out


def select_launches(
    logits: torch.Tensor,
    col_start: torch.Tensor,
    col_end: torch.Tensor,
    k: int,
    col_offset: int,
    out: torch.Tensor,
    paths: torch.Tensor | None,
    config: SelectConfig | None,
    maxima: torch.Tensor | None = None,
) -> dict[str, Callable[[], None]]:
    """The three kernel launches of one selection, in order (``"bound"``, ``"compact"``,
    ``"finish"``), over shared workspace: run them in order for the selection, or time each alone
    (:mod:`reference_impl.bench.topk`). Arguments as :func:`topk_select_triton`'s, checked there."""
    n_rows, n_cols = logits.shape
    cfg = config or (GPU_CONFIG if logits.device.type == "cuda" else CPU_CONFIG)
    n_segments, segment_keys, slots = _candidate_layout(n_cols, k, cfg)
    ranges = (
        col_start.to(device=logits.device, dtype=torch.int64).contiguous(),
        col_end.to(device=logits.device, dtype=torch.int64).contiguous(),
    )
    bound = torch.empty(n_rows, dtype=torch.uint32, device=logits.device)
    candidates = torch.empty(n_rows, n_segments, slots, dtype=torch.int32, device=logits.device)
    counts = torch.empty(n_rows, n_segments, dtype=torch.int32, device=logits.device)

    def bound_kernel() -> None:
        _topk_select_bound_kernel[(n_rows,)](
            logits,
            *ranges,
            logits if maxima is None else maxima,
            bound,
            n_cols,
            k,
            logits.stride(0),
            0 if maxima is None else maxima.stride(0),
            G=slots,
            STEPS=cfg.bound_steps,
            USE_MAXIMA=maxima is not None,
            num_warps=cfg.bound_warps,
        )

    def compact_kernel() -> None:
        _topk_select_compact_kernel[(n_rows, n_segments)](
            logits,
            *ranges,
            bound,
            candidates,
            counts,
            n_cols,
            segment_keys,
            logits.stride(0),
            G=slots,
            BLOCK=cfg.compact_block,
            num_warps=cfg.compact_warps,
        )

    def finish_kernel() -> None:
        _topk_select_finish_kernel[(n_rows,)](
            logits,
            *ranges,
            bound,
            candidates,
            counts,
            out,
            out if paths is None else paths,  # not written unless WRITE_PATH
            n_cols,
            col_offset,
            k,
            logits.stride(0),
            out.stride(0),
            G=slots,
            N_SEGMENTS=n_segments,
            WRITE_PATH=paths is not None,
            num_warps=cfg.finish_warps,
        )

    return {"bound": bound_kernel, "compact": compact_kernel, "finish": finish_kernel}


def topk_select_reference(
    logits: torch.Tensor, col_start: torch.Tensor, col_end: torch.Tensor, k: int, *, col_offset: int = 0
) -> torch.Tensor:
    """The kernel's contract in torch (slow, for tests): per row, the first ``min(k, visible)`` columns
    of a stable descending sort of the visible columns (ties to the lower column), in ascending
    column order, ``+ col_offset``, ``-1`` padded -> ``[R, k]`` int32 on ``logits``' device."""
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int32, device=logits.device)
    for row in range(logits.shape[0]):
        lo, hi = max(int(col_start[row]), 0), min(int(col_end[row]), logits.shape[1])
        if hi <= lo:
            continue
        chosen = torch.sort(logits[row, lo:hi], descending=True, stable=True).indices[:k].sort().values
        out[row, : chosen.numel()] = (chosen + lo + col_offset).to(torch.int32)
    return out


def selected_scores(logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Each row's selected scores (``selected``: columns of ``logits``, ``-1`` unused, as ``-inf``),
    sorted descending: two selections of the same keys up to ties and order compare equal."""
    values = logits.gather(1, selected.clamp(min=0).long()).masked_fill(selected < 0, float("-inf"))
    return values.sort(dim=1, descending=True).values

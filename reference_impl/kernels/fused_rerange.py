"""Fused rerange (phase 7): padded rank-major all-gather buffer -> sequence order in one pass.

All-gather #1 returns ``raw [C, max_len, W]`` (:meth:`CPGroup.all_gather_rows_padded_raw`): slot
``r`` holds rank ``r``'s rows, padded to the longest rank. The torch path trims the padding
(``cat`` of the ``C`` slices: one read and one write of the whole chunk) and then reorders
(``index_select``: a second read and write). The kernel reads each needed row once from the padded
buffer and writes it once at its sequence position, using the padded rerange index
(:func:`reference_impl.cp.split.rerange_tensor` with ``padded=True``): ``out[t] = raw_rows[idx[t]]``
where ``raw_rows`` is ``raw`` viewed as ``[C * max_len, W]``.

The copy is dtype-agnostic: rows move as 32-bit words when their byte size allows (16- or 8-bit
words otherwise), so bf16, fp32, fp8 and packed uint8 rows take the same kernel and the result is
bit-identical to ``trim + index_select``. Index entries outside ``[0, C * max_len)`` produce zero
rows (the split metadata never makes them).

Launch config: ``block_t`` rows per program, ``block_c`` words per column step, ``num_warps``, and
``one_pass``: the row as a power-of-two head and a tail (288 words: 256 + 32), both loaded before
either is stored, instead of column steps that each wait on memory (``block_c`` then unused). By
row width, ``rerange_index`` for rows of at most 512 bytes (indexer K, 256 B) and ``rerange_kv``
otherwise (the MLA latent, 1152 B), from :mod:`.fused_configs`; keyword arguments override it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_impl.config import ConfigError
from reference_impl.kernels.fused_configs import launch_config, rerange_kernel_name


@triton.jit
def _rerange_kernel(
    src_ptr,
    idx_ptr,
    out_ptr,
    n_out,
    n_src_rows,
    stride_src,
    stride_out,
    WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ONE_PASS: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_out
    idx = tl.load(idx_ptr + rows, mask=row_ok, other=0)
    src_ok = row_ok & (idx >= 0) & (idx < n_src_rows)
    src_row = src_ptr + tl.where(src_ok, idx, 0) * stride_src
    out_row = out_ptr + rows * stride_out
    if ONE_PASS:
        # The row as a power-of-two head and a tail (288 words: 256 + 32, no masked lanes), both
        # loaded before either is stored: a load is not hoisted above a store to a possibly
        # aliasing pointer, so a column loop waits on memory once per step.
        head = tl.arange(0, HEAD)
        words = tl.load(src_row[:, None] + head[None, :], mask=src_ok[:, None], other=0)
        if BLOCK_TAIL > 0:
            tail = HEAD + tl.arange(0, BLOCK_TAIL)
            tail_ok = (tail < WORDS)[None, :]
            tail_words = tl.load(src_row[:, None] + tail[None, :], mask=src_ok[:, None] & tail_ok, other=0)
        tl.store(out_row[:, None] + head[None, :], words, mask=row_ok[:, None])
        if BLOCK_TAIL > 0:
            tl.store(out_row[:, None] + tail[None, :], tail_words, mask=row_ok[:, None] & tail_ok)
    else:
        for c0 in tl.static_range(0, WORDS, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_ok = (cols < WORDS)[None, :]
            words = tl.load(src_row[:, None] + cols[None, :], mask=src_ok[:, None] & col_ok, other=0)
            tl.store(out_row[:, None] + cols[None, :], words, mask=row_ok[:, None] & col_ok)


def _word_dtype(*byte_rows: torch.Tensor) -> torch.dtype:
    """The widest of int32 / int16 / uint8 that divides every row's byte size, row stride and address."""
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if all(t.shape[1] % size == 0 and t.stride(0) % size == 0 and t.data_ptr() % size == 0 for t in byte_rows):
            return dtype
    return torch.uint8


def _flat_rows(raw: torch.Tensor) -> torch.Tensor:
    """``[C, max_len, ...]`` -> ``[C * max_len, row elements]`` with contiguous rows (a view when possible)."""
    n_rows = raw.shape[0] * raw.shape[1]
    flat = raw.reshape(n_rows, -1)
    if flat.shape[1] == 1:  # a size-1 dim may carry any stride; make it 1 so the bytes view works
        return flat.as_strided((n_rows, 1), (flat.stride(0), 1))
    return flat if flat.stride(1) == 1 else flat.contiguous()


def rerange_padded_triton(
    raw: torch.Tensor,
    padded_index: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_t: int | None = None,
    block_c: int | None = None,
    num_warps: int | None = None,
    one_pass: bool | None = None,
) -> torch.Tensor:
    """``raw [C, max_len, *row]`` and ``padded_index int64 [T]`` -> ``[T, *row]``: ``raw_rows[padded_index]``.

    ``out`` (optional, ``[T, *row]`` of ``raw``'s dtype, contiguous) receives the result.
    ``block_t``, ``block_c``, ``num_warps`` and ``one_pass`` override the launch config
    (``rerange_kv`` or ``rerange_index`` of :mod:`.fused_configs`, by row bytes).
    """
    if raw.dim() < 2:
        raise ConfigError(f"rerange: raw must be [C, max_len, ...], got {tuple(raw.shape)}")
    if padded_index.dtype != torch.int64 or padded_index.dim() != 1 or padded_index.device != raw.device:
        raise ConfigError(
            f"rerange: padded_index must be int64 [T] on {raw.device}, got {padded_index.dtype} "
            f"{tuple(padded_index.shape)} on {padded_index.device}"
        )
    row_shape = tuple(raw.shape[2:])
    n_out = padded_index.shape[0]
    if out is None:
        out = torch.empty((n_out, *row_shape), dtype=raw.dtype, device=raw.device)
    elif out.shape != (n_out, *row_shape) or out.dtype != raw.dtype or not out.is_contiguous():
        raise ConfigError(
            f"rerange: out must be contiguous {raw.dtype} {(n_out, *row_shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    if n_out == 0 or out.numel() == 0:
        return out
    src_bytes = _flat_rows(raw).view(torch.uint8)
    dst_bytes = out.reshape(n_out, -1).view(torch.uint8)
    word = _word_dtype(src_bytes, dst_bytes)
    src, dst = src_bytes.view(word), dst_bytes.view(word)
    config = launch_config(
        rerange_kernel_name(src_bytes.shape[1]),
        raw.device,
        {"block_t": block_t, "block_c": block_c, "num_warps": num_warps, "one_pass": one_pass},
    )
    block_t, block_c, warps = int(config["block_t"]), int(config["block_c"]), int(config["num_warps"])
    words = src.shape[1]
    one_pass = bool(config["one_pass"])
    if not one_pass and block_c < 1:
        raise ConfigError(f"rerange: block_c={block_c} words per column step (one_pass=False needs >= 1)")
    head = 1 << (words.bit_length() - 1)  # the largest power of two <= words
    tail = words - head
    _rerange_kernel[(triton.cdiv(n_out, block_t),)](
        src,
        padded_index,
        dst,
        n_out,
        src.shape[0],
        src.stride(0),
        dst.stride(0),
        WORDS=words,
        BLOCK_T=block_t,
        BLOCK_C=head if one_pass else min(block_c, triton.next_power_of_2(words)),  # one pass: unused
        ONE_PASS=one_pass,
        HEAD=head,
        BLOCK_TAIL=triton.next_power_of_2(tail) if tail else 0,
        num_warps=warps,
    )
    return out

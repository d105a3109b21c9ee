"""DeepSeek-V4's cache entries, byte by byte, as the engines store them.

A V4 layer caches **entries** of one 512-wide KV head (448 dims without RoPE, then 64 with RoPE):
raw tokens for the sliding window, and pooled **compressed entries** on CSA / HCA layers (one per
4 or 128 tokens). CSA layers also cache one **indexer key** per compressed entry (128 dims,
Hadamard-rotated). Every multi-byte value is little-endian (the native ``Tensor.view(torch.uint8)``).

**Main entry, FP8** (``kv_dtype="fp8"``, FlashMLA's ``MODEL1_FP8Sparse``): 584 bytes.

=============  =====  ==========================================================================
bytes          count  contents
=============  =====  ==========================================================================
``[0, 448)``    448    e4m3 codes of the 448 non-RoPE dims, in 7 tiles of 64
``[448, 576)``  128    the 64 RoPE dims as bf16 (kept exact enough for positions)
``[576, 583)``    7    one ue8m0 scale per tile: the byte ``e`` means ``2^(e - 127)``
``583``           1    zero padding (8-byte scale block)
=============  =====  ==========================================================================

A tile's scale is ``2^ceil(log2(max(amax, 1e-4) / 448))`` and its code ``e4m3(x / scale)``:
DeepSeek's ``act_quant(kv[..., :-64], 64, "ue8m0")``, the quantization the model was trained with
(its inference code applies the same round trip in place). FlashMLA lays a **page** of ``P``
entries out as ``P x 576`` bytes of codes + RoPE (token-major), then ``P x 8`` scale bytes, the
page padded to a multiple of 576 bytes (:func:`main_page_bytes`, :func:`rows_to_page`).

**Main entry, BF16** (``kv_dtype="bf16"``): the 512 values as bf16, 1024 bytes.

**Indexer key, FP4** (``kv_dtype="fp8"``): 68 bytes. The model's inference code quantizes the
indexer's keys and queries to FP4 (e2m1, block 32, power-of-two scales) in place, so storing the
codes loses nothing.

=============  =====  ==========================================================================
``[0, 64)``      64    e2m1 codes, two per byte: element ``2i`` in the low nibble, ``2i+1`` high
``[64, 68)``      4    one ue8m0 scale per 32 values
=============  =====  ==========================================================================

An e2m1 code is a sign bit (``0x8``) and a 3-bit index into ``0, 0.5, 1, 1.5, 2, 3, 4, 6``;
``x / scale`` rounds to the nearest, ties to the even index; ``scale = 2^ceil(log2(amax / 6))``.
A page of ``P`` keys stores ``P x 64`` code bytes, then ``P x 4`` scale bytes.

**Indexer key, BF16** (``kv_dtype="bf16"``): 128 bf16 values, 256 bytes.

``"fp32"`` (float32 bytes of every value) is a third codec for references only: it makes a
layer's math comparable with unquantized implementations; no run stores it.
"""

from __future__ import annotations

from typing import Literal

import torch

from reference_impl.errors import ConfigError
from reference_impl.fp8 import FP8_DTYPE, act_quant, round_up_pow2

V4Codec = Literal["fp8", "bf16", "fp32"]
CODECS: tuple[str, ...] = ("fp8", "bf16", "fp32")
HEAD_DIM, ROPE_DIM, NOPE_DIM = 512, 64, 448
FP8_TILE = 64  # non-RoPE dims per ue8m0 scale
FP8_TILES = NOPE_DIM // FP8_TILE  # 7
FP8_ENTRY_BYTES = NOPE_DIM + 2 * ROPE_DIM + FP8_TILES + 1  # 584
FLASHMLA_PAGE_ALIGN = NOPE_DIM + 2 * ROPE_DIM  # a FlashMLA page is padded to a multiple of 576 bytes
FP4_BLOCK = 32
FP4_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
UE8M0_BIAS = 127


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ConfigError(f"V4 cache codec {codec!r}: use one of {', '.join(CODECS)}")


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def main_entry_bytes(codec: str) -> int:
    """Bytes of one main entry (raw or compressed): 584 (fp8), 1024 (bf16), 2048 (fp32)."""
    _check_codec(codec)
    return {"fp8": FP8_ENTRY_BYTES, "bf16": 2 * HEAD_DIM, "fp32": 4 * HEAD_DIM}[codec]


def index_entry_bytes(codec: str, index_head_dim: int = 128) -> int:
    """Bytes of one indexer key: FP4 codes + ue8m0 scales (68 for 128 dims), bf16, or fp32."""
    _check_codec(codec)
    if index_head_dim % FP4_BLOCK:
        raise ConfigError(f"index_head_dim={index_head_dim} is not a multiple of the FP4 block {FP4_BLOCK}")
    d = index_head_dim
    return {"fp8": d // 2 + d // FP4_BLOCK, "bf16": 2 * d, "fp32": 4 * d}[codec]


def main_page_bytes(page_size: int) -> int:
    """Bytes of one FlashMLA FP8 page of ``page_size`` entries (``P x 576 + P x 8``, padded to 576)."""
    raw = page_size * FP8_ENTRY_BYTES
    return -(-raw // FLASHMLA_PAGE_ALIGN) * FLASHMLA_PAGE_ALIGN


# --------------------------------------------------------------------------------------------
# ue8m0 scales
# --------------------------------------------------------------------------------------------


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales -> their ue8m0 bytes (the biased exponent)."""
    return ((scale.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def ue8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes -> float32 ``2^(e - 127)``."""
    return (codes.to(torch.int32) << 23).view(torch.float32)


# --------------------------------------------------------------------------------------------
# FP4 (e2m1)
# --------------------------------------------------------------------------------------------


def fp4_scales(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Power-of-two scales ``[..., n // block]`` float32: ``2^ceil(log2(max(amax, 6 * 2^-126) / 6))``."""
    n = x.shape[-1]
    amax = x.float().unflatten(-1, (n // block, block)).abs().amax(dim=-1).clamp(min=FP4_MAX * 2.0**-126)
    return round_up_pow2(amax / amax.new_full((1,), FP4_MAX))


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code of each value of ``y`` (already divided by its scale), ties to the even index.

    Returns uint8 codes ``sign << 3 | index``.
    """
    a = y.float().abs()
    index = torch.zeros(a.shape, dtype=torch.uint8, device=y.device)
    for i, (below, above) in enumerate(zip(E2M1_GRID, E2M1_GRID[1:])):  # past each midpoint, one index up
        mid = 0.5 * (below + above)
        index += ((a > mid) | ((a == mid) & (i % 2 == 1))).to(torch.uint8)  # a tie goes to the even index
    sign = (y < 0) & (index > 0)  # -0 is stored as +0
    return index | (sign.to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes -> float32 values."""
    index = (codes & 7).to(torch.float32)
    # 1 sign, 2 exponent, 1 mantissa bits: normal codes 2..7 are 2^(e - 1) * (1 + m / 2), codes 0, 1 are 0, 0.5.
    exponent, mantissa = torch.floor(index / 2), index - 2 * torch.floor(index / 2)
    magnitude = torch.where(index >= 2, torch.exp2(exponent - 1) * (1 + 0.5 * mantissa), 0.5 * index)
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def fp4_quant(x: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., n]`` -> ``(codes [..., n] uint8, scales [..., n // block] float32)``."""
    scale = fp4_scales(x, block)
    n = x.shape[-1]
    y = x.float().unflatten(-1, (n // block, block)) / scale.unsqueeze(-1)
    return e2m1_codes(y.flatten(-2)), scale


def fp4_dequant(codes: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    n = codes.shape[-1]
    return (e2m1_values(codes).unflatten(-1, (n // block, block)) * scale.unsqueeze(-1)).flatten(-2)


def fp4_simulate(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """The FP4 round trip ``dequant(quant(x))`` in ``x.dtype`` (the model's in-place simulation)."""
    codes, scale = fp4_quant(x, block)
    return fp4_dequant(codes, scale, block).to(x.dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` 4-bit codes -> ``[..., n // 2]`` bytes, element ``2i`` in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# --------------------------------------------------------------------------------------------
# Main entries
# --------------------------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def encode_main(x: torch.Tensor, codec: str) -> torch.Tensor:
    """Main entries ``x [N, 512]`` (any float dtype) -> ``uint8 [N, main_entry_bytes(codec)]``."""
    _check_codec(codec)
    if x.dim() != 2 or x.shape[1] != HEAD_DIM:
        raise ConfigError(f"encode_main expects [N, {HEAD_DIM}] entries, got {tuple(x.shape)}")
    n = x.shape[0]
    if n == 0:
        return torch.empty(0, main_entry_bytes(codec), dtype=torch.uint8, device=x.device)
    if codec == "bf16":
        return _bytes(x.to(torch.bfloat16))
    if codec == "fp32":
        return _bytes(x.to(torch.float32))
    codes, scales = act_quant(x[:, :NOPE_DIM], FP8_TILE, "ue8m0")
    pad = torch.zeros(n, 1, dtype=torch.uint8, device=x.device)
    return torch.cat([_bytes(codes), _bytes(x[:, NOPE_DIM:].to(torch.bfloat16)), ue8m0_bytes(scales), pad], dim=1)


def decode_main(rows: torch.Tensor, codec: str) -> torch.Tensor:
    """``uint8 [N, main_entry_bytes]`` -> float32 ``[N, 512]``."""
    _check_codec(codec)
    n = rows.shape[0]
    if rows.dim() != 2 or rows.shape[1] != main_entry_bytes(codec):
        raise ConfigError(f"decode_main expects [N, {main_entry_bytes(codec)}] {codec} rows, got {tuple(rows.shape)}")
    if n == 0:
        return torch.empty(0, HEAD_DIM, dtype=torch.float32, device=rows.device)
    if codec == "bf16":
        return rows.contiguous().view(torch.bfloat16).float()
    if codec == "fp32":
        return rows.contiguous().view(torch.float32).clone()
    codes = rows[:, :NOPE_DIM].contiguous().view(FP8_DTYPE).float()
    rope = rows[:, NOPE_DIM : NOPE_DIM + 2 * ROPE_DIM].contiguous().view(torch.bfloat16).float()
    scales = ue8m0_values(rows[:, NOPE_DIM + 2 * ROPE_DIM : NOPE_DIM + 2 * ROPE_DIM + FP8_TILES])
    nope = (codes.unflatten(-1, (FP8_TILES, FP8_TILE)) * scales.unsqueeze(-1)).flatten(-2)
    return torch.cat([nope, rope], dim=1)


def rows_to_page(rows: torch.Tensor) -> torch.Tensor:
    """``P`` FP8 entry rows ``[P, 584]`` -> one FlashMLA page: codes + RoPE of every entry, then their
    scale blocks, padded to :func:`main_page_bytes` (uint8 ``[main_page_bytes(P)]``)."""
    p = rows.shape[0]
    page = torch.zeros(main_page_bytes(p), dtype=torch.uint8, device=rows.device)
    data = NOPE_DIM + 2 * ROPE_DIM
    page[: p * data] = rows[:, :data].reshape(-1)
    page[p * data : p * FP8_ENTRY_BYTES] = rows[:, data:].reshape(-1)
    return page


def page_to_rows(page: torch.Tensor, page_size: int) -> torch.Tensor:
    """Inverse of :func:`rows_to_page`."""
    data = NOPE_DIM + 2 * ROPE_DIM
    head = page[: page_size * data].view(page_size, data)
    tail = page[page_size * data : page_size * FP8_ENTRY_BYTES].view(page_size, FP8_TILES + 1)
    return torch.cat([head, tail], dim=1)


# --------------------------------------------------------------------------------------------
# Indexer keys
# --------------------------------------------------------------------------------------------


def encode_index(x: torch.Tensor, codec: str) -> torch.Tensor:
    """Indexer keys ``x [N, D]`` -> ``uint8 [N, index_entry_bytes(codec, D)]``."""
    _check_codec(codec)
    n, d = x.shape
    if n == 0:
        return torch.empty(0, index_entry_bytes(codec, d), dtype=torch.uint8, device=x.device)
    if codec == "bf16":
        return _bytes(x.to(torch.bfloat16))
    if codec == "fp32":
        return _bytes(x.to(torch.float32))
    codes, scales = fp4_quant(x)
    return torch.cat([pack_nibbles(codes), ue8m0_bytes(scales)], dim=1)


def decode_index(rows: torch.Tensor, codec: str, index_head_dim: int = 128) -> torch.Tensor:
    """``uint8 [N, index_entry_bytes]`` -> float32 ``[N, D]``."""
    _check_codec(codec)
    d = index_head_dim
    if rows.dim() != 2 or rows.shape[1] != index_entry_bytes(codec, d):
        raise ConfigError(
            f"decode_index expects [N, {index_entry_bytes(codec, d)}] {codec} rows, got {tuple(rows.shape)}"
        )
    if rows.shape[0] == 0:
        return torch.empty(0, d, dtype=torch.float32, device=rows.device)
    if codec == "bf16":
        return rows.contiguous().view(torch.bfloat16).float()
    if codec == "fp32":
        return rows.contiguous().view(torch.float32).clone()
    codes = unpack_nibbles(rows[:, : d // 2])
    return fp4_dequant(codes, ue8m0_values(rows[:, d // 2 :]))

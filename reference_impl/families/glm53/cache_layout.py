"""GLM-5.3's latent row in the KV cache: plain bf16, or FP8 with one scale per 128-value tile.

GLM-5.3's MLA has no RoPE part (``qk_rope_head_dim = 0``), so its cache row is the ``kv_lora_rank``-wide
latent alone. The FP8 row (``kv_dtype="fp8"``, the default) is DeepSeek-V3.2's packed FP8 row
(:mod:`reference_impl.kvcache.layout`) with its RoPE part of length zero:

==========  ===========  ==================================================================
bytes       what         how
==========  ===========  ==================================================================
0 - 511     latent       e4m3 codes, ``latent / scale`` of its 128-value tile
512 - 527   tile scales  4 float32, little-endian, one per 128-value tile, in tile order
==========  ===========  ==================================================================

528 bytes per token per indexed layer on GLM-5.3-Flash (``kv_lora_rank = 512``), against 1024 in bf16;
33 x 16 bytes, so rows stay 16-byte aligned. The scales are ``max(amax, 1e-4) / 448`` of the tile,
rounded up to a power of two with ``mla_scale_fmt="ue8m0"`` (the default: DeepSeek's inference code and
FlashMLA's FP8 KV read this form) or kept as they are with ``"fp32"`` (SGLang's); the bytes are laid out
the same either way. Keeping DSA's row without the RoPE tail, rather than a new layout, lets a port point
a FlashMLA-style FP8 sparse decode kernel at these rows with its RoPE length set to zero.

The quantizer is :func:`reference_impl.fp8.act_quant` (through :func:`~reference_impl.kvcache.layout.pack_mla`);
nothing here re-implements it. :class:`LatentRows` is what the store and the oracle hold: one encoding
for both, so a CP run's rows can be compared with the oracle's byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.errors import ConfigError
from reference_impl.fp8 import FP8_MAX, SCALE_FMTS, block_scales
from reference_impl.kvcache.layout import MLA_QUANT_BLOCK, SCALE_BYTES, dequantize_mla, pack_mla, unpack_mla_fp8

FP8_TILE = MLA_QUANT_BLOCK  # latent values per float32 scale
FLASH_KV_LORA_RANK = 512
LATENT_OFFSET = 0  # the e4m3 codes: bytes [0, kv_lora_rank)
SCALE_OFFSET = FLASH_KV_LORA_RANK  # the scales: bytes [kv_lora_rank, kv_lora_rank + 4 * tiles)
ROW_BYTES = FLASH_KV_LORA_RANK + FLASH_KV_LORA_RANK // FP8_TILE * SCALE_BYTES  # 528 on GLM-5.3-Flash
BF16_ROW_BYTES = FLASH_KV_LORA_RANK * 2  # 1024


def check_fp8_width(kv_lora_rank: int, name: str = "kv_lora_rank") -> None:
    """Refuse a latent width the FP8 row cannot tile (one scale per 128 values)."""
    if kv_lora_rank <= 0 or kv_lora_rank % FP8_TILE:
        raise ConfigError(
            f"{name}={kv_lora_rank}: GLM-5.3's FP8 latent row keeps one scale per {FP8_TILE} values, so the "
            f"width must be a positive multiple of {FP8_TILE}; use kv_dtype='bf16'"
        )


def fp8_row_bytes(kv_lora_rank: int) -> int:
    """Bytes of one FP8 row: ``kv_lora_rank`` codes + one float32 scale per tile (528 for 512)."""
    check_fp8_width(kv_lora_rank)
    return kv_lora_rank + kv_lora_rank // FP8_TILE * SCALE_BYTES


def encode_fp8_rows(latent: torch.Tensor, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """``latent [N, kv_lora_rank]`` (any float dtype) -> ``uint8 [N, fp8_row_bytes]`` (module docstring)."""
    if latent.dim() != 2:
        raise ConfigError(f"latent must be [N, kv_lora_rank], got shape {tuple(latent.shape)}")
    check_fp8_width(latent.shape[1], "latent width")
    if scale_fmt not in SCALE_FMTS:
        raise ConfigError(f"scale_fmt={scale_fmt!r}: use one of {', '.join(SCALE_FMTS)}")
    return pack_mla(latent, latent.shape[1], "fp8", scale_fmt)


def fp8_row_parts(rows: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8 [N, fp8_row_bytes]`` -> ``(codes [N, kv_lora_rank] float8_e4m3fn, scales [N, tiles] float32)``."""
    check_fp8_width(kv_lora_rank)
    codes, scales, _ = unpack_mla_fp8(rows, kv_lora_rank, 0)
    return codes, scales


def decode_fp8_rows(rows: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """``uint8 [N, fp8_row_bytes]`` -> ``float32 [N, kv_lora_rank]``: codes times their tile's scale."""
    check_fp8_width(kv_lora_rank)
    return dequantize_mla(rows, kv_lora_rank, 0, "fp8")


def fp8_rows_in_format(rows: torch.Tensor, kv_lora_rank: int, scale_fmt: str) -> torch.Tensor:
    """``bool [N]``: whether each FP8 row is in ``scale_fmt``'s form, read from its own bytes (no reference).

    A tile above the amax floor maps its amax to the top code 448 with ``"fp32"`` scales and to a code in
    ``[224, 448]`` with ``"ue8m0"`` (a power of two, rounded up, halves it at most); a tile at the floor has
    the floor's scale. A row quantized with the other format, or by another rule, fails one of them.
    """
    codes, scales = fp8_row_parts(rows, kv_lora_rank)
    top = codes.float().abs().unflatten(-1, (-1, FP8_TILE)).amax(-1)
    floor = block_scales(torch.zeros(1, FP8_TILE), FP8_TILE, scale_fmt)[0, 0]
    if scale_fmt == "ue8m0":
        ok = (torch.frexp(scales)[0] == 0.5) & ((top >= FP8_MAX / 2) | (scales == floor))
    else:
        ok = (top == FP8_MAX) | (scales == floor)
    return ok.all(dim=-1)


@dataclass(frozen=True)
class LatentRows:
    """How latent rows are stored: FP8 rows (``fp8``, scales in ``scale_fmt``) or plain rows of ``dtype``
    (bf16 in a run; float32 where the model tests compare with ``transformers``)."""

    kv_lora_rank: int
    fp8: bool = False
    scale_fmt: str = "ue8m0"
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.fp8:
            check_fp8_width(self.kv_lora_rank)
            if self.scale_fmt not in SCALE_FMTS:
                raise ConfigError(f"mla_scale_fmt={self.scale_fmt!r}: use one of {', '.join(SCALE_FMTS)}")

    @classmethod
    def for_run(cls, kv_lora_rank: int, kv_dtype: str, scale_fmt: str) -> LatentRows:
        """A run's rows: ``kv_dtype`` ``"fp8"`` (the FP8 row) or ``"bf16"``."""
        if kv_dtype not in ("fp8", "bf16"):
            raise ConfigError(f"kv_dtype={kv_dtype!r}: GLM-5.3 keeps 'fp8' or 'bf16' latent rows")
        return cls(kv_lora_rank, fp8=kv_dtype == "fp8", scale_fmt=scale_fmt)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fp8 else self.dtype

    @property
    def width(self) -> int:
        """Columns of a stored row (bytes for FP8)."""
        return fp8_row_bytes(self.kv_lora_rank) if self.fp8 else self.kv_lora_rank

    @property
    def row_bytes(self) -> int:
        return self.width * torch.empty(0, dtype=self.storage_dtype).element_size()

    def empty(self, n: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(n, self.width, dtype=self.storage_dtype, device=device)

    def encode(self, latent: torch.Tensor) -> torch.Tensor:
        """Latent values ``[N, kv_lora_rank]`` -> stored rows; rows already stored this way pass unchanged
        (a cached prefix's rows, from the oracle)."""
        if latent.dtype == self.storage_dtype and latent.shape[-1] == self.width:
            return latent
        if latent.shape[-1] != self.kv_lora_rank:
            raise ConfigError(f"latent rows of width {latent.shape[-1]}: expected {self.kv_lora_rank}")
        return encode_fp8_rows(latent, self.scale_fmt) if self.fp8 else latent.to(self.dtype)

    def in_format(self, rows: torch.Tensor) -> torch.Tensor:
        """``bool [N]``: FP8 rows in this scale format (:func:`fp8_rows_in_format`); plain rows always."""
        if not self.fp8:
            return torch.ones(len(rows), dtype=torch.bool, device=rows.device)
        return fp8_rows_in_format(rows, self.kv_lora_rank, self.scale_fmt)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows -> the latent values attention reads (float32 from FP8; plain rows as they are)."""
        return decode_fp8_rows(rows, self.kv_lora_rank) if self.fp8 else rows

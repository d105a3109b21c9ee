"""Byte layouts of the KV cache, per token per layer, as ``torch.uint8`` rows.

Three buffers (DeepSeek-V3.2 / GLM-5 sizes; ``L = kv_lora_rank``, ``R = qk_rope_head_dim``):

* **MLA latent, BF16 direct**: ``L + R`` bf16 values -> ``(L + R) * 2`` bytes (1152).
* **MLA latent, packed FP8**: ``L`` e4m3 bytes, then ``L // 128`` float32 scales (one per 128
  latent values, ``scale = max(amax, 1e-4) / 448``, rounded up to a power of two with
  ``mla_scale_fmt="ue8m0"``, DeepSeek's ``act_quant(kv, 128, "ue8m0")``, or kept as it is with
  ``"fp32"``, SGLang's), then ``R`` bf16 rope values -> ``L + 4 * L // 128 + 2 * R`` bytes
  (512 + 16 + 128 = 656) in both formats.
* **Indexer K**: 128 e4m3 bytes + one float32 scale per token (132 bytes). A page of ``P``
  tokens stores the ``P * 128`` fp8 bytes first (token-major), then the ``P`` scales (8448 bytes
  for ``P = 64``). Quantized as ``act_quant(k, 128, index_scale_fmt)``. With IndexShare only the
  model's full layers keep this buffer (:attr:`KVLayout.index_layers`).

Every multi-byte value is little-endian: the bytes are the native ``Tensor.view(torch.uint8)``
of each part, which is what the CUDA kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.config import KVDtype, validate_page_size
from reference_impl.errors import ConfigError
from reference_impl.fp8 import FP8_DTYPE, act_dequant, act_quant
from reference_impl.presets import SCALE_FMTS, ModelConfig

MLA_QUANT_BLOCK = 128  # latent values per float32 scale in the packed FP8 layout
INDEX_HEAD_DIM = 128  # indexer K width; one quantization block, hence one scale per token
SCALE_BYTES = 4  # float32
KV_DTYPES: tuple[str, ...] = ("bf16", "fp8")


def _check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype={kv_dtype!r}: use 'bf16' or 'fp8'")


def _check_dims(kv_lora: int, rope: int) -> None:
    if kv_lora <= 0 or kv_lora % MLA_QUANT_BLOCK:
        raise ConfigError(
            f"kv_lora={kv_lora} must be a positive multiple of {MLA_QUANT_BLOCK}: the packed FP8 layout "
            "keeps one scale per 128 latent values"
        )
    if rope < 0 or rope % 2:
        raise ConfigError(f"rope={rope} must be even and >= 0 (bf16 rope keeps rows 4-byte aligned)")


def _check_scale_fmt(name: str, scale_fmt: str) -> None:
    if scale_fmt not in SCALE_FMTS:
        raise ConfigError(f"{name}={scale_fmt!r}: use 'ue8m0' or 'fp32'")


def _check_index_head_dim(index_head_dim: int) -> None:
    if index_head_dim != INDEX_HEAD_DIM:
        raise ConfigError(
            f"index_head_dim={index_head_dim}: the indexer K layout holds one float32 scale per token, "
            f"which needs exactly one FP8 block of {INDEX_HEAD_DIM} values"
        )


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def mla_token_bytes(cfg_or_dims: ModelConfig | tuple[int, int], kv_dtype: str) -> int:
    """Bytes of one token's MLA entry: ``(L + R) * 2`` for bf16, ``L + L // 32 + 2 * R`` for fp8.

    ``cfg_or_dims`` is a :class:`ModelConfig` or a ``(kv_lora, rope)`` pair.
    """
    _check_kv_dtype(kv_dtype)
    if isinstance(cfg_or_dims, ModelConfig):
        kv_lora, rope = cfg_or_dims.kv_lora_rank, cfg_or_dims.qk_rope_head_dim
    else:
        kv_lora, rope = cfg_or_dims
    _check_dims(kv_lora, rope)
    if kv_dtype == "bf16":
        return (kv_lora + rope) * 2
    return kv_lora + (kv_lora // MLA_QUANT_BLOCK) * SCALE_BYTES + rope * 2


def index_token_bytes(index_head_dim: int = INDEX_HEAD_DIM) -> int:
    """Bytes of one token's indexer K: ``index_head_dim`` e4m3 + one float32 scale (132)."""
    _check_index_head_dim(index_head_dim)
    return index_head_dim + SCALE_BYTES


def index_page_bytes(page_size: int, index_head_dim: int = INDEX_HEAD_DIM) -> int:
    """Bytes of one indexer K page: ``page_size * (index_head_dim + 4)`` (8448 for 64 tokens)."""
    validate_page_size(page_size)
    return page_size * index_token_bytes(index_head_dim)


# --------------------------------------------------------------------------------------------
# MLA latent
# --------------------------------------------------------------------------------------------


def pack_mla(kv: torch.Tensor, kv_lora: int, kv_dtype: str, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """Pack ``kv [N, kv_lora + rope]`` (any float dtype) into ``uint8 [N, mla_token_bytes]`` rows.

    bf16: the bf16 bytes of all values. fp8: e4m3 latent, float32 block scales (``scale_fmt``:
    ``"ue8m0"`` powers of two, ``"fp32"`` ``amax / 448``), bf16 rope.
    """
    _check_kv_dtype(kv_dtype)
    _check_scale_fmt("mla scale_fmt", scale_fmt)
    if kv.dim() != 2:
        raise ConfigError(f"pack_mla expects kv [N, kv_lora + rope], got shape {tuple(kv.shape)}")
    rope = kv.shape[1] - kv_lora
    _check_dims(kv_lora, rope)
    n = kv.shape[0]
    if n == 0:  # empty tensors may carry strides that refuse a dtype view
        return torch.empty(0, mla_token_bytes((kv_lora, rope), kv_dtype), dtype=torch.uint8, device=kv.device)
    if kv_dtype == "bf16":
        return kv.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, kv.shape[1] * 2)
    latent_fp8, scales = act_quant(kv[:, :kv_lora], MLA_QUANT_BLOCK, scale_fmt)
    rope_bf16 = kv[:, kv_lora:].to(torch.bfloat16).contiguous()
    parts = (latent_fp8.contiguous(), scales.contiguous(), rope_bf16)
    return torch.cat([p.view(torch.uint8).reshape(n, p.shape[1] * p.element_size()) for p in parts], dim=1)


def _byte_columns(rows: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    # contiguous() first: viewing a column slice as a wider dtype needs aligned, dense storage.
    return rows[:, start:stop].contiguous().view(dtype)


def unpack_mla_fp8(rows: torch.Tensor, kv_lora: int, rope: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split packed FP8 rows ``uint8 [N, bytes]`` into their parts.

    Returns ``(latent [N, kv_lora] float8_e4m3fn, scales [N, kv_lora // 128] float32,
    rope [N, rope] bfloat16)``.
    """
    expected = mla_token_bytes((kv_lora, rope), "fp8")
    _check_rows(rows, expected, "fp8")
    scale_end = kv_lora + (kv_lora // MLA_QUANT_BLOCK) * SCALE_BYTES
    return (
        _byte_columns(rows, 0, kv_lora, FP8_DTYPE),
        _byte_columns(rows, kv_lora, scale_end, torch.float32),
        _byte_columns(rows, scale_end, expected, torch.bfloat16),
    )


def dequantize_mla(rows: torch.Tensor, kv_lora: int, rope: int, kv_dtype: str) -> torch.Tensor:
    """Rows ``uint8 [N, bytes]`` -> ``float32 [N, kv_lora + rope]`` (the full-view values)."""
    expected = mla_token_bytes((kv_lora, rope), kv_dtype)
    _check_rows(rows, expected, kv_dtype)
    if kv_dtype == "bf16":
        return rows.contiguous().view(torch.bfloat16).float()
    latent, scales, rope_bf16 = unpack_mla_fp8(rows, kv_lora, rope)
    return torch.cat([act_dequant(latent, scales, MLA_QUANT_BLOCK), rope_bf16.float()], dim=1)


def _check_rows(rows: torch.Tensor, expected_bytes: int, kv_dtype: str) -> None:
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != expected_bytes:
        raise ConfigError(
            f"MLA rows must be uint8 [N, {expected_bytes}] for kv_dtype={kv_dtype}, "
            f"got {rows.dtype} {tuple(rows.shape)}"
        )


# --------------------------------------------------------------------------------------------
# Indexer K
# --------------------------------------------------------------------------------------------


def quantize_index_k(k: torch.Tensor, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize indexer keys ``k [N, 128]`` -> ``(k_fp8 [N, 128] float8_e4m3fn, k_scale [N] float32)``.

    ``scale_fmt`` is ``ModelConfig.index_scale_fmt``: ``"ue8m0"`` rounds scales up to powers of two.
    """
    if k.dim() != 2:
        raise ConfigError(f"quantize_index_k expects k [N, {INDEX_HEAD_DIM}], got shape {tuple(k.shape)}")
    _check_index_head_dim(k.shape[1])
    _check_scale_fmt("index scale_fmt", scale_fmt)
    k_fp8, scale = act_quant(k, INDEX_HEAD_DIM, scale_fmt)
    return k_fp8, scale.reshape(-1)


def pack_index_pages(k_fp8: torch.Tensor, k_scale: torch.Tensor, page_size: int) -> torch.Tensor:
    """Lay tokens ``0..N-1`` out as pages -> ``uint8 [ceil(N / P), P * 132]``.

    Page ``p`` holds tokens ``p*P .. p*P+P-1``: their fp8 bytes (token-major) at ``[0, P*128)``,
    then their float32 scales at ``P*128 + 4*slot``. Slots past ``N`` are zero.
    """
    n, dim = k_fp8.shape
    page_bytes = index_page_bytes(page_size, dim)
    if k_fp8.dtype != FP8_DTYPE or k_scale.shape != (n,) or k_scale.dtype != torch.float32:
        raise ConfigError(
            f"pack_index_pages expects k_fp8 [N, {dim}] float8_e4m3fn and k_scale [N] float32, got "
            f"{k_fp8.dtype} {tuple(k_fp8.shape)} and {k_scale.dtype} {tuple(k_scale.shape)}"
        )
    n_pages = -(-n // page_size)
    padded = n_pages * page_size
    values = torch.zeros(padded, dim, dtype=torch.uint8, device=k_fp8.device)
    values[:n] = k_fp8.contiguous().view(torch.uint8)
    scales = torch.zeros(padded, SCALE_BYTES, dtype=torch.uint8, device=k_fp8.device)
    scales[:n] = k_scale.contiguous().view(torch.uint8).reshape(n, SCALE_BYTES)
    pages = torch.cat(
        [values.reshape(n_pages, page_size * dim), scales.reshape(n_pages, page_size * SCALE_BYTES)], dim=1
    )
    assert pages.shape[1] == page_bytes
    return pages


def unpack_index_pages(
    pages: torch.Tensor, n_tokens: int, index_head_dim: int = INDEX_HEAD_DIM
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_index_pages`: the first ``n_tokens`` tokens -> ``(k_fp8 [n, D], k_scale [n])``."""
    token_bytes = index_token_bytes(index_head_dim)
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] % token_bytes:
        raise ConfigError(
            f"index pages must be uint8 [n_pages, P * {token_bytes}], got {pages.dtype} {tuple(pages.shape)}"
        )
    page_size = pages.shape[1] // token_bytes
    validate_page_size(page_size)
    if not 0 <= n_tokens <= pages.shape[0] * page_size:
        raise ConfigError(f"n_tokens={n_tokens} does not fit {pages.shape[0]} pages of {page_size} tokens")
    split = page_size * index_head_dim
    n_slots = pages.shape[0] * page_size
    values = pages[:, :split].reshape(n_slots, index_head_dim)[:n_tokens]
    scales = pages[:, split:].reshape(n_slots, SCALE_BYTES)[:n_tokens]
    return values.contiguous().view(FP8_DTYPE), scales.contiguous().view(torch.float32).reshape(-1)


# --------------------------------------------------------------------------------------------
# The layout of one pool
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout:
    """The byte layout of one model's KV pools; build it with :meth:`from_config`.

    ``index_layers``: the layers that keep an indexer K buffer (IndexShare's full layers,
    :class:`~reference_impl.index_share.IndexShare`), ascending; ``None``: every layer.
    """

    kv_lora: int
    rope: int
    kv_dtype: KVDtype
    page_size: int
    index_head_dim: int = INDEX_HEAD_DIM
    index_scale_fmt: str = "ue8m0"
    mla_scale_fmt: str = "ue8m0"
    index_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_kv_dtype(self.kv_dtype)
        _check_dims(self.kv_lora, self.rope)
        _check_index_head_dim(self.index_head_dim)
        validate_page_size(self.page_size)
        _check_scale_fmt("index_scale_fmt", self.index_scale_fmt)
        _check_scale_fmt("mla_scale_fmt", self.mla_scale_fmt)
        if self.index_layers is not None and (
            list(self.index_layers) != sorted(set(self.index_layers)) or min(self.index_layers, default=0) < 0
        ):
            raise ConfigError(f"index_layers={self.index_layers}: need distinct layer ids >= 0, ascending")

    @classmethod
    def from_config(cls, cfg: ModelConfig, kv_dtype: str, page_size: int) -> KVLayout:
        _check_kv_dtype(kv_dtype)
        share = cfg.index_share
        return cls(
            kv_lora=cfg.kv_lora_rank,
            rope=cfg.qk_rope_head_dim,
            kv_dtype=kv_dtype,  # type: ignore[arg-type]
            page_size=page_size,
            index_head_dim=cfg.index_head_dim,
            index_scale_fmt=cfg.index_scale_fmt,
            mla_scale_fmt=cfg.mla_scale_fmt,
            index_layers=share.full_layers if share.shares else None,
        )

    def has_index(self, layer: int) -> bool:
        """Whether ``layer`` keeps indexer K (IndexShare: full layers only)."""
        return self.index_layers is None or layer in self.index_layers

    @property
    def kv_width(self) -> int:
        """Values per token before packing: latent + rope (576)."""
        return self.kv_lora + self.rope

    @property
    def mla_bytes(self) -> int:
        """Bytes per token per layer of the MLA buffer (656 fp8 / 1152 bf16)."""
        return mla_token_bytes((self.kv_lora, self.rope), self.kv_dtype)

    @property
    def index_bytes(self) -> int:
        """Bytes per token per layer of the indexer K buffer (132)."""
        return index_token_bytes(self.index_head_dim)

    @property
    def mla_page_bytes(self) -> int:
        return self.page_size * self.mla_bytes

    @property
    def index_page_bytes(self) -> int:
        return index_page_bytes(self.page_size, self.index_head_dim)

    def pack_mla(self, kv: torch.Tensor) -> torch.Tensor:
        """``kv [N, kv_width]`` -> ``uint8 [N, mla_bytes]`` (FP8 scales in ``mla_scale_fmt``)."""
        return pack_mla(kv, self.kv_lora, self.kv_dtype, self.mla_scale_fmt)

    def dequantize_mla(self, rows: torch.Tensor) -> torch.Tensor:
        """``uint8 [N, mla_bytes]`` -> ``float32 [N, kv_width]``."""
        return dequantize_mla(rows, self.kv_lora, self.rope, self.kv_dtype)

    def quantize_index_k(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k [N, 128]`` -> ``(k_fp8 [N, 128], k_scale [N])`` with this model's scale format."""
        return quantize_index_k(k, self.index_scale_fmt)

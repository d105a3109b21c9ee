"""KV byte layouts: checked byte for byte against encoders written here with numpy/struct."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl.config import ConfigError, get_preset, validate_page_size
from reference_impl.kvcache import (
    KVLayout,
    dequantize_mla,
    index_page_bytes,
    index_token_bytes,
    mla_token_bytes,
    pack_index_pages,
    pack_mla,
    quantize_index_k,
    unpack_index_pages,
    unpack_mla_fp8,
)

# ---------------------------------------------------------------------------------------------
# Independent encoders (numpy only)
# ---------------------------------------------------------------------------------------------


def _e4m3_table() -> np.ndarray:
    """Values of the finite non-negative e4m3fn codes 0x00..0x7E, ascending."""
    values = []
    for code in range(0x7F):
        exp, man = code >> 3, code & 7
        values.append(man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return np.array(values, dtype=np.float64)


E4M3 = _e4m3_table()


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn code bytes, round to nearest, ties to even code, saturating at 448."""
    mag = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(E4M3, mag), 1, len(E4M3) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - E4M3[lo], E4M3[hi] - mag
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (code | (np.signbit(x).astype(np.int64) << 7)).astype(np.uint8)


def encode_bf16_le(x: np.ndarray) -> bytes:
    """float32 -> bf16 (round to nearest even) little-endian bytes."""
    u = x.astype("<f4").view("<u4").astype(np.uint64)
    b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    return b.tobytes()


def pow2_at_least(x: np.ndarray) -> np.ndarray:
    """The smallest power of two >= each positive float32 (by frexp: ``x = m * 2**e``, ``0.5 <= m < 1``)."""
    mantissa, exponent = np.frexp(x.astype(np.float64))
    return np.ldexp(1.0, np.where(mantissa == 0.5, exponent - 1, exponent)).astype(np.float32)


def expected_fp8_row(row: np.ndarray, kv_lora: int, scale_fmt: str = "fp32") -> bytes:
    latent = row[:kv_lora].astype(np.float32)
    blocks = latent.reshape(-1, 128)
    scales = np.maximum(np.abs(blocks).max(axis=1), np.float32(1e-4)) / np.float32(448)
    if scale_fmt == "ue8m0":  # DeepSeek's act_quant(kv, 128, "ue8m0"): rounded up to a power of two
        scales = pow2_at_least(scales)
    codes = encode_e4m3((blocks / scales[:, None]).astype(np.float32).reshape(-1))
    return codes.tobytes() + struct.pack(f"<{len(scales)}f", *scales) + encode_bf16_le(row[kv_lora:])


def _rand(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------


def test_token_and_page_sizes() -> None:
    for preset in ("deepseek-v3.2", "glm-5"):
        cfg = get_preset(preset)
        assert mla_token_bytes(cfg, "fp8") == 656
        assert mla_token_bytes(cfg, "bf16") == 1152
    assert mla_token_bytes(get_preset("tiny"), "fp8") == 128 + 4 + 128
    assert mla_token_bytes((256, 32), "bf16") == (256 + 32) * 2
    assert index_token_bytes(128) == 132
    assert index_page_bytes(64, 128) == 8448
    layout = KVLayout.from_config(get_preset("deepseek-v3.2"), "fp8", 64)
    assert (layout.mla_bytes, layout.index_bytes, layout.index_page_bytes) == (656, 132, 8448)
    assert layout.mla_page_bytes == 64 * 656 and layout.kv_width == 576
    assert layout.index_scale_fmt == "ue8m0"


def test_bad_dims_and_dtypes_raise() -> None:
    with pytest.raises(ConfigError, match="kv_dtype"):
        mla_token_bytes((512, 64), "fp16")
    with pytest.raises(ConfigError, match="multiple of 128"):
        mla_token_bytes((500, 64), "fp8")
    with pytest.raises(ConfigError, match="index_head_dim=256"):
        index_token_bytes(256)
    with pytest.raises(ConfigError, match="uint8"):
        dequantize_mla(torch.zeros(2, 655, dtype=torch.uint8), 512, 64, "fp8")


@pytest.mark.parametrize("page_size", [0, -4, 1, 2, 3, 6, 48, 8192])
def test_invalid_page_sizes_raise(page_size: int) -> None:
    with pytest.raises(ConfigError, match=f"page_size={page_size}"):
        validate_page_size(page_size)


def test_small_page_message_says_why() -> None:
    with pytest.raises(ConfigError, match="16-byte vectors"):
        validate_page_size(2)
    with pytest.raises(ConfigError, match="16-byte vectors"):
        KVLayout(kv_lora=512, rope=64, kv_dtype="fp8", page_size=2)
    for ok in (4, 64, 4096):
        validate_page_size(ok)


# ---------------------------------------------------------------------------------------------
# MLA latent
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("kv_lora,rope", [(512, 64), (128, 64), (256, 2)])
def test_fp8_mla_bytes_match_independent_layout(kv_lora: int, rope: int, scale_fmt: str) -> None:
    kv = _rand((5, kv_lora + rope), seed=kv_lora + rope)
    kv[1, :128] = 0.0  # an all-zero block takes the amax floor
    kv[2, 128 : 128 + kv_lora - 128] *= 1e4  # large values elsewhere
    kv[3] *= 1e-6  # below the floor everywhere
    kv[4, :128] = 448.0 * 2.0**-3  # amax / 448 exactly a power of two: ue8m0 keeps it
    rows = pack_mla(kv, kv_lora, "fp8", scale_fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (5, mla_token_bytes((kv_lora, rope), "fp8"))
    for i in range(5):
        assert rows[i].numpy().tobytes() == expected_fp8_row(kv[i].numpy(), kv_lora, scale_fmt), f"token {i}"


def test_mla_scale_formats_differ_only_in_latent_bytes_and_scales() -> None:
    """Same 656-byte row; ue8m0 (the default, DeepSeek's) scales are powers of two >= the fp32 ones."""
    kv = _rand((8, 576), seed=13, scale=3.0)
    ue8m0, fp32 = pack_mla(kv, 512, "fp8"), pack_mla(kv, 512, "fp8", "fp32")
    assert ue8m0.shape == fp32.shape == (8, 656)
    assert torch.equal(ue8m0, pack_mla(kv, 512, "fp8", "ue8m0"))  # the default
    assert torch.equal(ue8m0[:, 528:], fp32[:, 528:])  # bf16 rope untouched
    _, s_ue8m0, _ = unpack_mla_fp8(ue8m0, 512, 64)
    _, s_fp32, _ = unpack_mla_fp8(fp32, 512, 64)
    assert bool((torch.frexp(s_ue8m0)[0] == 0.5).all()) and bool(
        (s_ue8m0 >= s_fp32).all() and (s_ue8m0 < 2 * s_fp32).all()
    )
    assert not torch.equal(ue8m0[:, :512], fp32[:, :512])
    assert KVLayout(512, 64, "fp8", 64).mla_scale_fmt == "ue8m0"
    assert KVLayout.from_config(get_preset("deepseek-v3.2"), "fp8", 64).mla_scale_fmt == "ue8m0"
    with pytest.raises(ConfigError, match="mla_scale_fmt"):
        KVLayout(512, 64, "fp8", 64, mla_scale_fmt="e8m0")
    with pytest.raises(ConfigError, match="scale_fmt"):
        pack_mla(kv, 512, "fp8", "")


def test_fp8_mla_offsets_deepseek() -> None:
    kv = _rand((3, 576), seed=7, scale=3.0)
    rows = pack_mla(kv, 512, "fp8", "fp32").numpy()
    for i in range(3):
        raw = rows[i].tobytes()
        scales = struct.unpack("<4f", raw[512:528])
        amax = kv[i, :512].reshape(4, 128).abs().amax(dim=1)
        assert scales == tuple((amax / 448).tolist())
        assert raw[528:656] == encode_bf16_le(kv[i, 512:].numpy())
        scaled = (kv[i, :512].reshape(4, 128) / torch.tensor(scales)[:, None]).reshape(-1)
        assert raw[:512] == encode_e4m3(scaled.numpy()).tobytes()


def test_bf16_mla_bytes_match_independent_layout() -> None:
    kv = _rand((4, 576), seed=3, scale=10.0)
    rows = pack_mla(kv, 512, "bf16")
    assert rows.shape == (4, 1152)
    for i in range(4):
        assert rows[i].numpy().tobytes() == encode_bf16_le(kv[i].numpy())


def test_unpack_mla_fp8_parts() -> None:
    kv = _rand((6, 576), seed=11)
    latent, scales, rope = unpack_mla_fp8(pack_mla(kv, 512, "fp8", "fp32"), 512, 64)
    assert (latent.dtype, tuple(latent.shape)) == (torch.float8_e4m3fn, (6, 512))
    assert (scales.dtype, tuple(scales.shape)) == (torch.float32, (6, 4))
    assert (rope.dtype, tuple(rope.shape)) == (torch.bfloat16, (6, 64))
    assert torch.equal(scales, kv[:, :512].reshape(6, 4, 128).abs().amax(-1) / 448)
    assert torch.equal(rope, kv[:, 512:].to(torch.bfloat16))


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 12),
    n_blocks=st.integers(1, 4),
    rope=st.sampled_from([0, 2, 64]),
    log_mag=st.integers(-12, 12),
    seed=st.integers(0, 2**31 - 1),
)
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_mla_round_trip(n: int, n_blocks: int, rope: int, log_mag: int, seed: int, scale_fmt: str) -> None:
    kv_lora = 128 * n_blocks
    kv = _rand((n, kv_lora + rope), seed, scale=2.0**log_mag)
    # fp8: per block error <= amax / 16 (3 mantissa bits; a ue8m0 scale only moves values down a binade); rope exact.
    out = dequantize_mla(pack_mla(kv, kv_lora, "fp8", scale_fmt), kv_lora, rope, "fp8")
    assert out.dtype == torch.float32 and out.shape == kv.shape
    err = (out[:, :kv_lora] - kv[:, :kv_lora]).abs().reshape(n, n_blocks, 128).amax(-1)
    amax = kv[:, :kv_lora].abs().reshape(n, n_blocks, 128).amax(-1)
    assert bool((err <= amax / 16 * (1 + 1e-6)).all())
    assert torch.equal(out[:, kv_lora:], kv[:, kv_lora:].to(torch.bfloat16).float())
    # bf16: exact for bf16 input.
    kv_bf16 = kv.to(torch.bfloat16)
    assert torch.equal(dequantize_mla(pack_mla(kv_bf16, kv_lora, "bf16"), kv_lora, rope, "bf16"), kv_bf16.float())


# ---------------------------------------------------------------------------------------------
# Indexer K
# ---------------------------------------------------------------------------------------------


def test_index_quant_scales_fp32_and_ue8m0() -> None:
    k = _rand((32, 128), seed=5) * torch.logspace(-3, 3, 32)[:, None]
    amax = k.abs().amax(-1)
    _, s_fp32 = quantize_index_k(k, "fp32")
    assert s_fp32.shape == (32,) and torch.equal(s_fp32, amax / 448)
    k_fp8, s_ue8m0 = quantize_index_k(k, "ue8m0")
    assert k_fp8.dtype == torch.float8_e4m3fn and k_fp8.shape == (32, 128)
    mantissa, _ = torch.frexp(s_ue8m0)
    assert bool((mantissa == 0.5).all()), "ue8m0 scales must be powers of two"
    assert bool((s_ue8m0 >= amax / 448).all() and (s_ue8m0 < 2 * amax / 448).all())
    with pytest.raises(ConfigError, match="scale_fmt"):
        quantize_index_k(k, "e5m2")


def test_block_scales_are_correctly_rounded_divisions() -> None:
    """``amax / 448`` rounded once (IEEE), not ``amax * (1 / 448)``: CUDA torch computes a division by a
    Python scalar as the latter, which is one ulp off for some amax, and the fused kernels divide."""
    from reference_impl.fp8 import block_scales

    amax = torch.linspace(1.0, 2.0, 4097)  # one binade, every 2**-12 step
    x = torch.zeros(amax.numel(), 128)
    x[:, 0] = amax
    want = (amax.double() / 448).float()
    assert torch.equal(block_scales(x, 128).flatten(), want)
    assert not torch.equal(amax * torch.tensor(1 / 448, dtype=torch.float32), want)  # the input can tell


def test_index_page_offsets_p64() -> None:
    n, page = 100, 64
    k_fp8, k_scale = quantize_index_k(_rand((n, 128), seed=9), "fp32")
    pages = pack_index_pages(k_fp8, k_scale, page)
    assert pages.dtype == torch.uint8 and pages.shape == (2, 8448)
    raw = [pages[p].numpy().tobytes() for p in range(2)]
    fp8_bytes = k_fp8.view(torch.uint8).numpy()
    for s in range(n):
        p, slot = divmod(s, page)
        assert raw[p][slot * 128 : slot * 128 + 128] == fp8_bytes[s].tobytes()
        (scale,) = struct.unpack("<f", raw[p][8192 + 4 * slot : 8196 + 4 * slot])
        assert scale == float(k_scale[s])
    # Slots 36..63 of page 1 are padding: zero values and zero scales.
    assert raw[1][36 * 128 : 8192] == bytes(28 * 128) and raw[1][8192 + 4 * 36 :] == bytes(28 * 4)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 70), page=st.sampled_from([4, 8, 16, 64]), seed=st.integers(0, 2**31 - 1))
def test_index_pages_round_trip(n: int, page: int, seed: int) -> None:
    k_fp8, k_scale = quantize_index_k(_rand((n, 128), seed), "ue8m0")
    pages = pack_index_pages(k_fp8, k_scale, page)
    assert pages.shape == (-(-n // page), page * 132)
    out_fp8, out_scale = unpack_index_pages(pages, n, 128)
    assert torch.equal(out_fp8.view(torch.uint8), k_fp8.view(torch.uint8))
    assert torch.equal(out_scale, k_scale)

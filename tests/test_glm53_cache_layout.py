"""GLM-5.3's FP8 latent row (528 bytes: 512 e4m3 codes, 4 float32 tile scales, no RoPE part), checked byte
for byte against the numpy encoder of ``tests/test_layout.py``; round trips within the FP8 bound."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl.errors import ConfigError
from reference_impl.families.glm53 import cache_layout as cl
from tests.test_layout import encode_e4m3, expected_fp8_row, pow2_at_least


def _rand(n: int, width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * scale


def test_row_sizes_and_offsets() -> None:
    assert (cl.LATENT_OFFSET, cl.SCALE_OFFSET, cl.ROW_BYTES, cl.BF16_ROW_BYTES) == (0, 512, 528, 1024)
    assert cl.ROW_BYTES % 16 == 0
    assert [cl.fp8_row_bytes(r) for r in (128, 256, 512)] == [132, 264, 528]
    assert cl.LatentRows(512, fp8=True).row_bytes == 528 and cl.LatentRows(512).row_bytes == 1024
    assert cl.LatentRows.for_run(512, "fp8", "ue8m0").row_bytes == 528
    assert cl.LatentRows(512, dtype=torch.float32).row_bytes == 2048


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_fp8_row_bytes_match_an_independent_encoder(scale_fmt: str) -> None:
    latent = _rand(5, 512, seed=1)
    latent[1, :128] = 0.0  # an all-zero tile takes the amax floor
    latent[2, 256:384] *= 1e4  # one large tile
    latent[3] *= 1e-6  # below the floor everywhere
    latent[4, :128] = 448.0 * 2.0**-3  # amax / 448 exactly a power of two: ue8m0 keeps it
    rows = cl.encode_fp8_rows(latent, scale_fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (5, cl.ROW_BYTES)
    for i in range(5):  # the DSA row's encoder with no RoPE part
        assert rows[i].numpy().tobytes() == expected_fp8_row(latent[i].numpy(), 512, scale_fmt), f"row {i}"


def test_byte_offsets_and_power_of_two_scales() -> None:
    latent = _rand(3, 512, seed=7, scale=3.0)
    rows = cl.encode_fp8_rows(latent, "ue8m0").numpy()
    for i in range(3):
        raw = rows[i].tobytes()
        scales = struct.unpack("<4f", raw[cl.SCALE_OFFSET : cl.ROW_BYTES])
        amax = latent[i].reshape(4, 128).abs().amax(dim=1).numpy()
        assert scales == tuple(pow2_at_least(amax / 448).tolist())  # tile order, each a power of two
        scaled = (latent[i].reshape(4, 128) / torch.tensor(scales)[:, None]).reshape(-1)
        assert raw[cl.LATENT_OFFSET : cl.SCALE_OFFSET] == encode_e4m3(scaled.numpy()).tobytes()
    codes, scales_t = cl.fp8_row_parts(torch.from_numpy(rows), 512)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (3, 512) and scales_t.shape == (3, 4)
    assert bool((torch.frexp(scales_t)[0] == 0.5).all())


def test_zero_row_and_amax_tile() -> None:
    latent = torch.zeros(2, 512)
    latent[1, 130] = -448.0 * 4  # a tile whose amax maps to the largest code exactly
    rows = cl.encode_fp8_rows(latent, "ue8m0")
    out = cl.decode_fp8_rows(rows, 512)
    assert torch.equal(out, latent)  # zeros stay zeros; -1792 = -448 x 4 is exact
    _, scales = cl.fp8_row_parts(rows, 512)
    assert torch.equal(scales[0], cl.fp8_row_parts(cl.encode_fp8_rows(torch.full((1, 512), 1e-4)), 512)[1][0])
    assert float(scales[1, 1]) == 4.0 and rows[1, 130] == 0xFE  # sign bit and the code of 448


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 9), tiles=st.integers(1, 4), log_mag=st.integers(-10, 10), seed=st.integers(0, 2**31 - 1))
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_round_trip_within_the_fp8_bound(n: int, tiles: int, log_mag: int, seed: int, scale_fmt: str) -> None:
    """Per tile, the error is at most amax / 16 (3 mantissa bits; ue8m0 only moves values down a binade)."""
    fmt = cl.LatentRows(128 * tiles, fp8=True, scale_fmt=scale_fmt)
    latent = _rand(n, 128 * tiles, seed, scale=2.0**log_mag)
    rows = fmt.encode(latent)
    assert rows.shape == (n, fmt.width) and torch.equal(fmt.encode(rows), rows)  # stored rows pass unchanged
    out = fmt.decode(rows)
    assert out.dtype == torch.float32 and out.shape == latent.shape
    err = (out - latent).abs().reshape(n, tiles, 128).amax(-1)
    amax = latent.abs().reshape(n, tiles, 128).amax(-1)
    assert bool((err <= amax / 16 * (1 + 1e-6)).all())


def test_plain_rows_and_refusals() -> None:
    latent = _rand(4, 32, seed=3)
    plain = cl.LatentRows(32)
    assert torch.equal(plain.decode(plain.encode(latent)), latent.to(torch.bfloat16))
    with pytest.raises(ConfigError, match="kv_lora_rank=32"):
        cl.LatentRows(32, fp8=True)
    with pytest.raises(ConfigError, match="latent width=96"):
        cl.encode_fp8_rows(_rand(2, 96, seed=0))
    with pytest.raises(ConfigError, match="scale_fmt"):
        cl.encode_fp8_rows(_rand(2, 128, seed=0), "e8m0")
    with pytest.raises(ConfigError, match="kv_dtype='fp4'"):
        cl.LatentRows.for_run(512, "fp4", "ue8m0")
    with pytest.raises(ConfigError, match="width 64"):
        cl.LatentRows(128, fp8=True).encode(_rand(2, 64, seed=0))


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_rows_in_format_tell_the_scale_formats_apart(scale_fmt: str) -> None:
    latent = _rand(40, 256, seed=5, scale=2.0)
    latent[0] = 0.0  # floored tiles: each format's own floor scale
    latent[1, :128] = 448.0 * 2.0**-3  # amax / 448 a power of two: this tile's bytes agree, the other's do not
    other = "fp32" if scale_fmt == "ue8m0" else "ue8m0"
    fmt = cl.LatentRows(256, fp8=True, scale_fmt=scale_fmt)
    assert bool(fmt.in_format(fmt.encode(latent)).all())
    assert not bool(fmt.in_format(cl.encode_fp8_rows(latent, other)).any())
    assert bool(cl.LatentRows(256).in_format(latent).all())  # plain rows have no format to check


def test_the_footprint_sizes_latent_rows_by_the_runs_kv_dtype() -> None:
    """The memory model's caches: 528 bytes a latent row on GLM-5.3-Flash with FP8 rows, 1,024 with bf16;
    on ``tiny-glm53`` (``kv_lora_rank`` 256) the two estimates differ by 512 - 264 bytes per token and
    indexed layer."""
    from reference_impl.config import Request, RunConfig
    from reference_impl.families.glm53 import footprint
    from reference_impl.families.glm53.config import GLM53_PRESETS

    flash = GLM53_PRESETS["glm-5.3-flash"]
    assert footprint.latent_row_bytes(flash, "fp8") == 528 and footprint.latent_row_bytes(flash, "bf16") == 1024
    caches = {}
    for kv_dtype in ("fp8", "bf16"):
        run = RunConfig(preset="tiny-glm53", requests=(Request(37, 61),), kv_dtype=kv_dtype, device="cpu")
        caches[kv_dtype] = footprint.estimate(run, "cpu", "fork", 0, 0, 4).terms["rank 0 caches"]
    assert caches["bf16"] - caches["fp8"] == 98 * run.model.count("indexed_attention") * (512 - 264)

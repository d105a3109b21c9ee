"""Phase 7 fused kernels (store, rerange, materialize) under the CPU interpreter, their dispatch, and
the phase-6 sort-free remap.

Every kernel is compared with its torch path BYTE for byte (packed MLA rows, index pages, reranged
rows, full-view rows). The interpreter rounds fp32 -> fp8 / bf16 casts wrongly, so the kernels run
with ``soft=True`` here (explicit round-to-nearest-even on the bit pattern, the default for CPU
tensors); the first tests pin that conversion down against torch on its own.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import as_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from reference_impl.config import ConfigError  # noqa: E402
from reference_impl.cp import fused_ops, remap  # noqa: E402
from reference_impl.cp.batch import BatchLocs  # noqa: E402
from reference_impl.cp.comm import CPGroup  # noqa: E402
from reference_impl.cp.kv_sharded import ShardedKV  # noqa: E402
from reference_impl.cp.ownership import page_owner, physical_locs  # noqa: E402
from reference_impl.cp.page_gather import gather_pages, unpack_index_rows  # noqa: E402
from reference_impl.cp.split import build_split  # noqa: E402
from reference_impl.cp.split_index import SplitIndex, rerange_tensor  # noqa: E402
from reference_impl.kernels import (  # noqa: E402
    fallback,
    fused_torch,
    triton_helpers,  # noqa: E402
)
from reference_impl.kvcache.layout import KVLayout, pack_mla  # noqa: E402
from reference_impl.kvcache.pool import LocOutOfRangeError, PagedKVPool  # noqa: E402

SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---- the software conversions -----------------------------------------------------------------------


@triton.jit
def _convert_kernel(x_ptr, fp8_ptr, bf16_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = tl.minimum(tl.maximum(x, -448.0), 448.0)
    tl.store(fp8_ptr + offs, triton_helpers.e4m3_bits(y, True), mask=mask)
    tl.store(bf16_ptr + offs, triton_helpers.bf16_bits(x, True), mask=mask)


def test_soft_conversions_round_to_nearest_even_like_torch(fs: object) -> None:
    """Every e4m3 value, every midpoint between neighbours (ties) and one fp32 ulp either side,
    subnormals, signed zeros, random values; bf16 ties and infinities (NaN: any NaN pattern)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    grid = codes.view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    ulp_up = (mids.view(torch.int32) + 1).view(torch.float32)
    ulp_down = (mids.view(torch.int32) - 1).view(torch.float32)
    gen = torch.Generator().manual_seed(0)
    rand = torch.cat(
        [
            torch.randn(300, generator=gen) * 100,
            torch.randn(300, generator=gen) * 2**-8,
            torch.tensor([0.0, -0.0, 2**-10, -(2**-10), 448.0, -448.0]),
        ]
    )
    ties16 = ((torch.randint(0, 2**15, (200,), generator=gen, dtype=torch.int32) << 16) | 0x8000).view(torch.float32)
    specials = torch.tensor([float("inf"), -float("inf"), float("nan")])
    x = torch.cat([grid, mids, ulp_up, ulp_down, rand, ties16[torch.isfinite(ties16)], specials]).float().contiguous()
    fp8 = torch.empty(x.numel(), dtype=torch.uint8)
    bf16 = torch.empty(x.numel(), dtype=torch.int16)
    _convert_kernel[(1,)](x, fp8, bf16, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    finite = torch.isfinite(x)
    want8 = as_bytes(x.clamp(-448, 448).to(torch.float8_e4m3fn))
    assert torch.equal(fp8[finite], want8[finite])
    want16 = x.to(torch.bfloat16)
    assert torch.equal(bf16[~x.isnan()], want16.view(torch.int16)[~x.isnan()])
    assert bf16[x.isnan()].view(torch.bfloat16).isnan().all()  # NaN payloads differ between torch backends


# ---- fused store ----------------------------------------------------------------------------------


def _random_kv(gen: torch.Generator, n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows spanning magnitudes: zero rows (amax floor), tiny (fp8 subnormals), ordinary, huge."""
    kv = torch.randn(n, width, generator=gen) * torch.exp2(torch.randint(-12, 12, (n, 1), generator=gen).float())
    if n > 2:
        kv[0] = 0.0
        kv[1, : width // 2] = 1e-6
    return kv.to(dtype)


@SETTINGS
@given(
    kv_dtype=st.sampled_from(["fp8", "bf16"]),
    mla_scale_fmt=st.sampled_from(["ue8m0", "fp32"]),
    in_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    dims=st.sampled_from([(128, 64), (256, 32), (128, 0)]),
    page_size=st.sampled_from([4, 16]),
    n=st.integers(1, 40),
    all_rows=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_store_mla_bytes_equal_pack_then_write(
    fs: object,
    kv_dtype: str,
    mla_scale_fmt: str,
    in_dtype: torch.dtype,
    dims: tuple[int, int],
    page_size: int,
    n: int,
    all_rows: bool,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv_lora, rope = dims
    layout = KVLayout(kv_lora, rope, kv_dtype, page_size, mla_scale_fmt=mla_scale_fmt)  # type: ignore[arg-type]
    n_pages = -(-n // page_size) + 2
    ref = PagedKVPool(2, n_pages, page_size, layout)
    ref.mla.random_(0, 256, generator=gen)  # untouched slots must keep their bytes
    pool = ref.mla.clone()
    kv = _random_kv(gen, n, kv_lora + rope, in_dtype)
    m = n if all_rows else int(torch.randint(1, n + 1, (1,), generator=gen))
    src = None if all_rows else torch.randint(0, n, (m,), generator=gen)  # repeats allowed
    dst = torch.randperm(n_pages * page_size, generator=gen)[:m]  # scattered over partial pages
    ref.write_mla(1, dst, pack_mla(kv if src is None else kv[src], kv_lora, kv_dtype, mla_scale_fmt))
    fs.store_mla_triton(kv, src, dst, pool[1], layout)  # type: ignore[attr-defined]
    assert torch.equal(pool, ref.mla)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0, on purpose
def test_ue8m0_stores_match_torch_at_the_extreme_scales(fs: object) -> None:
    """Power-of-two scales at the ends of the float32 range: ``2^120`` (float max / 448 rounded up),
    ``2^-22`` (the amax floor) and an inf block (reciprocal 0, like ``x / inf``)."""
    kv = torch.randn(4, 576, generator=torch.Generator().manual_seed(3))
    kv[0, :128] *= 3e38 / kv[0, :128].abs().max()  # amax / 448 rounds up to 2^120
    kv[1, 128:256] = 0.0  # the 1e-4 floor: 2^-22
    kv[2, 256:384] *= 1e-3
    kv[3, 384] = float("inf")
    k = kv[:, :128].clone()
    layout = KVLayout(512, 64, "fp8", 4, mla_scale_fmt="ue8m0", index_scale_fmt="ue8m0")
    dst = torch.arange(4)
    want_mla, want_index = (
        torch.zeros(4, 656, dtype=torch.uint8),
        torch.zeros(1, layout.index_page_bytes, dtype=torch.uint8),
    )
    fused_torch.store_mla_torch(kv, None, dst, want_mla, layout)
    fused_torch.store_index_torch(k, None, dst, want_index, layout)
    for one_pass in (True, False):
        mla, index = torch.zeros_like(want_mla), torch.zeros_like(want_index)
        fs.store_mla_triton(kv, None, dst, mla, layout, one_pass=one_pass)  # type: ignore[attr-defined]
        fs.store_index_triton(k, None, dst, index, layout)  # type: ignore[attr-defined]
        assert int(mla[3, 384]) & 0x7F == 0x7F  # the inf itself: a NaN code (its bit pattern may differ)
        mla[3, 384] = want_mla[3, 384]
        assert torch.equal(mla, want_mla) and torch.equal(index, want_index), one_pass
    assert struct_scales(want_mla[0])[0] == 2.0**120 and struct_scales(want_mla[1])[1] == 2.0**-22


def struct_scales(row: torch.Tensor) -> tuple[float, ...]:
    return tuple(row[512:528].contiguous().view(torch.float32).tolist())


@pytest.mark.parametrize("one_pass", [True, False])
def test_store_mla_both_scale_formats_at_deepseek_widths(fs: object, one_pass: bool) -> None:
    """The 656-byte rows of both MLA scale formats, from the kernel (both code paths) and from torch."""
    gen = torch.Generator().manual_seed(5)
    kv = _random_kv(gen, 24, 576, torch.bfloat16)
    rows = {}
    for fmt in ("ue8m0", "fp32"):
        layout = KVLayout(512, 64, "fp8", 16, mla_scale_fmt=fmt)
        pool = torch.zeros(32, 656, dtype=torch.uint8)
        dst = torch.randperm(32, generator=gen)[:24]
        fs.store_mla_triton(kv, None, dst, pool, layout, one_pass=one_pass)  # type: ignore[attr-defined]
        assert torch.equal(pool[dst], pack_mla(kv, 512, "fp8", fmt)), fmt
        rows[fmt] = pool[dst]
    assert not torch.equal(rows["ue8m0"], rows["fp32"])  # the formats differ, so each assertion can fail


@SETTINGS
@given(
    scale_fmt=st.sampled_from(["ue8m0", "fp32"]),
    page_size=st.sampled_from([4, 8, 64]),
    n=st.integers(1, 48),
    seed=st.integers(0, 2**31 - 1),
)
def test_store_index_bytes_equal_quantize_then_write(
    fs: object, scale_fmt: str, page_size: int, n: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(128, 64, "fp8", page_size, index_scale_fmt=scale_fmt)
    n_pages = -(-n // page_size) + 1
    ref = PagedKVPool(2, n_pages, page_size, layout)
    ref.index.random_(0, 256, generator=gen)
    pool = ref.index.clone()
    k = _random_kv(gen, n + 3, 128, torch.bfloat16)
    src = torch.randperm(n + 3, generator=gen)[:n]
    dst = torch.randperm(n_pages * page_size, generator=gen)[:n]
    k_fp8, k_scale = layout.quantize_index_k(k[src])
    ref.write_index(1, dst, k_fp8, k_scale)
    fs.store_index_triton(k, src, dst, pool[1], layout)  # type: ignore[attr-defined]
    assert torch.equal(pool, ref.index)


def _log2_rounding_amax() -> float | None:
    """An amax whose scale amax/448 lies a few ulps above a power of two, where torch's fp32
    ``exp2(ceil(log2(s)))`` rounds down (None if this torch build has no such case)."""
    for e in range(-20, -4):
        for k in range(1, 6):
            s = torch.tensor(2.0**e).view(torch.int32) + k
            amax = (s.view(torch.float32) * 448).reshape(1)
            scale = amax.clamp(min=1e-4) / 448
            if scale.view(torch.int32) & 0x7FFFFF and torch.exp2(torch.ceil(torch.log2(scale))) < scale:
                return float(amax)
    return None


def test_store_index_ue8m0_edge_case_is_exact_on_both_paths(fs: object) -> None:
    """A scale a few ulps above a power of two, where float32 ``exp2(ceil(log2(s)))`` would round
    down: both the kernel and the torch path (``fp8.round_up_pow2``) round up exactly, identically."""
    amax = _log2_rounding_amax()
    if amax is None:
        pytest.skip("torch's log2 rounds exactly here: no difference to show")
    layout = KVLayout(128, 64, "fp8", 4, index_scale_fmt="ue8m0")
    k = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    k[1] = k[1] / k[1].abs().max() * amax / 2
    k[1, 7] = amax  # token 1's amax is the edge value
    pool = torch.zeros(1, layout.index_page_bytes, dtype=torch.uint8)
    want = pool.clone()
    fs.store_index_triton(k, None, torch.arange(3), pool, layout)  # type: ignore[attr-defined]
    fused_torch.store_index_torch(k, None, torch.arange(3), want, layout)
    scales = pool[0, 4 * 128 :].view(torch.float32)
    exact = torch.tensor(amax / 448, dtype=torch.float32)
    assert float(scales[1]) >= float(exact) and float(scales[1]) < 2 * float(exact)
    assert torch.equal(pool, want)  # identical bytes, the edge token included


def test_store_matches_sharded_store_current(fs: object) -> None:
    """Wired like ShardedKV.store_current (phase 2: owned rows of the gathered chunk; rank 1 of 3)."""
    gen = torch.Generator().manual_seed(3)
    meta = build_split("in-seq", 3, [45, 30], [0, 0], page_size=8)
    batch = BatchLocs.build(meta)
    layout = KVLayout(128, 64, "fp8", 8)

    class Rank:  # a store needs rank, size and device only
        rank, size, device = 1, 3, torch.device("cpu")

    store = ShardedKV(batch, layout, 1, Rank(), debug=False, reuse_current=False)  # type: ignore[arg-type]
    kv_seq, index_seq = _random_kv(gen, 75, 192, torch.bfloat16), _random_kv(gen, 75, 128, torch.bfloat16)
    mla, index = store.pool.mla[0].clone(), store.pool.index[0].clone()
    store.store_current(0, kv_seq, index_seq)
    fs.store_mla_triton(kv_seq, store._store_rows, store._store_locs, mla, layout)  # type: ignore[attr-defined]
    fs.store_index_triton(index_seq, store._store_rows, store._store_locs, index, layout)  # type: ignore[attr-defined]
    assert torch.equal(mla, store.pool.mla[0]) and torch.equal(index, store.pool.index[0])


# ---- fused rerange --------------------------------------------------------------------------------


@SETTINGS
@given(
    cp_size=st.integers(1, 4),
    extend=st.lists(st.integers(1, 23), min_size=1, max_size=3),
    row=st.sampled_from(
        [(torch.bfloat16, (576,)), (torch.float32, (3,)), (torch.uint8, (7,)), (torch.bfloat16, (2, 5))]
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_rerange_equals_trim_then_index_select(
    fr: object, cp_size: int, extend: list[int], row: tuple[torch.dtype, tuple[int, ...]], seed: int
) -> None:
    extend[0] = max(extend[0], cp_size)  # the longest request must give every rank a token
    meta = build_split("in-seq", cp_size, extend, [0] * len(extend), page_size=4)
    gen = torch.Generator().manual_seed(seed)
    dtype, shape = row
    raw = torch.randint(0, 256, (cp_size, meta.max_rank_len, *shape), generator=gen, dtype=torch.uint8)
    raw = raw if dtype == torch.uint8 else torch.randn(raw.shape, generator=gen).to(dtype)
    got = fr.rerange_padded_triton(raw, rerange_tensor(meta, padded=True))  # type: ignore[attr-defined]
    trimmed = torch.cat([raw[r, :n] for r, n in enumerate(meta.rank_lengths)])
    assert torch.equal(as_bytes(got), as_bytes(trimmed.index_select(0, rerange_tensor(meta))))
    assert torch.equal(
        as_bytes(got), as_bytes(fused_torch.rerange_padded_torch(raw, meta.rank_lengths, rerange_tensor(meta)))
    )


def test_rerange_single_rank_strided_local_rows(fr: object) -> None:
    """A trivial group returns ``local.unsqueeze(0)``: rows of a wider buffer (row stride > width)."""
    meta = build_split("in-seq", 1, [13], [2], page_size=4)
    wide = torch.randn(13, 200)
    raw = wide[:, 10:138].unsqueeze(0)  # [1, 13, 128], row stride 200
    got = fr.rerange_padded_triton(raw, rerange_tensor(meta, padded=True))  # type: ignore[attr-defined]
    assert (
        torch.equal(got, fused_torch.rerange_padded_torch(raw, meta.rank_lengths, rerange_tensor(meta)))
        and got.is_contiguous()
    )


# ---- fused materialize ----------------------------------------------------------------------------


def _gathered(gen: torch.Generator, layout: KVLayout, n_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed gather buffer ``[n_pages, P * mla_bytes + index page bytes]`` of valid packed rows."""
    slots = n_pages * layout.page_size
    mla = torch.zeros(slots, layout.mla_bytes, dtype=torch.uint8)
    index = torch.zeros(n_pages, layout.index_page_bytes, dtype=torch.uint8)
    fused_torch.store_mla_torch(
        _random_kv(gen, slots, layout.kv_width, torch.float32), None, torch.arange(slots), mla, layout
    )
    fused_torch.store_index_torch(_random_kv(gen, slots, 128, torch.float32), None, torch.arange(slots), index, layout)
    return torch.cat([mla.view(n_pages, -1), index], dim=1), mla


@SETTINGS
@given(
    kv_dtype=st.sampled_from(["fp8", "bf16"]),
    page_size=st.sampled_from([4, 16]),
    n_pages=st.integers(1, 4),
    n_view=st.integers(1, 40),
    page_rows=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_materialize_equals_torch_path(
    fm: object, kv_dtype: str, page_size: int, n_pages: int, n_view: int, page_rows: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(128, 64, kv_dtype, page_size)  # type: ignore[arg-type]
    packed, mla_rows = _gathered(gen, layout, n_pages)
    split = page_size * layout.mla_bytes
    r = int(torch.randint(1, n_view + 1, (1,), generator=gen))
    row_source = torch.randint(0, n_pages * page_size, (r,), generator=gen)
    view_rows = torch.randperm(n_view, generator=gen)[:r]
    views = []
    for path in ("torch", "triton"):
        kv = torch.full((n_view, layout.kv_width), 3.0, dtype=torch.bfloat16)  # unfilled rows keep it
        i8 = torch.full((n_view, 128), 1.0).to(torch.float8_e4m3fn)
        sc = torch.full((n_view,), -1.0)
        mla = packed[:, :split] if page_rows else mla_rows  # page rows: no copy of the gather buffer
        args = (mla, packed[:, split:], row_source, view_rows, kv, i8, sc, layout)
        fused_torch.materialize_rows_torch(*args) if path == "torch" else fm.materialize_rows_triton(*args)  # type: ignore[attr-defined]
        views.append((kv, i8, sc))
    for got, want in zip(views[1], views[0]):
        assert torch.equal(as_bytes(got), as_bytes(want))
    # The index part is exactly materialize.py's unpack_index_rows.
    k_fp8, k_scale = unpack_index_rows(packed[:, split:], row_source, layout)
    assert torch.equal(as_bytes(views[1][1][view_rows]), as_bytes(k_fp8)) and torch.equal(
        views[1][2][view_rows], k_scale
    )


@SETTINGS
@given(kv_dtype=st.sampled_from(["fp8", "bf16"]), one_pass=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_materialize_mla_half_equals_the_full_op(fm: object, kv_dtype: str, one_pass: bool, seed: int) -> None:
    """Phase 8's MLA-only launch writes the full op's kv rows and nothing else (torch path and kernel)."""
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(128, 64, kv_dtype, 4)  # type: ignore[arg-type]
    packed, mla_rows = _gathered(gen, layout, 3)
    row_source = torch.randperm(12, generator=gen)[:7]
    view_rows = torch.randperm(20, generator=gen)[:7]
    full = torch.full((20, layout.kv_width), 3.0, dtype=torch.bfloat16)
    i8, sc = torch.zeros(20, 128).to(torch.float8_e4m3fn), torch.zeros(20)
    fused_torch.materialize_rows_torch(
        mla_rows, packed[:, 4 * layout.mla_bytes :], row_source, view_rows, full, i8, sc, layout
    )
    for run in (
        fused_torch.materialize_mla_rows_torch,
        functools.partial(fm.materialize_mla_rows_triton, one_pass=one_pass),
    ):  # type: ignore[attr-defined]
        kv = torch.full((20, layout.kv_width), 3.0, dtype=torch.bfloat16)
        run(mla_rows, row_source, view_rows, kv, layout)
        assert torch.equal(as_bytes(kv), as_bytes(full))


def test_materialize_matches_sharded_full_view(fm: object) -> None:
    """Phase 2 full materialization on one rank: gather_pages + the kernel == ShardedKV.full_view."""
    gen = torch.Generator().manual_seed(5)
    meta = build_split("in-seq", 1, [21, 9], [11, 4], page_size=8)
    batch = BatchLocs.build(meta)
    layout = KVLayout(128, 64, "fp8", 8)
    group = CPGroup.single()
    store = ShardedKV(batch, layout, 1, group, debug=False, reuse_current=False)
    for req, prefix in enumerate(meta.prefix_lens):
        rows = pack_mla(_random_kv(gen, prefix, 192, torch.float32), 128, "fp8")
        store.write_prefix(0, req, rows, *layout.quantize_index_k(_random_kv(gen, prefix, 128, torch.float32)))
    kv_seq, index_seq = _random_kv(gen, 30, 192, torch.bfloat16), _random_kv(gen, 30, 128, torch.bfloat16)
    store.store_current(0, kv_seq, index_seq)
    want = store.full_view(0, kv_seq, index_seq)
    gather = store._gather
    mla_rows, index_pages = gather_pages(group, store.pool, 0, gather)
    kv = torch.zeros_like(want.kv)
    i8, sc = (
        torch.zeros_like(want.index_k_fp8.view(torch.uint8)).view(torch.float8_e4m3fn),
        torch.zeros_like(want.index_k_scale),
    )
    fm.materialize_rows_triton(mla_rows, index_pages, gather.row_source, gather.view_rows, kv, i8, sc, layout)  # type: ignore[attr-defined]
    assert gather.view_rows.numel() == batch.view_len
    assert (
        torch.equal(kv, want.kv)
        and torch.equal(as_bytes(i8), as_bytes(want.index_k_fp8))
        and torch.equal(sc, want.index_k_scale)
    )


# ---- dispatch -------------------------------------------------------------------------------------


@pytest.fixture()
def fresh_dispatch(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("DSACP_FORCE_TORCH", raising=False)
    fallback.reset_fallbacks()
    yield
    fallback.reset_fallbacks()


def _dispatch_case() -> dict[str, object]:
    gen = torch.Generator().manual_seed(9)
    layout = KVLayout(128, 64, "fp8", 4)
    meta = build_split("in-seq", 2, [11], [0], page_size=4)
    packed, _ = _gathered(gen, layout, 2)
    return {
        "layout": layout,
        "meta": meta,
        "kv": _random_kv(gen, 10, 192, torch.bfloat16),
        "k": _random_kv(gen, 10, 128, torch.bfloat16),
        "dst": torch.randperm(12, generator=gen)[:10],
        "raw": torch.randn(2, meta.max_rank_len, 8, generator=gen),
        "packed": packed,
        "source": torch.randint(0, 8, (6,), generator=gen),
        "rows": torch.randperm(9, generator=gen)[:6],
    }


def _run_all(case: dict[str, object], **kw: object) -> tuple[torch.Tensor, ...]:
    layout: KVLayout = case["layout"]  # type: ignore[assignment]
    mla = torch.zeros(12, layout.mla_bytes, dtype=torch.uint8)
    index = torch.zeros(3, layout.index_page_bytes, dtype=torch.uint8)
    fused_ops.fused_store_mla(case["kv"], None, case["dst"], mla, layout, **kw)  # type: ignore[arg-type]
    fused_ops.fused_store_index(case["k"], None, case["dst"], index, layout, **kw)  # type: ignore[arg-type]
    out = fused_ops.rerange_padded(case["raw"], SplitIndex.build(case["meta"], 0), **kw)  # type: ignore[arg-type]
    packed: torch.Tensor = case["packed"]  # type: ignore[assignment]
    split = 4 * layout.mla_bytes
    kv, i8, sc = torch.zeros(9, 192, dtype=torch.bfloat16), torch.zeros(9, 128, dtype=torch.uint8), torch.zeros(9)
    fused_ops.materialize_rows(
        packed[:, :split],
        packed[:, split:],
        case["source"],
        case["rows"],
        kv,
        i8.view(torch.float8_e4m3fn),
        sc,
        layout,
        **kw,  # type: ignore[arg-type]
    )
    return mla, index, out, kv, i8, sc


def _boom(*args: object, **kwargs: object) -> object:
    raise RuntimeError("simulated kernel failure")


KERNELS = ("_triton_store_mla", "_triton_store_index", "_triton_rerange", "_triton_materialize")


def test_dispatch_failing_kernels_fall_back_with_one_warning_each(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_dispatch: None
) -> None:
    case = _dispatch_case()
    want = _run_all(case)  # CPU tensors: the torch paths
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
    for name in KERNELS:
        monkeypatch.setattr(fused_ops, name, _boom)
    with caplog.at_level(logging.DEBUG, logger=fallback.__name__):
        for _ in range(2):
            got = _run_all(case)
            assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(got, want))
    records = [r for r in caplog.records if r.name == fallback.__name__]
    assert len(records) == 4, [r.getMessage() for r in records]  # one per kernel, not per call
    assert all(r.levelno == logging.WARNING and "simulated kernel failure" in r.getMessage() for r in records)
    assert {r.getMessage().split()[1] for r in records} == {
        "fused_store_mla",
        "fused_store_index",
        "rerange_padded",
        "materialize_rows",
    }


def test_dispatch_mla_only_materialize_falls_back_once_and_takes_torch_in_debug(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_dispatch: None
) -> None:
    """Phase 8's MLA-only op: a failing kernel gives the torch rows with one warning; debug mode
    takes the torch path and range-checks the rows on the host."""
    case = _dispatch_case()
    layout: KVLayout = case["layout"]  # type: ignore[assignment]
    mla = case["packed"][:, : 4 * layout.mla_bytes]  # type: ignore[index]

    def run(**kw: object) -> torch.Tensor:
        kv = torch.zeros(9, 192, dtype=torch.bfloat16)
        fused_ops.materialize_mla_rows(mla, case["source"], case["rows"], kv, layout, **kw)  # type: ignore[arg-type]
        return kv

    want = run()  # CPU tensors: the torch path
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
    monkeypatch.setattr(fused_ops, "_triton_materialize_mla", _boom)
    with caplog.at_level(logging.DEBUG, logger=fallback.__name__):
        assert all(torch.equal(as_bytes(run()), as_bytes(want)) for _ in range(2))
    records = [r for r in caplog.records if r.name == fallback.__name__]
    assert len(records) == 1 and "materialize_mla_rows" in records[0].getMessage()
    assert torch.equal(as_bytes(run(debug=True)), as_bytes(want))
    bad_rows = case["rows"].clone()  # type: ignore[attr-defined]
    bad_rows[0] = 9
    with pytest.raises(LocOutOfRangeError):
        fused_ops.materialize_mla_rows(
            mla, case["source"], bad_rows, torch.zeros(9, 192, dtype=torch.bfloat16), layout, debug=True
        )  # type: ignore[arg-type]


def test_dispatch_runs_the_kernels_silently_when_they_work(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_dispatch: None,
    fs: object,
    fr: object,
    fm: object,
) -> None:
    """Pretend CUDA: the (interpreted) kernels run through the dispatch, equal bytes, no log record."""
    case = _dispatch_case()
    want = _run_all(case)
    calls: list[str] = []
    for name in KERNELS:
        real = getattr(fused_ops, name)
        monkeypatch.setattr(fused_ops, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1])
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)
    with caplog.at_level(logging.DEBUG, logger=fallback.__name__):
        got = _run_all(case)
    assert calls == list(KERNELS) and not caplog.records
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(got, want))


def test_dispatch_debug_force_torch_and_cpu_take_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_dispatch: None
) -> None:
    case = _dispatch_case()
    calls: list[str] = []
    for name in KERNELS:
        monkeypatch.setattr(fused_ops, name, lambda *a, _name=name: calls.append(_name))
    with caplog.at_level(logging.DEBUG, logger=fallback.__name__):
        want = _run_all(case)  # CPU: torch
        assert fallback.use_kernels("cpu") is False
        monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
        assert fallback.use_kernels("cuda") is True
        assert fallback.use_kernels("cuda", debug=True) is False
        for got in (_run_all(case, debug=True), _run_all(case, force_torch=True)):
            assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(got, want))
        monkeypatch.setenv("DSACP_FORCE_TORCH", "1")
        assert fallback.use_kernels("cuda") is False
        _run_all(case)
    assert calls == [] and not caplog.records


def test_dispatch_bad_input_raises_instead_of_falling_back(
    monkeypatch: pytest.MonkeyPatch, fresh_dispatch: None
) -> None:
    case = _dispatch_case()
    layout: KVLayout = case["layout"]  # type: ignore[assignment]
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)
    pool = torch.zeros(12, layout.mla_bytes, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="dst_locs"):
        fused_ops.fused_store_mla(case["kv"], None, case["dst"][:5], pool, layout)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rerange"):
        fused_ops.rerange_padded(torch.zeros(3, 2, 8), SplitIndex.build(case["meta"], 0))  # type: ignore[arg-type]
    with pytest.raises(LocOutOfRangeError):
        fused_ops.fused_store_mla(case["kv"], None, case["dst"] + 12, pool, layout, debug=True)  # type: ignore[arg-type,operator]
    assert not fallback.fallbacks_taken()


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-path", "kernel-path"])
def test_both_paths_refuse_an_out_of_range_loc_alike(
    monkeypatch: pytest.MonkeyPatch, fresh_dispatch: None, kernel: bool
) -> None:
    """One loc past the pool, one gathered row past the buffer: the same ``LocOutOfRangeError`` on the
    torch path and the kernel path (pretend CUDA), raised before anything is written."""
    case = _dispatch_case()
    layout: KVLayout = case["layout"]  # type: ignore[assignment]
    if kernel:
        monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)
    mla = torch.zeros(12, layout.mla_bytes, dtype=torch.uint8)
    index = torch.zeros(3, layout.index_page_bytes, dtype=torch.uint8)
    bad = case["dst"].clone()  # type: ignore[attr-defined]
    bad[3] = 12
    with pytest.raises(LocOutOfRangeError, match=r"dst_locs span \[\d+, 12\] outside \[0, 12\)"):
        fused_ops.fused_store_mla(case["kv"], None, bad, mla, layout)  # type: ignore[arg-type]
    with pytest.raises(LocOutOfRangeError, match=r"dst_locs span"):
        fused_ops.fused_store_index(case["k"], None, bad, index, layout)  # type: ignore[arg-type]
    assert not mla.any() and not index.any()
    packed: torch.Tensor = case["packed"]  # type: ignore[assignment]
    split = 4 * layout.mla_bytes
    source = case["source"].clone()  # type: ignore[attr-defined]
    source[0] = packed.shape[0] * 4
    kv = torch.zeros(9, 192, dtype=torch.bfloat16)
    with pytest.raises(LocOutOfRangeError, match="row_source span"):
        fused_ops.materialize_mla_rows(packed[:, :split], source, case["rows"], kv, layout)  # type: ignore[arg-type]
    assert not kv.any() and not fallback.fallbacks_taken()


# ---- phase 6 remap --------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    page_size=st.sampled_from([1, 4, 64]),
    cp_size=st.integers(1, 5),
    data=st.data(),
)
def test_page_inverse_remap_equals_sorted_remap(page_size: int, cp_size: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, cp_size - 1))
    n_pages = data.draw(st.integers(1, 12))
    locs = torch.tensor(data.draw(st.lists(st.integers(0, n_pages * page_size - 1), max_size=60)), dtype=torch.int64)
    fast = remap.page_inverse_remap(locs, page_size, cp_size, rank)
    slow = remap.sorted_remap(locs, page_size, cp_size, rank, n_pages)
    owned = torch.arange(rank, max(n_pages, rank), cp_size)
    shuffled = owned[
        torch.randperm(owned.numel(), generator=torch.Generator().manual_seed(n_pages))
    ]  # any physical order works for the table forms
    table = remap.page_inverse_table(shuffled, n_pages)
    slot_table = (shuffled[:, None] * page_size + torch.arange(page_size)).flatten()
    assert torch.equal(fast, slow)
    assert torch.equal(remap.remap_with_table(locs, remap.page_inverse_table(owned, n_pages), page_size), fast)
    assert torch.equal(
        remap.remap_with_table(locs, table, page_size),
        remap.sorted_remap(locs, page_size, cp_size, rank, n_pages, slot_table),
    )
    own = page_owner(locs // page_size, cp_size) == rank
    assert torch.equal(fast[own], physical_locs(locs[own], page_size, cp_size)) and (fast[~own] == -1).all()


def test_remap_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="rank"):
        remap.page_inverse_remap(torch.arange(4), 4, 2, 2)
    with pytest.raises(ConfigError, match="int64"):
        remap.sorted_remap(torch.arange(4, dtype=torch.int32), 4, 2, 0, 1)


# ---- benchmark harness (CPU dry run) --------------------------------------------------------------


def test_bench_kernels_cpu_dry_run(tmp_path: Path, fs: object, fr: object, fm: object) -> None:
    from reference_impl.bench import kernels as bench

    out = tmp_path / "kernels.json"
    assert (
        bench.main(["--out", str(out), "--device", "cpu", "--tokens", "24", "--cp-size", "2", "--page-size", "8"]) == 0
    )
    result = json.loads(out.read_text())
    assert {"command", "device", "torch", "triton", "shapes", "copy", "kernels", "remap"} <= result.keys()
    ops = {r["op"] for r in result["kernels"]}
    assert ops == {
        "store_mla_fp8",
        "store_mla_bf16",
        "store_index",
        "rerange_kv",
        "rerange_index",
        "rerange_kv_torch_padded_gather",
        "materialize_fp8",
    }
    assert all(r["check"]["bytes_equal"] and r["bytes"] > 0 and r["triton_ms"] > 0 for r in result["kernels"])
    for r in result["kernels"]:  # next to each row, a copy of its bytes
        assert r["same_size_copy_ms"] > 0
        assert r["triton_fraction_of_same_size_copy"] == pytest.approx(r["same_size_copy_ms"] / r["triton_ms"])
        assert "triton_ms_repeats" not in r  # one timing each by default
    assert result["remap"][0]["equal"] is True
    from reference_impl.kernels.fused_configs import CPU_CONFIGS

    assert "sweep" not in result and result["configs"] == CPU_CONFIGS  # the defaults, one per kernel
    assert all(r["config"] == CPU_CONFIGS[r["op"].replace("_torch_padded_gather", "")] for r in result["kernels"])


def test_bench_kernels_cpu_sweep_dry_run(tmp_path: Path, fs: object, fr: object, fm: object) -> None:
    """``--sweep`` on the interpreter: two candidates per kernel (the default and a one-pass or
    smaller-tile config), each checked against torch and timed at both sweep token counts; a best
    config per kernel, and the rows run with it."""
    from reference_impl.bench import kernel_sweep
    from reference_impl.bench import kernels as bench

    out = tmp_path / "sweep.json"
    argv = ["--out", str(out), "--device", "cpu", "--tokens", "24", "--cp-size", "2", "--page-size", "8"]
    assert bench.main([*argv, "--sweep", "--sweep-tokens", "16,24"]) == 0
    result = json.loads(out.read_text())
    assert set(result["sweep"]) == set(kernel_sweep.SWEPT) and result["sweep_settings"]["tokens"] == [16, 24]
    for kernel, swept in result["sweep"].items():
        candidates = swept["candidates"]
        assert len(candidates) == 2 and candidates[0]["config"] == swept["default"]
        assert all(c["bytes_equal"] and c["ms"] > 0 and set(c["by_T"]) == {"16", "24"} for c in candidates)
        assert swept["best"] in [c["config"] for c in candidates] and swept["best_basis"] == "torch bytes"
        assert result["configs"][kernel] == swept["best"]
    for row in result["kernels"]:
        assert row["check"]["bytes_equal"]
        assert row["config"] == result["configs"][row["op"].replace("_torch_padded_gather", "")]
    assert "sweep" in bench.format_table(result)


def test_bench_kernels_repeats_keep_every_timing_and_their_median(
    tmp_path: Path, fs: object, fr: object, fm: object
) -> None:
    from reference_impl.bench import kernels as bench

    out = tmp_path / "kernels.json"
    argv = ["--out", str(out), "--device", "cpu", "--tokens", "16", "--cp-size", "2", "--page-size", "8"]
    assert bench.main([*argv, "--repeats", "3"]) == 0
    result = json.loads(out.read_text())
    assert result["repeats"] == 3
    for r in result["kernels"]:
        for path in ("triton", "torch"):
            times = r[f"{path}_ms_repeats"]
            assert len(times) == 3 and r[f"{path}_ms"] == sorted(times)[1]
    with pytest.raises(SystemExit):
        bench.main([*argv, "--repeats", "0"])


def test_kernels_refuse_misaligned_rows(fs: object) -> None:
    """Scales and bf16 values are stored through cast pointers: a pool at an odd byte offset is refused
    (the dispatch then falls back to torch with its one warning)."""
    layout = KVLayout(128, 64, "fp8", 4)
    pool = torch.zeros(4 * layout.mla_bytes + 1, dtype=torch.uint8)[1:].view(4, layout.mla_bytes)
    with pytest.raises(ValueError, match="aligned"):
        fs.store_mla_triton(torch.zeros(2, 192), None, torch.arange(2), pool, layout)  # type: ignore[attr-defined]

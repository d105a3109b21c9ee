"""Phase 7 on the GPU: every fused kernel byte-equal to its torch path at the engine's sizes (GPU tier).

DeepSeek-V3.2 layouts (576-wide latent + rope, FP8 656 B or BF16 1152 B per token, 128-wide indexer
K with ue8m0 scales, 64-token pages), one rank of C = 8 at 8K + 37 tokens: the last page is ragged.
The kernels use the hardware conversions here (the CPU tier checks the interpreter's software ones).
"""

from __future__ import annotations

import pytest
import torch
from conftest import as_bytes

from reference_impl.cp import fused_ops
from reference_impl.cp.ownership import page_owner, physical_locs
from reference_impl.cp.split import build_split
from reference_impl.cp.split_index import SplitIndex
from reference_impl.kernels import fallback, fused_torch
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import LocOutOfRangeError

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
TOKENS, CP, RANK, PAGE = 8192 + 37, 8, 3, 64


def _kv(n: int, width: int, seed: int) -> torch.Tensor:
    """bf16 rows spanning magnitudes (zero rows, fp8 subnormals, ordinary, large), as a layer's may."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    scale = torch.exp2(torch.randint(-12, 12, (n, 1), generator=gen, device=DEVICE).float())
    kv = torch.randn(n, width, generator=gen, device=DEVICE) * scale
    kv[0] = 0.0
    kv[1, : width // 2] = 1e-6
    return kv.to(torch.bfloat16)


def _owned_rows(n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence rows rank 3 of 8 owns (page-interleaved) and their compact physical locs."""
    locs = torch.arange(TOKENS, device=DEVICE)
    own = page_owner(locs // PAGE, CP) == RANK
    rows = own.nonzero().flatten()
    dst = physical_locs(locs[own], PAGE, CP)
    assert int(dst.max()) < n_slots
    return rows, dst


@pytest.fixture(autouse=True)
def no_fallbacks():
    fallback.reset_fallbacks()
    yield
    assert fallback.fallbacks_taken() == {}, "a kernel failed and its torch path ran instead"


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "owned-rows"])
def test_store_mla_and_index_equal_torch(kv_dtype: str, sharded: bool) -> None:
    from reference_impl.kernels.fused_store import store_index_triton, store_mla_triton

    layout = KVLayout(512, 64, kv_dtype, PAGE)
    n_pages = -(-TOKENS // PAGE)
    kv, k = _kv(TOKENS, 576, 1), _kv(TOKENS, 128, 2)
    src, dst = _owned_rows(n_pages * PAGE) if sharded else (None, torch.arange(TOKENS, device=DEVICE))
    pools = []
    for store_mla, store_index in (
        (store_mla_triton, store_index_triton),
        (fused_torch.store_mla_torch, fused_torch.store_index_torch),
    ):
        mla = torch.zeros(n_pages * PAGE, layout.mla_bytes, dtype=torch.uint8, device=DEVICE)
        index = torch.zeros(n_pages, layout.index_page_bytes, dtype=torch.uint8, device=DEVICE)
        store_mla(kv, src, dst, mla, layout)
        store_index(k, src, dst, index, layout)
        pools.append((mla, index))
    (mla_k, index_k), (mla_t, index_t) = pools
    assert torch.equal(mla_k, mla_t) and torch.equal(index_k, index_t)
    assert mla_k.any()


@pytest.mark.parametrize("width", [576, 128])
def test_rerange_equals_torch(width: int) -> None:
    from reference_impl.kernels.fused_rerange import rerange_padded_triton

    meta = build_split("in-seq", CP, [TOKENS - 1000, 1000], [0, 0], page_size=PAGE)
    index = SplitIndex.build(meta, RANK, DEVICE)
    raw = _kv(CP * meta.max_rank_len, width, 3).view(CP, meta.max_rank_len, width)
    got = rerange_padded_triton(raw, index.padded_rerange)
    want = fused_torch.rerange_padded_torch(raw, meta.rank_lengths, index.rerange)
    assert torch.equal(as_bytes(got), as_bytes(want)) and got.shape == (TOKENS, width)


@pytest.mark.parametrize(("kv_dtype", "mla_scale_fmt"), [("fp8", "ue8m0"), ("fp8", "fp32"), ("bf16", "ue8m0")])
def test_materialize_equals_torch(kv_dtype: str, mla_scale_fmt: str) -> None:
    from reference_impl.kernels.fused_materialize import materialize_mla_rows_triton, materialize_rows_triton

    layout = KVLayout(512, 64, kv_dtype, PAGE, mla_scale_fmt=mla_scale_fmt)
    n_pages = -(-TOKENS // PAGE)
    mla = torch.zeros(n_pages * PAGE, layout.mla_bytes, dtype=torch.uint8, device=DEVICE)
    index = torch.zeros(n_pages, layout.index_page_bytes, dtype=torch.uint8, device=DEVICE)
    slots = torch.arange(TOKENS, device=DEVICE)
    fused_torch.store_mla_torch(_kv(TOKENS, 576, 4), None, slots, mla, layout)
    fused_torch.store_index_torch(_kv(TOKENS, 128, 5), None, slots, index, layout)
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    view_rows = torch.randperm(TOKENS + 500, generator=gen, device=DEVICE)[:TOKENS]  # a scattered view
    source = torch.randperm(TOKENS, generator=gen, device=DEVICE)
    views = []
    for run in (materialize_rows_triton, fused_torch.materialize_rows_torch):
        kv = torch.full((TOKENS + 500, 576), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        i8 = torch.zeros(TOKENS + 500, 128, dtype=torch.uint8, device=DEVICE)
        sc = torch.zeros(TOKENS + 500, device=DEVICE)
        run(mla, index, source, view_rows, kv, i8.view(torch.float8_e4m3fn), sc, layout)
        views.append((kv, i8, sc))
    for got, want in zip(*views):
        assert torch.equal(as_bytes(got), as_bytes(want))
    mla_only = torch.full((TOKENS + 500, 576), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    materialize_mla_rows_triton(mla, source, view_rows, mla_only, layout)
    assert torch.equal(as_bytes(mla_only), as_bytes(views[1][0]))


def test_the_software_e4m3_decode_equals_torch_on_the_gpu() -> None:
    from test_fused_current import _decode_kernel

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F] + [0, 1], dtype=torch.uint8, device=DEVICE)
    out = torch.empty(256, device=DEVICE)
    _decode_kernel[(1,)](codes, out, BLOCK=256)
    assert torch.equal(out.view(torch.int32), codes.view(torch.float8_e4m3fn).float().view(torch.int32))


@pytest.mark.parametrize(("kv_dtype", "scale_fmt"), [("fp8", "ue8m0"), ("fp8", "fp32"), ("bf16", "ue8m0")])
def test_fill_current_equals_torch(kv_dtype: str, scale_fmt: str) -> None:
    """Phase 3's current rows through the fused kernel: the torch path's bytes (the full 128K chunk of C = 8)."""
    from reference_impl.cp.current_reuse import fill_rows
    from reference_impl.kernels.fused_current import fill_current_triton

    layout = KVLayout(512, 64, kv_dtype, PAGE, index_scale_fmt=scale_fmt)
    n = CP * 16384
    kv, k = _kv(n, 576, 7), _kv(n, 128, 8)
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    view_rows = torch.randperm(n + 300, generator=gen, device=DEVICE)[:n]
    views = []
    for run in (fill_current_triton, fill_rows):
        kv_view = torch.full((n + 300, 576), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        i8 = torch.zeros(n + 300, 128, dtype=torch.uint8, device=DEVICE)
        sc = torch.zeros(n + 300, device=DEVICE)
        run(kv, k, view_rows, kv_view, i8.view(torch.float8_e4m3fn), sc, layout)
        views.append((kv_view, i8, sc))
    for got, want in zip(*views):
        assert torch.equal(as_bytes(got), as_bytes(want))


def test_the_dispatch_runs_the_kernels_and_refuses_bad_locs_like_torch() -> None:
    """Through ``cp.fused_ops``: the kernel path's bytes equal ``force_torch``'s, and an out-of-range
    loc raises the same error on both paths before anything is written."""
    layout = KVLayout(512, 64, "fp8", PAGE)
    kv, k = _kv(TOKENS, 576, 7), _kv(TOKENS, 128, 8)
    dst = torch.arange(TOKENS, device=DEVICE)
    n_pages = -(-TOKENS // PAGE)
    pools = {}
    for force_torch in (False, True):
        mla = torch.zeros(n_pages * PAGE, layout.mla_bytes, dtype=torch.uint8, device=DEVICE)
        index = torch.zeros(n_pages, layout.index_page_bytes, dtype=torch.uint8, device=DEVICE)
        fused_ops.fused_store_mla(kv, None, dst, mla, layout, force_torch=force_torch, locs_checked=True)
        fused_ops.fused_store_index(k, None, dst, index, layout, force_torch=force_torch, locs_checked=True)
        pools[force_torch] = (mla, index)
        bad = dst.clone()
        bad[-1] = n_pages * PAGE
        empty = torch.zeros_like(mla)
        with pytest.raises(LocOutOfRangeError, match=r"dst_locs span \[0, \d+\] outside"):
            fused_ops.fused_store_mla(kv, None, bad, empty, layout, force_torch=force_torch)
        assert not empty.any()
    assert all(torch.equal(a, b) for a, b in zip(pools[False], pools[True]))
    assert fallback.use_kernels(DEVICE) is True


@pytest.mark.gpu_ranks  # beside no other worker's CP ranks: their kernels, time-sliced in, would be timed too
def test_the_queued_timer_keeps_the_hosts_launch_work_out() -> None:
    """bench.kernels' timer: a call that spends 0.15 ms on the host before a tiny kernel. ``do_bench``
    times the GPU waiting for the host (at least the 0.15 ms less its 256 MB flush); the queued
    timer, whose launches wait behind a GPU sleep, the kernel's few microseconds (under 0.05 ms:
    the host's 0.15 ms stays out, with room for another worker's kernels sharing the GPU)."""
    import time

    import triton.testing

    from reference_impl.bench.timing import queued_median_ms

    x = torch.zeros(4096, device=DEVICE)

    def slow_host_tiny_kernel() -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < 1.5e-4:
            pass
        x.add_(1.0)

    queued = queued_median_ms(slow_host_tiny_kernel, reps=40)
    waited = triton.testing.do_bench(slow_host_tiny_kernel, warmup=5, rep=20, return_mode="median")
    assert queued < 0.05, queued
    assert waited > 0.04, waited

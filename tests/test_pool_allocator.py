"""Paged KV pools (byte placement, accounting, debug checks) and the page allocator / page table."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl.config import ConfigError, get_preset
from reference_impl.kvcache import (
    KVLayout,
    LocOutOfRangeError,
    PageAllocator,
    PagedKVPool,
    ReqToToken,
    RequestPageTable,
    pack_index_pages,
    pack_mla,
    quantize_index_k,
)


def _layout(kv_dtype: str = "fp8", page_size: int = 16, preset: str = "tiny") -> KVLayout:
    return KVLayout.from_config(get_preset(preset), kv_dtype, page_size)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Pool
# ---------------------------------------------------------------------------------------------


def test_pool_shapes_and_byte_accounting() -> None:
    layout = _layout("fp8", 64, "deepseek-v3.2")
    pool = PagedKVPool(n_layers=3, n_pages=5, page_size=64, layout=layout, device="cpu")
    assert pool.mla.shape == (3, 5 * 64, 656) and pool.mla.dtype == torch.uint8
    assert pool.index.shape == (3, 5, 8448) and pool.index.dtype == torch.uint8
    assert pool.mla_bytes_total == 3 * 5 * 64 * 656
    assert pool.index_bytes_total == 3 * 5 * 8448
    assert pool.bytes_for_pages(5) == pool.mla_bytes_total + pool.index_bytes_total == pool.bytes_total
    assert pool.mla_bytes_for_pages(2) == 3 * 2 * 64 * 656 and pool.index_bytes_for_pages(1) == 3 * 8448
    bf16 = PagedKVPool(1, 2, 64, _layout("bf16", 64, "deepseek-v3.2"))
    assert bf16.mla_bytes_total == 2 * 64 * 1152
    with pytest.raises(ConfigError, match="page_size"):
        PagedKVPool(1, 2, 32, layout)


@settings(max_examples=20, deadline=None)
@given(
    kv_dtype=st.sampled_from(["fp8", "bf16"]),
    page=st.sampled_from([4, 16, 64]),
    n_pages=st.integers(1, 6),
    data=st.data(),
)
def test_mla_write_read_round_trip(kv_dtype: str, page: int, n_pages: int, data: st.DataObject) -> None:
    layout = _layout(kv_dtype, page)
    pool = PagedKVPool(2, n_pages, page, layout)
    n_slots = n_pages * page
    n = data.draw(st.integers(0, n_slots))
    seed = data.draw(st.integers(0, 2**31 - 1))
    locs = torch.randperm(n_slots, generator=_gen(seed))[:n]
    rows = pack_mla(torch.randn(n, layout.kv_width, generator=_gen(seed + 1)), layout.kv_lora, kv_dtype)
    pool.write_mla(1, locs, rows)
    assert torch.equal(pool.read_mla(1, locs), rows)
    assert torch.equal(pool.mla[1, locs], rows)
    untouched = torch.ones(n_slots, dtype=torch.bool)
    untouched[locs] = False
    assert not pool.mla[1, untouched].any() and not pool.mla[0].any()


def test_index_write_places_bytes_in_page() -> None:
    page = 64
    layout = _layout("fp8", page)
    pool = PagedKVPool(2, 4, page, layout)
    locs = torch.tensor([5, 64 + 63, 3 * 64])
    k_fp8, k_scale = quantize_index_k(torch.randn(3, 128, generator=_gen(1)), "ue8m0")
    pool.write_index(0, locs, k_fp8, k_scale)
    for i, loc in enumerate(locs.tolist()):
        p, slot = divmod(loc, page)
        raw = pool.index[0, p].numpy().tobytes()
        assert raw[slot * 128 : slot * 128 + 128] == k_fp8[i].view(torch.uint8).numpy().tobytes()
        assert struct.unpack("<f", raw[8192 + 4 * slot : 8196 + 4 * slot])[0] == float(k_scale[i])
    assert int(pool.index[0].count_nonzero()) <= 3 * 132 and not pool.index[1].any()
    out_fp8, out_scale = pool.read_index(0, locs)
    assert out_fp8.dtype == torch.float8_e4m3fn and torch.equal(out_fp8.view(torch.uint8), k_fp8.view(torch.uint8))
    assert torch.equal(out_scale, k_scale)


@settings(max_examples=20, deadline=None)
@given(page=st.sampled_from([4, 8, 64]), n=st.integers(0, 150), seed=st.integers(0, 2**31 - 1))
def test_index_pool_matches_packed_pages(page: int, n: int, seed: int) -> None:
    """Tokens 0..n-1 written at locs 0..n-1 in a shuffled order give exactly the packed page layout."""
    n_pages = -(-n // page) + 1
    pool = PagedKVPool(1, n_pages, page, _layout("fp8", page))
    k_fp8, k_scale = quantize_index_k(torch.randn(n, 128, generator=_gen(seed)), "fp32")
    order = torch.randperm(n, generator=_gen(seed + 1))
    pool.write_index(0, order, k_fp8[order], k_scale[order])
    expected = pack_index_pages(k_fp8, k_scale, page)
    assert torch.equal(pool.index[0, : expected.shape[0]], expected)
    assert not pool.index[0, expected.shape[0] :].any()


def test_debug_flag_checks_loc_range() -> None:
    layout = _layout("fp8", 16)
    rows = torch.zeros(2, layout.mla_bytes, dtype=torch.uint8)
    pool = PagedKVPool(2, 2, 16, layout, debug=True)
    with pytest.raises(LocOutOfRangeError, match=r"locs span \[3, 32\] outside \[0, 32\)") as info:
        pool.write_mla(0, torch.tensor([3, 32]), rows)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, IndexError)
    with pytest.raises(LocOutOfRangeError, match="locs span"):
        pool.read_index(1, torch.tensor([-1]))
    with pytest.raises(LocOutOfRangeError, match="layer 2"):
        pool.read_mla(2, torch.tensor([0]))
    # Metadata checks run without debug.
    quiet = PagedKVPool(2, 2, 16, layout)
    with pytest.raises(ConfigError, match="int64"):
        quiet.read_mla(0, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ConfigError, match="write_mla expects rows"):
        quiet.write_mla(0, torch.tensor([1, 2]), torch.zeros(2, layout.mla_bytes + 1, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="k_scale"):
        quiet.write_index(0, torch.tensor([1]), torch.zeros(1, 128, dtype=torch.float8_e4m3fn), torch.zeros(2))


# ---------------------------------------------------------------------------------------------
# Allocator and page table
# ---------------------------------------------------------------------------------------------


def test_alloc_lowest_first_and_reuse_after_free() -> None:
    alloc = PageAllocator(6, 16)
    assert alloc.alloc(3) == [0, 1, 2] and alloc.n_free == 3
    alloc.free([1, 0])
    assert alloc.alloc(3) == [0, 1, 3]
    assert alloc.n_free == 2 and alloc.n_used == 4
    with pytest.raises(ConfigError, match="already free"):
        alloc.free([4])
    with pytest.raises(ConfigError, match="outside"):
        alloc.free([6])


def test_exhaustion_message_and_no_partial_state() -> None:
    table = RequestPageTable(PageAllocator(3, 64))
    table.extend("a", 130)  # 3 pages
    with pytest.raises(ConfigError, match=r"asked for 1 pages of 64 tokens, 0 of 3 are free"):
        table.extend("b", 1)
    assert "b" not in table
    table.extend("a", 62)  # fills the last page exactly: no new page needed
    with pytest.raises(ConfigError, match=r"asked for 2 pages.*0 of 3 are free"):
        table.extend("a", 65)
    assert table.n_tokens("a") == 192 and table.pages("a") == [0, 1, 2]


def test_request_pages_reused_after_free() -> None:
    table = ReqToToken(PageAllocator(8, 64))
    table.extend("a", 130)
    table.extend("b", 10)
    assert table.pages("a") == [0, 1, 2] and table.pages("b") == [3]
    table.free("a")
    assert table.allocator.n_free == 7
    table.extend("c", 64)
    assert table.pages("c") == [0]
    assert torch.equal(table.locs("c"), torch.arange(64))
    with pytest.raises(ConfigError, match="unknown request"):
        table.locs("a")


def test_prefix_not_page_multiple_continues_in_same_page() -> None:
    page = 64
    table = RequestPageTable(PageAllocator(8, page))
    first = table.extend("a", 40)  # prefix: 40 tokens of page 0
    table.extend("b", 10)  # page 1
    second = table.extend("a", 50)  # 24 more in page 0, then 26 in page 2
    assert torch.equal(first, torch.arange(40))
    assert torch.equal(second, torch.cat([torch.arange(40, 64), torch.arange(2 * page, 2 * page + 26)]))
    assert table.pages("a") == [0, 2]
    locs = table.locs("a")
    assert locs.dtype == torch.int64 and torch.equal(locs, torch.cat([first, second]))


@settings(max_examples=30, deadline=None)
@given(
    page=st.sampled_from([4, 16, 64]),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(-1, 100)), max_size=25),
)
def test_page_table_invariants(page: int, ops: list[tuple[int, int]]) -> None:
    """Random extends (n >= 0) and frees (n == -1): locs stay unique, contiguous within pages."""
    alloc = PageAllocator(40, page)
    table = RequestPageTable(alloc)
    for req, n in ops:
        if n < 0:
            if req in table:
                table.free(req)
            continue
        try:
            table.extend(req, n)
        except ConfigError:
            assert -(-n // page) > alloc.n_free
    live = [r for r in range(4) if r in table]
    all_locs = []
    for r in live:
        locs, pages = table.locs(r), table.pages(r)
        assert locs.numel() == table.n_tokens(r) and len(pages) == -(-table.n_tokens(r) // page)
        assert torch.equal(locs // page, torch.tensor(pages).repeat_interleave(page)[: locs.numel()])
        assert torch.equal(locs % page, torch.arange(locs.numel()) % page)
        all_locs.append(locs)
    used = sum(len(table.pages(r)) for r in live)
    assert used == alloc.n_used
    if all_locs:
        cat = torch.cat(all_locs)
        assert cat.unique().numel() == cat.numel()

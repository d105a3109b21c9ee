"""The page allocator's fast paths (a floor per lane, stale heap entries) against a plain model.

Any sequence of lowest-first allocations, lane allocations and frees hands out exactly the pages a
sorted scan of the free set would, and a 1M-token chunked prefill's lane allocations stay cheap.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl.config import ConfigError
from reference_impl.kvcache.allocator import PageAllocator

OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "lane", "free"]), st.integers(0, 6), st.integers(0, 3), st.sampled_from([2, 3, 4])
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, n_pages=st.integers(1, 40))
def test_property_the_allocator_hands_out_what_a_sorted_scan_would(ops: list, n_pages: int) -> None:
    alloc, free, held = PageAllocator(n_pages, 4), set(range(n_pages)), []
    for op, n, lane, n_lanes in ops:
        lane %= n_lanes
        if op == "free":
            if held:
                give = held[: n + 1]
                del held[: n + 1]
                alloc.free(give)
                free.update(give)
            continue
        want = sorted(free) if op == "alloc" else sorted(p for p in free if p % n_lanes == lane)
        try:
            got = alloc.alloc(n) if op == "alloc" else alloc.alloc_in_lane(n, lane, n_lanes)
        except ConfigError:
            assert n > len(want)
            continue
        assert got == want[:n]
        free.difference_update(got)
        held.extend(got)
        assert alloc.n_free == len(free)


def test_lane_allocation_of_a_long_context_is_linear() -> None:
    """16,384 lane pages (1M tokens at 64 per page, 8 lanes), one at a time: well under a second."""
    alloc = PageAllocator(16384 + 64, 64)
    start = time.perf_counter()
    pages = [alloc.alloc_in_lane(1, i % 8, 8)[0] for i in range(16384)]
    assert time.perf_counter() - start < 2.0
    assert pages[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 8] and len(set(pages)) == 16384
    with pytest.raises(ConfigError, match="out of KV pages in lane"):
        alloc.alloc_in_lane(9, 0, 8)

"""PD transfer into a decode-context-parallel decode: token shards, byte-equal to the oracle.

With round-robin at interleave 1 the prefill shards are the DCP decode's layout: every row goes
to the same-numbered decode rank at its next local row (no re-layout). Any other pairing re-lays
the rows out by position, and the decode is byte-equal to the oracle all the same.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from reference_impl.config import ConfigError, PhaseSet, Request
from reference_impl.kvcache.layout import KVLayout
from reference_impl.pd.dcp import DcpLayout, transfer_to_dcp
from reference_impl.runner import run_prefill

MIXED = (Request(37, 70), Request(0, 45), Request(5, 9))
PAGE = 16


def _prefill_and_transfer(decode: DcpLayout, **changes):  # -> (shards, stats, run, result)
    run = tiny(requests=MIXED, page_size=PAGE, **changes)
    result = run_prefill(run, tensors=True)
    assert result.report["matches_oracle"] is True
    lens = [r.total for r in MIXED]
    pages = sum(-(-n // decode.cp_size // PAGE) + 1 for n in lens)
    layout = KVLayout.from_config(run.model, run.kv_dtype, PAGE)
    shards, stats = transfer_to_dcp([r.stored for r in result.ranks], lens, decode, layout, pages)
    return shards, stats, run, result


def _assert_byte_equal_to_oracle(shards, decode: DcpLayout, result) -> None:
    for layer, caches in enumerate(result.oracle.caches):
        for request, cache in enumerate(caches):
            positions = torch.arange(len(cache))
            for d, shard in enumerate(shards):
                mine = positions[decode.rank_of(positions) == d]  # ascending: the shard's local order
                mla, index, scale = shard.rows(layer, request)
                assert torch.equal(mla, cache.mla_rows[mine].cpu()), (layer, request, d)
                assert torch.equal(index, cache.index_fp8[mine].cpu().view(torch.uint8)), (layer, request, d)
                assert torch.equal(scale, cache.index_scale[mine].cpu()), (layer, request, d)


def _assert_no_holes(stats, run, layout_bytes: int) -> None:
    rows = run.model.n_layers * sum(r.total for r in MIXED)
    assert sum(s.rows_sent for s in stats) == rows  # every token of every layer once: no page padding
    assert sum(s.bytes_sent for s in stats) == rows * layout_bytes


@pytest.mark.parametrize("chunk_size", [None, 20])
def test_round_robin_shards_are_the_dcp_decode_with_no_relayout(chunk_size: int | None) -> None:
    decode = DcpLayout(cp_size=4, interleave=1)
    shards, stats, run, result = _prefill_and_transfer(
        decode, cp_size=4, split_mode="round-robin", phases=PhaseSet.parse("+1,2,3,6,7,8"), chunk_size=chunk_size
    )
    _assert_byte_equal_to_oracle(shards, decode, result)
    assert [s.relaid_rows for s in stats] == [0, 0, 0, 0]
    assert [s.to_ranks for s in stats] == [{0}, {1}, {2}, {3}]  # prefill rank r -> decode rank r only
    layout = KVLayout.from_config(run.model, run.kv_dtype, PAGE)
    _assert_no_holes(stats, run, layout.mla_bytes + layout.index_head_dim + 4)


@pytest.mark.parametrize(
    ("changes", "decode"),
    [
        ({"cp_size": 2, "phases": PhaseSet.level(3)}, DcpLayout(2, 1)),  # in-seq page interleave -> interleave 1
        ({"cp_size": 4, "split_mode": "round-robin", "phases": PhaseSet.level(3)}, DcpLayout(2, 1)),  # another size
        (
            {"cp_size": 2, "split_mode": "round-robin", "phases": PhaseSet.level(2)},
            DcpLayout(2, 8),
        ),  # another interleave
        (
            {"cp_size": 3, "split_mode": "round-robin", "phases": PhaseSet.level(2)},
            DcpLayout(3, 1),
        ),  # 3 does not divide 16
    ],
)
def test_other_pairings_relayout_and_stay_byte_equal(changes: dict, decode: DcpLayout) -> None:
    shards, stats, run, result = _prefill_and_transfer(decode, **changes)
    _assert_byte_equal_to_oracle(shards, decode, result)
    assert sum(s.relaid_rows for s in stats) > 0
    layout = KVLayout.from_config(run.model, run.kv_dtype, PAGE)
    _assert_no_holes(stats, run, layout.mla_bytes + layout.index_head_dim + 4)


def test_decode_page_ids_are_the_decode_ranks_own() -> None:
    decode = DcpLayout(cp_size=2, interleave=1)
    shards, _, _, _ = _prefill_and_transfer(decode, cp_size=2, split_mode="round-robin", phases=PhaseSet.level(2))
    # Each decode rank allocated its share from page 0 of its own allocator, request by request.
    assert shards[0].table.pages(0)[0] == 0 and shards[1].table.pages(0)[0] == 0
    assert all(shard.table.n_tokens(0) == decode.share(MIXED[0].total, shard.rank) for shard in shards)


def test_a_missing_row_is_an_error() -> None:
    decode = DcpLayout(cp_size=2, interleave=1)
    run = tiny(cp_size=2, split_mode="round-robin", requests=MIXED, page_size=PAGE, phases=PhaseSet.level(2))
    result = run_prefill(run, tensors=True)
    stored = [r.stored for r in result.ranks]
    stored[1] = [dict(per_layer) for per_layer in stored[1]]
    del stored[1][0][2]  # rank 1 loses request 2's rows of layer 0
    layout = KVLayout.from_config(run.model, run.kv_dtype, PAGE)
    with pytest.raises(ConfigError, match="decode rank 1 request 2: layer 0 local row 0 is missing"):
        transfer_to_dcp(stored, [r.total for r in MIXED], decode, layout, 16)

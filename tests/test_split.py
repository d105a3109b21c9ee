"""CP split metadata: SGLang's published zigzag semantics, round-robin, rerange, segments, validation.

The property tests compare against a brute-force token-to-rank map written here independently of
``reference_impl.cp.split`` (numpy's ``array_split`` cuts the zigzag blocks).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl.config import ConfigError
from reference_impl.cp.split import Segment, build_split, in_seq_block_sizes, split_from_blocks
from reference_impl.cp.split_index import SplitIndex, local_index_tensor, rerange_tensor

# ---- published and hand-written cases ---------------------------------------------------


def test_sglang_published_case_l19_c4() -> None:
    meta = build_split("in-seq", 4, [19])
    assert meta.block_sizes == ((3, 3, 3, 2, 2, 2, 2, 2),)
    assert meta.local_tokens(0) == (0, 1, 2, 17, 18)
    assert meta.rank_tokens == ((0, 1, 2, 17, 18), (3, 4, 5, 15, 16), (6, 7, 8, 13, 14), (9, 10, 11, 12))
    # SGLang: kv_len_prev = prefix_sum[r], kv_len_next = prefix_sum[2C-1-r] (no prefix).
    assert [(s.half, s.length, s.kv_len) for s in meta.segments[0]] == [("prev", 3, 3), ("next", 2, 19)]
    assert [(s.half, s.length, s.kv_len) for s in meta.segments[3]] == [("prev", 2, 11), ("next", 2, 13)]


def test_multi_request_by_hand() -> None:
    # Request 0: prefix 3, extend 10 -> blocks [3,3,2,2]; request 1: prefix 0, extend 5 -> [2,1,1,1].
    meta = build_split("in-seq", 2, [10, 5], [3, 0], page_size=4)
    assert meta.block_sizes == ((3, 3, 2, 2), (2, 1, 1, 1))
    assert meta.request_token_offsets == (0, 10)
    assert meta.rank_tokens == ((0, 1, 2, 10, 11, 8, 9, 14), (3, 4, 5, 12, 6, 7, 13))
    assert meta.local_positions(0) == (3, 4, 5, 0, 1, 11, 12, 4)
    assert meta.segments == (
        (
            Segment(0, "prev", 0, 3, 3, 6),
            Segment(1, "prev", 3, 2, 0, 2),
            Segment(0, "next", 5, 2, 11, 13),
            Segment(1, "next", 7, 1, 4, 5),
        ),
        (
            Segment(0, "prev", 0, 3, 6, 9),
            Segment(1, "prev", 3, 1, 2, 3),
            Segment(0, "next", 4, 2, 9, 11),
            Segment(1, "next", 6, 1, 3, 4),
        ),
    )
    assert meta.gather_position == (0, 1, 2, 10, 11, 8, 9, 14, 3, 4, 5, 12, 6, 7, 13)
    assert meta.rerange_index == (0, 1, 2, 8, 9, 10, 12, 13, 5, 6, 3, 4, 11, 14, 7)
    assert meta.rank_lengths == (8, 7) and meta.max_rank_len == 8 and meta.total_tokens == 15
    assert meta.rank_pages == (((0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)), ((0, 1), (0, 2), (1, 0)))
    assert meta.page_size == 4 and meta.page_aligned is False


def test_padded_rerange_when_a_later_rank_is_longest() -> None:
    meta = build_split("in-seq", 2, [7])  # blocks [2,2,2,1]: rank 0 has 3 tokens, rank 1 has 4
    assert meta.rank_tokens == ((0, 1, 6), (2, 3, 4, 5))
    assert meta.rerange_index == (0, 1, 3, 4, 5, 6, 2)
    assert meta.padded_rerange_index == (0, 1, 4, 5, 6, 7, 2)


def test_round_robin_by_hand() -> None:
    # The token at absolute position t goes to rank t % C: request 0 (prefix 5) holds positions
    # 5, 6, 7 (ranks 1, 0, 1); request 1 holds positions 0..3 (ranks 0, 1, 0, 1).
    meta = build_split("round-robin", 2, [3, 4], [5, 0], page_size=2)
    assert meta.block_sizes == ()
    assert meta.rank_tokens == ((1, 3, 5), (0, 2, 4, 6))
    assert meta.local_positions(0) == (6, 0, 2)
    assert meta.segments[1] == (
        Segment(0, "rr", 0, 1, 5, 6),
        Segment(0, "rr", 1, 1, 7, 8),
        Segment(1, "rr", 2, 1, 1, 2),
        Segment(1, "rr", 3, 1, 3, 4),
    )
    # One rank: each request is a single run.
    solo = build_split("round-robin", 1, [3, 4], [5, 0])
    assert solo.segments == ((Segment(0, "rr", 0, 3, 5, 8), Segment(1, "rr", 3, 4, 0, 4)),)


def test_to_json_round_trips_and_names_fields() -> None:
    meta = build_split("in-seq", 2, [10, 5], [3, 0], page_size=4)
    doc = json.loads(json.dumps(meta.to_json()))
    assert doc["mode"] == "in-seq" and doc["cp_size"] == 2 and doc["page_size"] == 4
    assert doc["requests"][1] == {"prefix": 0, "extend": 5, "block_sizes": [2, 1, 1, 1]}
    rank0 = doc["ranks"][0]
    assert rank0["tokens"] == [0, 1, 2, 10, 11, 8, 9, 14] and rank0["length"] == 8
    assert rank0["positions"] == [3, 4, 5, 0, 1, 11, 12, 4]
    assert rank0["segments"][2] == {
        "request": 0,
        "half": "next",
        "local_start": 5,
        "length": 2,
        "q_abs_start": 11,
        "kv_len": 13,
    }
    assert rank0["pages"][0] == [0, 0]
    assert doc["rerange_index"] == list(meta.rerange_index)


def test_torch_helpers_simulate_padded_all_gather() -> None:
    meta = build_split("in-seq", 3, [20, 7], [5, 64])
    full = torch.arange(meta.total_tokens) * 10
    locals_ = [full[local_index_tensor(meta, r)] for r in range(meta.cp_size)]
    padded = torch.cat([torch.nn.functional.pad(x, (0, meta.max_rank_len - len(x)), value=-1) for x in locals_])
    assert torch.equal(padded[rerange_tensor(meta, padded=True)], full)
    assert torch.equal(torch.cat(locals_)[rerange_tensor(meta)], full)
    index = SplitIndex.build(meta, 1)
    assert torch.equal(index.local, local_index_tensor(meta, 1)) and index.rank_lengths == meta.rank_lengths
    assert torch.equal(index.rerange, rerange_tensor(meta)) and torch.equal(
        index.padded_rerange, rerange_tensor(meta, padded=True)
    )


# ---- brute force ------------------------------------------------------------------------


def brute_force(mode: str, cp: int, extends: list[int], prefixes: list[int]) -> tuple[list[list[int]], list[int]]:
    """(per-rank global tokens in local order, per-token absolute position), from first principles."""
    owner_key: list[tuple[int, tuple[int, ...]]] = []  # per global token: (rank, local sort key)
    positions: list[int] = []
    g = 0
    for i, (e, p) in enumerate(zip(extends, prefixes)):
        for b, chunk in enumerate(np.array_split(np.arange(e), 2 * cp)):  # first e % 2C chunks are longer
            for j in chunk.tolist():
                if mode == "in-seq":
                    rank, half = (b, 0) if b < cp else (2 * cp - 1 - b, 1)
                    owner_key.append((rank, (half, i, j)))
                else:  # round-robin: by absolute position, in batch order
                    owner_key.append(((p + j) % cp, (g,)))
                positions.append(p + j)
                g += 1
    ranks: list[list[int]] = [[] for _ in range(cp)]
    for t in sorted(range(g), key=lambda t: owner_key[t][1]):
        ranks[owner_key[t][0]].append(t)
    return ranks, positions


@st.composite
def batches(draw: st.DrawFn) -> tuple[str, int, list[int], list[int], int]:
    mode = draw(st.sampled_from(["in-seq", "round-robin"]))
    n = draw(st.integers(1, 4))
    extends = draw(st.lists(st.integers(1, 90), min_size=n, max_size=n))
    prefixes = draw(st.lists(st.integers(0, 150), min_size=n, max_size=n))
    cp = draw(st.integers(1, min(8, max(extends))))  # the longest request covers every rank (both modes)
    page = draw(st.sampled_from([1, 2, 16, 64]))
    return mode, cp, extends, prefixes, page


@settings(max_examples=200, deadline=None)
@given(batches())
def test_split_matches_brute_force(batch: tuple[str, int, list[int], list[int], int]) -> None:
    mode, cp, extends, prefixes, page = batch
    meta = build_split(mode, cp, extends, prefixes, page_size=page)
    ranks, positions = brute_force(mode, cp, extends, prefixes)
    total = sum(extends)

    assert [list(t) for t in meta.rank_tokens] == ranks
    assert all(meta.rank_lengths)  # every rank gets work
    assert sorted(t for r in meta.rank_tokens for t in r) == list(range(total))  # each token exactly once
    gathered = [t for r in meta.rank_tokens for t in r]
    assert [gathered[i] for i in meta.rerange_index] == list(range(total))
    assert [meta.gather_position[i] for i in meta.rerange_index] == list(range(total))
    padded = [-1] * (cp * meta.max_rank_len)
    for r, toks in enumerate(meta.rank_tokens):
        padded[r * meta.max_rank_len : r * meta.max_rank_len + len(toks)] = toks
    assert [padded[i] for i in meta.padded_rerange_index] == list(range(total))
    assert list(meta.token_position) == positions
    if mode == "round-robin":
        assert all(positions[t] % cp == r for r, toks in enumerate(meta.rank_tokens) for t in toks)

    for r, segs in enumerate(meta.segments):
        toks = meta.rank_tokens[r]
        assert [s.local_start for s in segs] == [0] + [s.local_stop for s in segs[:-1]]
        assert segs[-1].local_stop == len(toks)
        for s in segs:
            run = toks[s.local_start : s.local_stop]
            assert {meta.token_request[t] for t in run} == {s.request}
            assert [positions[t] for t in run] == list(range(s.q_abs_start, s.q_abs_start + s.length))
            assert s.kv_len == positions[run[-1]] + 1  # causal length of the segment's last query
            assert s.half == ("rr" if mode == "round-robin" else s.half)
        expected_pages = sorted({(meta.token_request[t], positions[t] // page) for t in toks})
        assert list(meta.rank_pages[r]) == expected_pages


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 500))
def test_block_sizes_balanced(cp: int, length: int) -> None:
    sizes = in_seq_block_sizes(length, cp)
    assert len(sizes) == 2 * cp and sum(sizes) == length
    assert max(sizes) - min(sizes) <= 1
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 400), st.data())
def test_single_request_matches_sglang_block_rerange(cp: int, length: int, data: st.DataObject) -> None:
    """SGLang reranges whole blocks: rank-major pieces [b0, b_{2C-1}, b1, b_{2C-2}, ...] reordered."""
    if length < cp:
        length = cp
    rank = data.draw(st.integers(0, cp - 1))
    meta = build_split("in-seq", cp, [length])
    split_list = list(meta.block_sizes[0])
    reverse_split_len = [n for r in range(cp) for n in (split_list[r], split_list[2 * cp - 1 - r])]
    cp_reverse_index = list(range(0, 2 * cp, 2)) + list(range(2 * cp - 1, 0, -2))
    pieces, start = [], 0
    gathered = list(meta.gather_position)
    for n in reverse_split_len:
        pieces.append(gathered[start : start + n])
        start += n
    assert [t for i in cp_reverse_index for t in pieces[i]] == list(range(length))
    prefix_sum = np.cumsum(split_list).tolist()
    prev, nxt = meta.segments[rank][0], meta.segments[rank][-1]
    assert (prev.half, prev.kv_len, prev.length) == ("prev", prefix_sum[rank], split_list[rank])
    if split_list[2 * cp - 1 - rank]:
        assert (nxt.half, nxt.kv_len) == ("next", prefix_sum[2 * cp - 1 - rank])


# ---- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: build_split("in-seq", 0, [8]), "cp_size=0"),
        (lambda: build_split("in-seq", 2, []), "empty batch"),
        (lambda: build_split("in-seq", 2, [8, 0]), "extend=0"),
        (lambda: build_split("round-robin", 2, [8], [-1]), "prefix=-1"),
        (lambda: build_split("in-seq", 2, [8], [0, 0]), "2 prefix lengths for 1 requests"),
        (lambda: build_split("zigzag", 2, [8]), "split mode 'zigzag'"),
        (lambda: build_split("in-seq", 2, [8], page_size=0), "page_size=0"),
        (lambda: build_split("in-seq", 2, [8], page_size=48), "power of two"),
        (
            lambda: build_split("in-seq", 4, [3, 2]),
            "cp_size=4 is larger than the tokens allow: in-seq split needs at least 4 extend tokens "
            "in the longest request (longest has 3)",
        ),
        (
            lambda: build_split("round-robin", 4, [1, 2]),
            "leave rank(s) [2, 3] without a token",
        ),
        (  # four tokens, but positions 0, 4, 8, 12: all on rank 0
            lambda: build_split("round-robin", 4, [1, 1, 1, 1], [0, 4, 8, 12]),
            "leave rank(s) [1, 2, 3] without a token",
        ),
        (lambda: build_split("in-seq", 2, [8]).local_tokens(2), "rank=2 is out of range"),
        (lambda: split_from_blocks(2, [8], [0], [(4, 4, 0)]), "block sizes [4, 4, 0]"),
        (lambda: split_from_blocks(2, [8], [0], [(4, 0, 0, 4)]), "leaves rank 1"),
        (lambda: in_seq_block_sizes(5, 0), "cp_size=0"),
    ],
)
def test_validation_errors(call, words: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert words in message and "\n" not in message

"""CP split metadata: which extend tokens each rank computes, in which order, and the rerange.

Two split modes, both reproducing SGLang's published semantics:

* ``in-seq`` (zigzag): each request's ``L`` extend tokens are cut into ``2C`` contiguous blocks of
  ``L // 2C`` tokens, the ``L % 2C`` remainder going one token each to the *first* blocks. Rank
  ``r`` computes block ``r`` ("prev") and block ``2C-1-r`` ("next"), which balances causal work.
  A rank's local order is all its prev blocks (request 0, 1, ...) then all its next blocks.
  Example: ``L=19, C=4`` gives blocks ``[3,3,3,2,2,2,2,2]`` and rank 0 owns tokens ``[0,1,2,17,18]``.
* ``round-robin``: the token at absolute position ``t`` of each request (prefix included) goes to
  rank ``t % C``; local order is the batch's token order. For one request whose prefix is a
  multiple of ``C`` this is SGLang's round-robin over the flattened batch; unlike that, a token's
  rank never depends on the other requests of its batch or on how a request is chunked, so with KV
  sharded at interleave 1 (:mod:`reference_impl.cp.ownership`) every rank owns exactly the tokens
  it computes, chunk after chunk.

Index spaces used throughout:

* **global token index** ``g``: index into the concatenation of all requests' extend tokens
  (request 0's extend tokens, then request 1's, ...). Token ``j`` of request ``i`` has
  ``g = request_token_offsets[i] + j`` and absolute position ``prefix_lens[i] + j``.
* **local index**: position in one rank's local order (``rank_tokens[r][k]`` is its global index).
* **rank-major row**: row of the unpadded all-gather result (rank 0's local tokens, then rank 1's,
  ...). ``gathered[rerange_index]`` is in sequence order; ``gather_position`` is the inverse.
* **padded row**: row of the padded all-gather result, where every rank sends ``max_rank_len``
  rows; rank ``r``'s local ``k`` sits at ``r * max_rank_len + k`` (``padded_rerange_index``).

Everything here is pure integer logic on host (no torch); the metadata types live in
:mod:`reference_impl.cp.split_metadata`, their device form in :mod:`reference_impl.cp.split_index`.

Extension point for the page-aligned split (phase 4): a builder computes per-request block sizes
its own way and hands them to :func:`split_from_blocks` with ``page_aligned=True``;
:func:`in_seq_block_sizes` is the token-balanced rule this module uses.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from reference_impl.config import MAX_BATCH_TOKENS, ConfigError
from reference_impl.cp.split_metadata import DEFAULT_PAGE_SIZE, SPLIT_MODES, Half, Segment, SplitMetadata
from reference_impl.machine import available_host_bytes

__all__ = ["Segment", "SplitMetadata", "build_split", "in_seq_block_sizes", "split_from_blocks"]


# ---- builders ----------------------------------------------------------------------------


def in_seq_block_sizes(length: int, cp_size: int) -> tuple[int, ...]:
    """Token-balanced zigzag blocks: ``2 * cp_size`` sizes summing to ``length``, remainder first."""
    if cp_size < 1:
        raise ConfigError(f"cp_size={cp_size}: need at least one rank")
    if length < 0:
        raise ConfigError(f"extend length {length} is negative")
    base, remainder = divmod(length, 2 * cp_size)
    return tuple(base + 1 if b < remainder else base for b in range(2 * cp_size))


def _check_batch(cp_size: int, extend_lens: Sequence[int], prefix_lens: Sequence[int], page_size: int) -> None:
    if cp_size < 1:
        raise ConfigError(f"cp_size={cp_size}: need at least one rank")
    if page_size < 1 or page_size & (page_size - 1):
        raise ConfigError(f"page_size={page_size}: must be a power of two >= 1")
    if not extend_lens:
        raise ConfigError("empty batch: a split needs at least one request")
    if len(prefix_lens) != len(extend_lens):
        raise ConfigError(f"{len(prefix_lens)} prefix lengths for {len(extend_lens)} requests")
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        if e <= 0 or p < 0:
            raise ConfigError(f"request {i} prefix={p} extend={e}: need prefix >= 0 and extend >= 1")


SPLIT_BYTES_PER_TOKEN = 256  # host bytes per extend token of the metadata (tuples of Python ints, indices)


def _int_tuple(name: str, values: object) -> tuple[int, ...]:
    """``values`` as a tuple of ints; a bare int, a string, a float or a bool is refused by name."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        hint = f" (e.g. [{values}])" if isinstance(values, int) and not isinstance(values, bool) else ""
        raise ConfigError(f"{name}={values!r}: need a list of ints, one per request{hint}")
    bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise ConfigError(f"{name}={list(values)!r}: {bad[0]!r} is not an int")
    return tuple(values)


def _check_size(cp_size: int, extend_lens: Sequence[int], prefix_lens: Sequence[int]) -> None:
    """Sizes refused by arithmetic before anything proportional to them is built: a batch's tokens
    within int32 rows (:data:`~reference_impl.config.MAX_BATCH_TOKENS`), its metadata within the
    host's available memory."""
    tokens = sum(extend_lens) + sum(prefix_lens)
    if tokens > MAX_BATCH_TOKENS:
        raise ConfigError(
            f"the batch holds {tokens:,} tokens (prefix + extend): at most {MAX_BATCH_TOKENS:,} (2**31 - 1), "
            "because top-k indices are int32 rows of the batch's full view"
        )
    need, free = (sum(extend_lens) + 2 * cp_size) * SPLIT_BYTES_PER_TOKEN, available_host_bytes()
    if free is not None and need > free:
        raise ConfigError(
            f"the split of {sum(extend_lens):,} extend tokens needs about {need / 2**30:,.1f} GiB of host "
            f"memory for its metadata, which has {free / 2**30:,.1f} GiB available"
        )


def split_from_blocks(
    cp_size: int,
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    block_sizes: Sequence[Sequence[int]],
    *,
    page_size: int = DEFAULT_PAGE_SIZE,
    page_aligned: bool = False,
) -> SplitMetadata:
    """Zigzag metadata from explicit per-request block sizes (``2 * cp_size`` each, summing to extend).

    The in-seq builders differ only in how they cut blocks; this assembles the rest. Refuses a
    split that leaves a rank without tokens (an all-gather participant must send something).
    """
    _check_batch(cp_size, extend_lens, prefix_lens, page_size)
    n_blocks = 2 * cp_size
    if len(block_sizes) != len(extend_lens):
        raise ConfigError(f"{len(block_sizes)} block-size lists for {len(extend_lens)} requests")
    for i, (sizes, e) in enumerate(zip(block_sizes, extend_lens)):
        if len(sizes) != n_blocks or min(sizes) < 0 or sum(sizes) != e:
            raise ConfigError(f"request {i}: block sizes {list(sizes)} are not {n_blocks} sizes >= 0 summing to {e}")
    offsets = tuple(itertools.accumulate(extend_lens, initial=0))
    block_starts = [tuple(itertools.accumulate(sizes, initial=0)) for sizes in block_sizes]

    rank_tokens: list[tuple[int, ...]] = []
    rank_segments: list[tuple[Segment, ...]] = []
    for rank in range(cp_size):
        tokens: list[int] = []
        segments: list[Segment] = []
        halves: tuple[tuple[Half, int], ...] = (("prev", rank), ("next", n_blocks - 1 - rank))
        for half, block in halves:
            for i, prefix in enumerate(prefix_lens):
                start, stop = block_starts[i][block], block_starts[i][block + 1]
                if stop == start:
                    continue
                segments.append(Segment(i, half, len(tokens), stop - start, prefix + start, prefix + stop))
                tokens.extend(range(offsets[i] + start, offsets[i] + stop))
        if not tokens:
            raise ConfigError(f"in-seq split leaves rank {rank} of cp_size={cp_size} without tokens")
        rank_tokens.append(tuple(tokens))
        rank_segments.append(tuple(segments))
    return SplitMetadata(
        mode="in-seq",
        cp_size=cp_size,
        page_size=page_size,
        prefix_lens=tuple(prefix_lens),
        extend_lens=tuple(extend_lens),
        block_sizes=tuple(tuple(s) for s in block_sizes),
        rank_tokens=tuple(rank_tokens),
        segments=tuple(rank_segments),
        page_aligned=page_aligned,
    )


def _round_robin(cp_size: int, extend_lens: Sequence[int], prefix_lens: Sequence[int], page_size: int) -> SplitMetadata:
    token_request = [i for i, n in enumerate(extend_lens) for _ in range(n)]
    offsets = tuple(itertools.accumulate(extend_lens, initial=0))
    per_rank: list[list[int]] = [[] for _ in range(cp_size)]
    for i, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens)):
        for j in range(extend):
            per_rank[(prefix + j) % cp_size].append(offsets[i] + j)
    rank_tokens = tuple(tuple(tokens) for tokens in per_rank)
    rank_segments: list[tuple[Segment, ...]] = []
    for tokens in rank_tokens:
        segments: list[Segment] = []
        for k, g in enumerate(tokens):
            i = token_request[g]
            pos = prefix_lens[i] + g - offsets[i]
            last = segments[-1] if segments else None
            if last is not None and last.request == i and last.kv_len == pos:
                segments[-1] = Segment(i, "rr", last.local_start, last.length + 1, last.q_abs_start, pos + 1)
            else:
                segments.append(Segment(i, "rr", k, 1, pos, pos + 1))
        rank_segments.append(tuple(segments))
    return SplitMetadata(
        mode="round-robin",
        cp_size=cp_size,
        page_size=page_size,
        prefix_lens=tuple(prefix_lens),
        extend_lens=tuple(extend_lens),
        block_sizes=(),
        rank_tokens=rank_tokens,
        segments=tuple(rank_segments),
        page_aligned=False,
    )


def _round_robin_idle(cp_size: int, idle: object) -> str:
    return (
        f"cp_size={cp_size} is larger than the tokens allow: round-robin puts position t on rank t % {cp_size}, "
        f"and this batch's extend positions leave rank(s) {idle} without a token (a request of at least "
        f"{cp_size} new tokens covers every rank)"
    )


def build_split(
    mode: str,
    cp_size: int,
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int] | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    *,
    page_aligned: bool = False,
) -> SplitMetadata:
    """The split of a batch (``prefix_lens`` default to zeros); see the module docstring.

    ``mode`` is ``"in-seq"`` or ``"round-robin"``; ``page_aligned=True`` (phase 4, in-seq only)
    cuts the zigzag blocks on absolute page boundaries (:mod:`reference_impl.cp.page_aligned`).
    """
    extend_lens = _int_tuple("extend_lens", extend_lens)
    prefix_lens = (0,) * len(extend_lens) if prefix_lens is None else _int_tuple("prefix_lens", prefix_lens)
    if not isinstance(mode, str) or mode not in SPLIT_MODES:
        raise ConfigError(f"split mode {mode!r}: use 'in-seq' or 'round-robin'")
    for name, value in (("cp_size", cp_size), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}: need an int, got {type(value).__name__}")
    if not isinstance(page_aligned, bool):
        raise ConfigError(f"page_aligned={page_aligned!r}: need a bool, got {type(page_aligned).__name__}")
    _check_batch(cp_size, extend_lens, prefix_lens, page_size)
    if mode == "round-robin":
        if page_aligned:
            raise ConfigError("a page-aligned split is an in-seq split: use mode 'in-seq'")
        if cp_size > sum(extend_lens):  # idle ranks, found without building a list per rank
            covered = {(p + j) % cp_size for p, e in zip(prefix_lens, extend_lens) for j in range(e)}
            idle = [r for r in range(cp_size) if r not in covered] if cp_size <= 4096 else f"{cp_size - len(covered):,}"
            raise ConfigError(_round_robin_idle(cp_size, idle))
        _check_size(cp_size, extend_lens, prefix_lens)
        meta = _round_robin(cp_size, extend_lens, prefix_lens, page_size)
        idle = [r for r, tokens in enumerate(meta.rank_tokens) if not tokens]
        if idle:
            raise ConfigError(_round_robin_idle(cp_size, idle))
        return meta
    longest = max(extend_lens)
    if longest < cp_size:
        raise ConfigError(
            f"cp_size={cp_size} is larger than the tokens allow: in-seq split needs at least {cp_size} "
            f"extend tokens in the longest request (longest has {longest})"
        )
    _check_size(cp_size, extend_lens, prefix_lens)
    if page_aligned:
        from reference_impl.cp.page_aligned import page_aligned_blocks

        blocks, aligned = page_aligned_blocks(cp_size, extend_lens, prefix_lens, page_size)
        return split_from_blocks(cp_size, extend_lens, prefix_lens, blocks, page_size=page_size, page_aligned=aligned)
    blocks = [in_seq_block_sizes(e, cp_size) for e in extend_lens]
    return split_from_blocks(cp_size, extend_lens, prefix_lens, blocks, page_size=page_size, page_aligned=False)

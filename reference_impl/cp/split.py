"""CP split metadata: which extend tokens each rank computes, in which order, and the rerange.

Two split modes (BRIEF section 3), both reproducing SGLang's published semantics:

* ``in-seq`` (zigzag): each request's ``L`` extend tokens are cut into ``2C`` contiguous blocks of
  ``L // 2C`` tokens, the ``L % 2C`` remainder going one token each to the *first* blocks. Rank
  ``r`` computes block ``r`` ("prev") and block ``2C-1-r`` ("next"), which balances causal work.
  A rank's local order is all its prev blocks (request 0, 1, ...) then all its next blocks.
  Example: ``L=19, C=4`` gives blocks ``[3,3,3,2,2,2,2,2]`` and rank 0 owns tokens ``[0,1,2,17,18]``.
* ``round-robin``: over the flattened batch, token ``t`` goes to rank ``t % C``; local order is
  increasing ``t``.

Index spaces used throughout:

* **global token index** ``g``: index into the concatenation of all requests' extend tokens
  (request 0's extend tokens, then request 1's, ...). Token ``j`` of request ``i`` has
  ``g = request_token_offsets[i] + j`` and absolute position ``prefix_lens[i] + j``.
* **local index**: position in one rank's local order (``rank_tokens[r][k]`` is its global index).
* **rank-major row**: row of the unpadded all-gather result (rank 0's local tokens, then rank 1's,
  ...). ``gathered[rerange_index]`` is in sequence order; ``gather_position`` is the inverse.
* **padded row**: row of the padded all-gather result, where every rank sends ``max_rank_len``
  rows; rank ``r``'s local ``k`` sits at ``r * max_rank_len + k`` (``padded_rerange_index``).

Everything here is pure integer logic on host; torch appears only in the device index tensors at
the bottom (:class:`SplitIndex`, built once per batch), and torch.distributed not at all.

Extension point for the page-aligned split (phase 4): a builder computes per-request block sizes
its own way and hands them to :func:`split_from_blocks` with ``page_aligned=True``;
:func:`in_seq_block_sizes` is the token-balanced rule this module uses.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from reference_impl.config import ConfigError

if TYPE_CHECKING:
    import torch

Half = Literal["prev", "next", "rr"]
SPLIT_MODES = ("in-seq", "round-robin")
DEFAULT_PAGE_SIZE = 64


@dataclass(frozen=True)
class Segment:
    """A run of a rank's local tokens that are consecutive extend tokens of one request.

    Local rows ``[local_start, local_start + length)`` hold the queries at absolute positions
    ``[q_abs_start, q_abs_start + length)`` of request ``request``. Causal attention for the run
    reads ``kv_len = q_abs_start + length`` keys, prefix included (SGLang's ``kv_len_prev`` /
    ``kv_len_next``; ``length`` is its ``actual_seq_q_prev`` / ``actual_seq_q_next``).
    ``half`` is ``"prev"`` or ``"next"`` for in-seq, ``"rr"`` for round-robin.
    """

    request: int
    half: Half
    local_start: int
    length: int
    q_abs_start: int
    kv_len: int

    @property
    def local_stop(self) -> int:
        return self.local_start + self.length

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SplitMetadata:
    """The split of one prefill batch over ``cp_size`` ranks; identical on every rank.

    ``segments[r]`` lists rank ``r``'s non-empty runs in local order (they tile ``0..len``):
    in-seq has one ``prev`` then one ``next`` segment per request whose block is non-empty (a
    request shorter than ``2C`` tokens has empty blocks, which are omitted); round-robin has one
    ``rr`` segment per maximal run of consecutive positions of one request, i.e. one per token
    when ``C > 1`` and one per request when ``C == 1``. ``block_sizes`` is ``()`` for round-robin.
    """

    mode: str
    cp_size: int
    page_size: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    block_sizes: tuple[tuple[int, ...], ...]
    rank_tokens: tuple[tuple[int, ...], ...]
    segments: tuple[tuple[Segment, ...], ...]
    page_aligned: bool = False

    # ---- derived, host side --------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self.extend_lens)

    @cached_property
    def request_token_offsets(self) -> tuple[int, ...]:
        """Global index of each request's first extend token."""
        return tuple(itertools.accumulate(self.extend_lens, initial=0))[:-1]

    @property
    def total_tokens(self) -> int:
        return sum(self.extend_lens)

    @cached_property
    def rank_lengths(self) -> tuple[int, ...]:
        return tuple(len(tokens) for tokens in self.rank_tokens)

    @property
    def max_rank_len(self) -> int:
        """Rows every rank sends in the padded all-gather (the longest rank's token count)."""
        return max(self.rank_lengths)

    @cached_property
    def token_request(self) -> tuple[int, ...]:
        """Request id of each global token."""
        return tuple(i for i, n in enumerate(self.extend_lens) for _ in range(n))

    @cached_property
    def token_position(self) -> tuple[int, ...]:
        """Absolute position (``prefix + j``) of each global token."""
        return tuple(p + j for p, n in zip(self.prefix_lens, self.extend_lens) for j in range(n))

    @cached_property
    def gather_position(self) -> tuple[int, ...]:
        """Global token index held by each row of the unpadded rank-major all-gather result."""
        return tuple(itertools.chain.from_iterable(self.rank_tokens))

    @cached_property
    def rerange_index(self) -> tuple[int, ...]:
        """Row of the unpadded rank-major tensor holding global token ``g``: ``gathered[rerange_index]``."""
        index = [0] * self.total_tokens
        for row, g in enumerate(self.gather_position):
            index[g] = row
        return tuple(index)

    @cached_property
    def padded_rerange_index(self) -> tuple[int, ...]:
        """Like :attr:`rerange_index` but into the padded all-gather result (``C * max_rank_len`` rows)."""
        index = [0] * self.total_tokens
        for rank, tokens in enumerate(self.rank_tokens):
            base = rank * self.max_rank_len
            for k, g in enumerate(tokens):
                index[g] = base + k
        return tuple(index)

    @cached_property
    def rank_pages(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per rank, the sorted ``(request, logical page)`` pairs its tokens touch.

        Pages are per request: ``page = (prefix + j) // page_size`` within that request's sequence.
        """
        per_rank = []
        for segs in self.segments:
            pages = {
                (s.request, page)
                for s in segs
                for page in range(s.q_abs_start // self.page_size, (s.kv_len - 1) // self.page_size + 1)
            }
            per_rank.append(tuple(sorted(pages)))
        return tuple(per_rank)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp_size:
            raise ConfigError(f"rank={rank} is out of range for cp_size={self.cp_size}")

    def local_tokens(self, rank: int) -> tuple[int, ...]:
        """Global token indices rank ``rank`` computes, in its local order."""
        self._check_rank(rank)
        return self.rank_tokens[rank]

    def local_positions(self, rank: int) -> tuple[int, ...]:
        """Absolute positions of rank ``rank``'s local tokens, in local order."""
        self._check_rank(rank)
        return tuple(self.token_position[g] for g in self.rank_tokens[rank])

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON view (what ``python -m reference_impl split --json`` prints)."""
        return {
            "mode": self.mode,
            "cp_size": self.cp_size,
            "page_size": self.page_size,
            "page_aligned": self.page_aligned,
            "total_tokens": self.total_tokens,
            "max_rank_len": self.max_rank_len,
            "requests": [
                {"prefix": p, "extend": e, "block_sizes": list(self.block_sizes[i]) if self.block_sizes else []}
                for i, (p, e) in enumerate(zip(self.prefix_lens, self.extend_lens))
            ],
            "ranks": [
                {
                    "rank": r,
                    "tokens": list(self.rank_tokens[r]),
                    "positions": list(self.local_positions(r)),
                    "length": self.rank_lengths[r],
                    "segments": [s.to_json() for s in self.segments[r]],
                    "pages": [list(p) for p in self.rank_pages[r]],
                }
                for r in range(self.cp_size)
            ],
            "rerange_index": list(self.rerange_index),
        }


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
    rank_tokens = tuple(tuple(range(rank, offsets[-1], cp_size)) for rank in range(cp_size))
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
    extend_lens = tuple(int(e) for e in extend_lens)
    prefix_lens = (0,) * len(extend_lens) if prefix_lens is None else tuple(int(p) for p in prefix_lens)
    if mode not in SPLIT_MODES:
        raise ConfigError(f"split mode {mode!r}: use 'in-seq' or 'round-robin'")
    _check_batch(cp_size, extend_lens, prefix_lens, page_size)
    if mode == "round-robin":
        if page_aligned:
            raise ConfigError("a page-aligned split is an in-seq split: use mode 'in-seq'")
        if sum(extend_lens) < cp_size:
            raise ConfigError(
                f"cp_size={cp_size} is larger than the tokens allow: round-robin split needs at least "
                f"{cp_size} extend tokens in the batch (batch has {sum(extend_lens)})"
            )
        return _round_robin(cp_size, extend_lens, prefix_lens, page_size)
    longest = max(extend_lens)
    if longest < cp_size:
        raise ConfigError(
            f"cp_size={cp_size} is larger than the tokens allow: in-seq split needs at least {cp_size} "
            f"extend tokens in the longest request (longest has {longest})"
        )
    if page_aligned:
        from reference_impl.cp.page_aligned import page_aligned_blocks

        blocks, aligned = page_aligned_blocks(cp_size, extend_lens, prefix_lens, page_size)
        return split_from_blocks(cp_size, extend_lens, prefix_lens, blocks, page_size=page_size, page_aligned=aligned)
    blocks = [in_seq_block_sizes(e, cp_size) for e in extend_lens]
    return split_from_blocks(cp_size, extend_lens, prefix_lens, blocks, page_size=page_size, page_aligned=False)


# ---- device index tensors (built once per batch, before the layer loop) --------------------


def local_index_tensor(meta: SplitMetadata, rank: int, device: Any = "cpu") -> torch.Tensor:
    """``int64 [rank_lengths[rank]]``: global indices of ``rank``'s tokens, so ``local = full[idx]``.

    Built from host metadata (a host-to-device copy on a GPU): build it once per batch, outside
    the layer loop.
    """
    import torch

    return torch.tensor(meta.local_tokens(rank), dtype=torch.long, device=device)


def rerange_tensor(meta: SplitMetadata, device: Any = "cpu", *, padded: bool = False) -> torch.Tensor:
    """``int64 [total_tokens]``: ``gathered[idx]`` is sequence order.

    ``padded=False`` indexes the trimmed rank-major tensor (``total_tokens`` rows); ``padded=True``
    indexes the raw padded all-gather output (``cp_size * max_rank_len`` rows), skipping the trim.
    Built from host metadata: once per batch, outside the layer loop.
    """
    import torch

    values = meta.padded_rerange_index if padded else meta.rerange_index
    return torch.tensor(values, dtype=torch.long, device=device)


@dataclass(frozen=True)
class SplitIndex:
    """One rank's split as device tensors, built once per batch so the layer loop copies nothing
    from the host (phase 6's invariant holds at every level)."""

    rank_lengths: tuple[int, ...]  # rows each rank sends in the all-gathers
    local: torch.Tensor  # int64 [n_local]: global indices of this rank's tokens
    rerange: torch.Tensor  # int64 [T]: trimmed rank-major row of each global token
    padded_rerange: torch.Tensor  # int64 [T]: padded all-gather row of each global token

    @classmethod
    def build(cls, meta: SplitMetadata, rank: int, device: Any = "cpu") -> "SplitIndex":
        return cls(
            meta.rank_lengths,
            local_index_tensor(meta, rank, device),
            rerange_tensor(meta, device),
            rerange_tensor(meta, device, padded=True),
        )

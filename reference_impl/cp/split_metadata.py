"""The split of one prefill batch over the CP ranks, as data: :class:`SplitMetadata` and its
:class:`Segment` runs (the builders are in :mod:`reference_impl.cp.split`; the index spaces are
described there). Pure host integers: no torch.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from reference_impl.config import ConfigError

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

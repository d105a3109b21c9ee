"""All-gather #2 (the tail): bring final hidden states back into sequence order for the logits.

After the last layer each rank holds the hidden states of its own tokens, in its local order. The
baseline gathers **every** token's hidden state (``T x hidden`` per rank) and reranges it into
sequence order; the logits processor then picks the rows it needs. Phase 1
(:mod:`reference_impl.cp.narrow_output`) gathers only those rows.

What downstream needs is a batch-level fact (:class:`OutputSpec`), identical on every rank, so
every rank takes the same branch and issues the same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.cp.comm import CPGroup
from reference_impl.cp.split import SplitMetadata
from reference_impl.cp.split_index import rerange_tensor


@dataclass(frozen=True)
class OutputSpec:
    """What the batch's consumers need from the final hidden states (the same on every rank)."""

    input_logprobs: bool = False  # logits of every token: needs every row
    return_hidden_states: bool = False  # the caller wants every hidden state back
    extra_rows: tuple[int, ...] = ()  # explicit global token rows (e.g. requested logprob positions)

    @property
    def needs_every_row(self) -> bool:
        return self.input_logprobs or self.return_hidden_states

    def rows(self, meta: SplitMetadata) -> tuple[int, ...]:
        """Global token rows the consumers read: each request's last token, then the extra rows."""
        last = tuple(off + n - 1 for off, n in zip(meta.request_token_offsets, meta.extend_lens))
        extra = tuple(r for r in sorted(set(self.extra_rows)) if r not in set(last))
        return last + extra


@dataclass
class TailOutput:
    """Result of the tail collection on one rank."""

    mode: str  # "full" or "narrow"
    row_ids: tuple[int, ...]  # global token rows of ``rows``
    rows: torch.Tensor  # [len(row_ids), hidden] final hidden states of those rows
    all_hidden: torch.Tensor | None  # [T, hidden] sequence order ("full" only)


def collect_full(group: CPGroup, meta: SplitMetadata, x_local: torch.Tensor, spec: OutputSpec) -> TailOutput:
    """Baseline: all-gather every token's hidden state, rerange, then select the needed rows.

    Moves ``max_rank_len x hidden`` per rank (padded); every rank ends with ``[T, hidden]``.
    """
    gathered = group.all_gather_padded(x_local, meta.rank_lengths, tag="tail")
    all_hidden = gathered.index_select(0, rerange_tensor(meta, x_local.device))
    row_ids = tuple(range(meta.total_tokens)) if spec.needs_every_row else spec.rows(meta)
    index = torch.tensor(row_ids, dtype=torch.long, device=x_local.device)
    return TailOutput("full", row_ids, all_hidden.index_select(0, index), all_hidden)

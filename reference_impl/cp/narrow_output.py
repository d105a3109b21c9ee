"""Phase 1: narrow output collection.

The tail all-gather moves only the rows downstream needs (each request's last token for sampling,
plus explicitly requested rows) instead of every token's hidden state: ``T x hidden`` becomes
``n_rows x hidden``. Eligibility is decided per batch from :class:`~reference_impl.cp.tail.OutputSpec`,
which every rank shares, so all ranks issue the same collectives. A batch that needs every row
(input logprobs, hidden-state return) falls back to the full gather.

With the in-seq split every request's last token lies in block ``2C-1``, which rank 0 computes,
so rank 0 sends ``n_req`` rows and the others send padding only (the all-gather is padded to the
largest per-rank count).
"""

from __future__ import annotations

import torch

from reference_impl.cp.comm import CPGroup
from reference_impl.cp.split import SplitMetadata
from reference_impl.cp.tail import OutputSpec, TailOutput, collect_full


def narrow_eligible(spec: OutputSpec) -> bool:
    """Batch-level: True when no consumer needs every row."""
    return not spec.needs_every_row


def rows_per_rank(meta: SplitMetadata, row_ids: tuple[int, ...]) -> list[list[int]]:
    """For each rank, the local indices (into its local order) of the wanted rows it holds."""
    wanted = set(row_ids)
    return [[k for k, g in enumerate(tokens) if g in wanted] for tokens in meta.rank_tokens]


def collect_narrow(group: CPGroup, meta: SplitMetadata, x_local: torch.Tensor, spec: OutputSpec) -> TailOutput:
    """Gather only the wanted rows; fall back to :func:`collect_full` when the batch is ineligible."""
    if not narrow_eligible(spec):
        return collect_full(group, meta, x_local, spec)
    row_ids = spec.rows(meta)
    local = rows_per_rank(meta, row_ids)
    counts = [len(sel) for sel in local]
    mine = torch.tensor(local[group.rank], dtype=torch.long, device=x_local.device)
    gathered = group.all_gather_padded(x_local.index_select(0, mine), counts, tag="tail")  # rank-major
    # Rank-major order of the gathered rows, as global ids; then put them in row_ids order.
    gathered_ids = [meta.rank_tokens[r][k] for r, sel in enumerate(local) for k in sel]
    where = {g: i for i, g in enumerate(gathered_ids)}
    order = torch.tensor([where[g] for g in row_ids], dtype=torch.long, device=x_local.device)
    return TailOutput("narrow", row_ids, gathered.index_select(0, order), None)


def tail_gather_bytes(meta: SplitMetadata, row_bytes: int, spec: OutputSpec, narrow: bool) -> int:
    """Bytes of the tail all-gather buffer every rank holds: ``C x (rows per rank, padded) x row_bytes``.

    The full gather pads to the longest rank's token count; the narrow gather to the largest
    per-rank count of wanted rows. Pure metadata arithmetic: the engine's measured
    ``output_gather_bytes`` must equal it (tested).
    """
    if meta.cp_size == 1:
        return 0  # a single rank gathers nothing
    if narrow and narrow_eligible(spec):
        per_rank = max(len(sel) for sel in rows_per_rank(meta, spec.rows(meta)))
    else:
        per_rank = meta.max_rank_len
    return meta.cp_size * per_rank * row_bytes

"""Chunked prefill: cut each request's extend into chunks that run as consecutive CP batches.

With ``chunk_size = None`` the whole batch is one chunk. Otherwise chunk ``k`` takes, from every
request that still has tokens, its next ``min(chunk_size, remaining)`` extend tokens; its prefix is
the request's original prefix plus every earlier chunk, which the CP ranks themselves stored (so a
later chunk reads history that other ranks own). Token ids below are **run-global**: indices into
the concatenation of all requests' whole extends, the numbering the oracle and the report use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from reference_impl.config import RunConfig


@dataclass(frozen=True)
class Chunk:
    """One CP batch of a chunked prefill."""

    requests: tuple[int, ...]  # original request ids present in this chunk (batch order)
    prefix_lens: tuple[int, ...]  # tokens each already has in the cache
    extend_lens: tuple[int, ...]  # tokens this chunk computes for each
    token_ids: tuple[int, ...]  # run-global id of each chunk token, chunk sequence order
    batch: int = 0  # the batch of ``run.batch_sizes`` it belongs to
    last_of_batch: bool = True  # the batch's last chunk: its finished requests may be freed after it


def chunk_schedule(run: RunConfig) -> list[Chunk]:
    """The run's chunks in execution order: each batch of ``run.batch_sizes`` in turn (one batch by
    default), cut into chunks of at most ``run.chunk_size`` tokens per request (one chunk when None)."""
    extends = [r.extend for r in run.requests]
    offsets = [sum(extends[:i]) for i in range(len(extends))]
    chunks: list[Chunk] = []
    first = 0
    for batch, size in enumerate(run.batches):
        members = range(first, first + size)
        first += size
        step = run.chunk_size or max(extends[i] for i in members)
        done = {i: 0 for i in members}
        batch_chunks = []
        while any(done[i] < extends[i] for i in members):
            ids, prefixes, lens, tokens = [], [], [], []
            for i in members:
                n = min(step, extends[i] - done[i])
                if n <= 0:
                    continue
                ids.append(i)
                prefixes.append(run.requests[i].prefix + done[i])
                lens.append(n)
                tokens.extend(range(offsets[i] + done[i], offsets[i] + done[i] + n))
                done[i] += n
            batch_chunks.append(Chunk(tuple(ids), tuple(prefixes), tuple(lens), tuple(tokens), batch, False))
        batch_chunks[-1] = dataclasses.replace(batch_chunks[-1], last_of_batch=True)
        chunks += batch_chunks
    return chunks


def frees_after_batch(run: RunConfig) -> dict[int, list[int]]:
    """Batch -> the requests whose pages may go once it ends: computed by then, and not shared by a
    request of a later batch (a shared prefix keeps its source's pages until its own batch ends)."""
    last_use = {i: run.batch_of(i) for i in range(len(run.requests))}
    for i, request in enumerate(run.requests):
        if request.shares is not None:
            last_use[request.shares] = max(last_use[request.shares], run.batch_of(i))
    out: dict[int, list[int]] = {}
    for i, batch in last_use.items():
        out.setdefault(batch, []).append(i)
    return out

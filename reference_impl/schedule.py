"""Chunked prefill: cut each request's extend into chunks that run as consecutive CP batches.

With ``chunk_size = None`` the whole batch is one chunk. Otherwise chunk ``k`` takes, from every
request that still has tokens, its next ``min(chunk_size, remaining)`` extend tokens; its prefix is
the request's original prefix plus every earlier chunk, which the CP ranks themselves stored (so a
later chunk reads history that other ranks own). Token ids below are **run-global**: indices into
the concatenation of all requests' whole extends, the numbering the oracle and the report use.
"""

from __future__ import annotations

from dataclasses import dataclass

from reference_impl.config import RunConfig


@dataclass(frozen=True)
class Chunk:
    """One CP batch of a chunked prefill."""

    requests: tuple[int, ...]  # original request ids present in this chunk (batch order)
    prefix_lens: tuple[int, ...]  # tokens each already has in the cache
    extend_lens: tuple[int, ...]  # tokens this chunk computes for each
    token_ids: tuple[int, ...]  # run-global id of each chunk token, chunk sequence order


def chunk_schedule(run: RunConfig) -> list[Chunk]:
    """The run's chunks in execution order (one chunk when ``run.chunk_size`` is None)."""
    extends = [r.extend for r in run.requests]
    offsets = [sum(extends[:i]) for i in range(len(extends))]
    size = run.chunk_size or max(extends)
    done = [0] * len(extends)
    chunks = []
    while any(d < e for d, e in zip(done, extends)):
        ids, prefixes, lens, tokens = [], [], [], []
        for i, req in enumerate(run.requests):
            n = min(size, req.extend - done[i])
            if n <= 0:
                continue
            ids.append(i)
            prefixes.append(req.prefix + done[i])
            lens.append(n)
            tokens.extend(range(offsets[i] + done[i], offsets[i] + done[i] + n))
            done[i] += n
        chunks.append(Chunk(tuple(ids), tuple(prefixes), tuple(lens), tuple(tokens)))
    return chunks

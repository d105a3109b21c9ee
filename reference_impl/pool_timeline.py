"""What a run's page table does across its batches, replayed from the config alone: :func:`pool_timeline`.

The page table (:class:`~reference_impl.engine.RunPool`) decides which pages a request takes by
reference and which cached requests a pool budget (``pool_pages``) evicts. A family whose store keeps
per-request state beside the pages (DeepSeek-V4's compressed entries, window tails and checkpoints;
GLM-5.3's KDA states, pending indexer rows and checkpoints) follows the table through this timeline:

* **a hit** is a request whose source was still in the table when its batch took its pages (the
  table gave it the source's whole prefix pages by reference); the store serves it before it drops
  anything the same batch evicted;
* **a miss** (the source was evicted) recomputes its whole prefix, like a request whose prefix was
  never cached;
* **the residents** at each chunk are the requests the table lists once the chunk has its pages: the
  store drops the state of every other request (the eviction unit is a cached request, as the
  table's LRU evicts it).

Every rank replays the table from the run's config (pure metadata), so every rank drops and serves
the same requests without a collective. What goes with an evicted request is each family's rule
(``docs/deepseek-v4.md`` and ``docs/glm-5.3.md``, "eviction").
"""

from __future__ import annotations

from dataclasses import dataclass

from reference_impl.config import RunConfig
from reference_impl.engine import RunPool, chunk_metadata
from reference_impl.schedule import Chunk, chunk_schedule


@dataclass(frozen=True)
class PoolTimeline:
    """Which requests of each batch hit, and which requests the page table lists at each chunk."""

    hits: dict[int, frozenset[int]]  # batch -> its requests served from their source's cached state
    resident: dict[int, frozenset[int]]  # a chunk's first token (run-global) -> requests listed once it has pages

    def resident_at(self, chunk: Chunk) -> frozenset[int]:
        """The requests the page table lists once ``chunk`` has its pages (a later chunk's pages may evict)."""
        return self.resident[chunk.token_ids[0]]


def pool_timeline(run: RunConfig) -> PoolTimeline:
    """Replay the run's page table (:func:`~reference_impl.engine.replay_pool`'s steps) -> its :class:`PoolTimeline`."""
    pool = RunPool(run)
    table = pool.table
    hits: dict[int, frozenset[int]] = {}
    resident: dict[int, frozenset[int]] = {}
    chunks = chunk_schedule(run)
    for index, chunk in enumerate(chunks):
        first_of_batch = index == 0 or chunks[index - 1].batch != chunk.batch
        pool.build(chunk, chunk_metadata(run, chunk), "cpu", table.allocator.n_pages, first_of_batch)
        if first_of_batch:
            hits[chunk.batch] = frozenset(
                req for req in chunk.requests if run.requests[req].shares is not None and table.started_by_sharing(req)
            )
        resident[chunk.token_ids[0]] = frozenset(int(req) for req in table.requests)  # type: ignore[call-overload]
        pool.release(pool.leaving(chunk))
    return PoolTimeline(hits, resident)

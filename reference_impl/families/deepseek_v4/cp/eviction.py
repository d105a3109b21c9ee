"""What a DeepSeek-V4 store keeps across the batches of a run, from the page table's replay.

The page table (:class:`~reference_impl.engine.RunPool`) decides which pages a request takes by
reference and which cached requests a pool budget (``pool_pages``) evicts; the V4 store holds, per
request, the state that belongs to those pages (CSA and HCA entries, indexer keys, the window tail,
the compressor state and the checkpoints kept for later hits). The store follows the table:

* **the eviction unit** is a cached request, as the table's LRU evicts it: its pages that no other
  request holds go back, and the store drops *all* its state with them -- every entry (an entry whose
  block straddles pages goes with the request, whichever of its pages another request still holds),
  its window tail and compressor state, and every checkpoint it kept for a later hit;
* **a hit** is a request whose source was still in the table when its pages were taken (the table
  gave it the source's whole prefix pages by reference): the store serves it by the hit rules of
  :mod:`~.store` before it drops anything the same batch evicted (the copy of the partial page's
  entries and of the checkpoint happens at the hit, before the pages go back);
* **a miss** -- the source was evicted -- recomputes its whole prefix, like a request whose prefix
  was never cached; it is never truncated to the part of the source's pages another request still
  holds: a hit at ``Q`` needs the window tail and the carried rows at ``Q``, and a request keeps
  them only at the hit points the run names (:func:`~.store.hit_points`).

Every rank replays the table from the run's config alone (pure metadata; the replay,
:func:`~reference_impl.families.deepseek_v4.family.pool_timeline`, runs the engine's page table), so
every rank drops and serves the same requests without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the schedule sits above the CP layer
    from reference_impl.schedule import Chunk


@dataclass(frozen=True)
class PoolTimeline:
    """Which requests of each batch hit, and which requests the page table lists at each chunk."""

    hits: dict[int, frozenset[int]]  # batch -> its requests served from their source's cached state
    resident: dict[int, frozenset[int]]  # a chunk's first token (run-global) -> requests listed once it has pages

    def resident_at(self, chunk: Chunk) -> frozenset[int]:
        """The requests the page table lists once ``chunk`` has its pages (a later chunk's pages may evict)."""
        return self.resident[chunk.token_ids[0]]

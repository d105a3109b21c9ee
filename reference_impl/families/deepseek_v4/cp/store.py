"""A rank's V4 cache for one run: what is sharded at rest, what stays replicated, and the full view.

Per layer and request the store holds:

* **CSA entries and their indexer keys** -- the part that grows with the context (one 584 + 68
  byte pair per 4 tokens, 167 MB per layer at 1M tokens). Replicated at the baseline; **sharded at
  rest** with phase 2: entry ``w`` of a request is owned by the owner of the logical slot of its
  token ``4 w`` (:class:`~reference_impl.cp.ownership.Ownership`: the page interleave of the
  in-seq split, so an entry lives with the page of its tokens, or interleave 1 for round-robin);
* **HCA entries** -- one per 128 tokens (4.8 MB per layer at 1M): replicated, so HCA layers never
  materialize;
* the **window tail** (the last ``window - 1`` raw entries) and the **compressor state** (the
  pre-pool rows of the incomplete windows: at most 7 tokens on CSA, 127 on HCA): replicated, small
  and needed by whichever rank computes the next tokens.

The **entry view** of a layer is every chunk request's entries in entry order, concatenated: with
sharded entries it is materialized by one all-gather of the owned entries (all of them with phase
2, only the history with phase 3, the current chunk's coming from the entry all-gather).

**A long-lived store and prefix hits.** The store lives across the batches of a run (``--batches``);
a request ``rN:P+E`` of a later batch *hits* the first ``P`` tokens of request ``N``, which an
earlier batch computed. The page table gives it ``N``'s whole pages of the prefix by reference and
fresh pages for the rest (the prefix's partial page and everything after). The rules:

* **what a hit stores** -- per layer, the complete entries of the prefix (``P // 4`` CSA entries
  and keys, ``P // 128`` HCA entries) and a **checkpoint** at ``P``: the window tail there (raw
  entries of tokens ``[P - 127, P)``) and the compressor state there (the float32 pre-pool rows of
  tokens ``[state_start(P, m), P)``: the incomplete block's ``P mod m`` rows, and on CSA the four
  rows of the block before it as well, which the 8-token overlapping window of the next entry
  reads). Neither survives at rest past ``P`` (a request keeps the window tail and the state at its
  own end only), and neither can be rebuilt from the entries (the window's raw rows need each
  layer's input at those tokens, which needs the layer below's window before them: every layer
  over the last ``n_layers * (window - 1)`` tokens would run again). So a
  request whose prefix a later request hits keeps a checkpoint at ``P`` when its computation
  passes ``P`` (:func:`hit_points`, the plan's ``checkpoint_*`` rows: gathered like the state at a
  request's end), or, for ``P`` inside its own cached prefix, when that prefix is installed;
* **what the next request recomputes** -- nothing of the prefix: no prefix token runs through a
  layer again. Its first new entry is the incomplete block's (entry ``P // m``), computed by the
  compute owner of its last token from the checkpoint's carried rows plus the new tokens' rows;
  on CSA, when ``P mod 4 == 0``, the carried rows are the previous block's four (the overlap);
* **where the carried rows live** -- replicated, in every rank's store, as a request's end state
  is: the checkpoint is taken on every rank (the gather sends its rows to every rank), and at the
  hit it becomes the new request's window tail and compressor state on every rank;
* **the sliding-window tail** on a hit -- stored (the checkpoint), never rebuilt; every rank keeps
  a copy (the rank that computes the new request's first tokens may be any);
* **the owner of a shared prefix's entries** -- the owner of the page its tokens sit in, as in a
  single-batch run, never the next request's compute split: entries of the whole shared pages stay
  where the first request left them (the same pages, so the same owner; the next request's ranks
  rebuild them through the materialization like any history); entries of the prefix's partial
  page move to the owners of the fresh page that holds them for the new request (one all-gather
  per CSA layer at the hit, ``v4_hit``); HCA entries are replicated and taken locally (a hit keeps copies,
  never views, of what it takes: its source may be evicted right after);
* **lifetime** -- a request's state goes with its pages: when the page table no longer lists it
  (freed, or evicted by a pool budget: the rules below), or when one of its pages comes back into
  use (the page table frees a page only when its last holder is freed). A hit whose source the same
  batch evicts is served first, as the hit copies the partial page's entries and the checkpoint.

Under a pool budget the store follows the page table's replay
(:func:`~reference_impl.pool_timeline.pool_timeline`):

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, cast

import torch

from reference_impl.config import RunConfig
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.ownership import Ownership
from reference_impl.families.deepseek_v4.cache_layout import index_entry_bytes, main_entry_bytes
from reference_impl.families.deepseek_v4.config import V4ModelConfig
from reference_impl.families.deepseek_v4.model.cache import V4LayerCache
from reference_impl.families.deepseek_v4.model.compressor import state_start

if TYPE_CHECKING:  # the schedule and the page table's replay sit above the CP layer
    from reference_impl.pool_timeline import PoolTimeline
    from reference_impl.schedule import Chunk


@dataclass
class RequestState:
    """One request's cache of one layer on this rank."""

    n_tokens: int
    window: torch.Tensor  # uint8 [<= W - 1, main bytes]: raw entries of its last tokens
    pool: torch.Tensor  # float32 [rows, width]: packed pre-pool rows (kv | score [| index kv | index score])
    ids: torch.Tensor  # int64 [n] entry indices stored here (all of them unless sharded)
    main: torch.Tensor  # uint8 [n, main bytes]
    index: torch.Tensor  # uint8 [n, index bytes] (CSA)
    source: int | None = None  # a hit's: the request whose pages its leading entries share
    referenced: int = 0  # leading rows of main / index in pages shared with ``source`` (counted there)


@dataclass
class Materialization:
    """The all-gather that rebuilds sharded CSA entries ``[0, count[i])`` of each chunk request."""

    counts: list[int]  # per chunk request: entries to rebuild
    send: list[int]  # per chunk request: this rank's stored entries among them (a prefix of its ids)
    lengths: list[int]  # per rank: rows it sends
    rows: torch.Tensor | None  # [sum(counts)] int64 padded-gather row of each rebuilt entry, dense order


@dataclass
class V4Store:
    """The V4 cache of one rank (see the module docstring); ``ownership`` set means sharded CSA entries."""

    cfg: V4ModelConfig
    codec: str
    group: CPGroup
    ownership: Ownership | None = None
    reuse_current: bool = False
    layers: list[dict[int, RequestState]] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)  # run-global ids of the chunk's requests
    locs: dict[int, torch.Tensor] = field(default_factory=dict)  # run-global id -> its logical locs (host)
    materialized_bytes: int = 0
    transient_bytes: int = 0
    paths: set[str] = field(default_factory=set)
    # (run-global request, hit point) -> per layer: (window tail, compressor state) at that point
    checkpoints: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor] | None]] = field(default_factory=dict)
    timeline: PoolTimeline | None = None  # the page table's hits and residents per batch (set at the first)
    hits: frozenset[int] = frozenset()  # the batch's requests served from their source's state (:mod:`.eviction`)
    carry_at_hits: ClassVar[bool] = True  # off: a hit zeroes the carried pre-pool rows (tests show they matter)

    def __post_init__(self) -> None:
        self.layers = [{} for _ in range(self.cfg.n_layers)]
        self.main_bytes = main_entry_bytes(self.codec)
        self.index_bytes_per = index_entry_bytes(self.codec, self.cfg.index_head_dim)

    name = "v4"

    @classmethod
    def for_run(cls, run: RunConfig, batch: BatchLocs, group: CPGroup) -> V4Store:
        """The store a run's phases ask for: CSA entries sharded at the run's interleave with phase 2."""
        cfg = run.model
        assert isinstance(cfg, V4ModelConfig)
        ownership = Ownership(run.cp_size, run.interleave, run.page_size) if run.phases.sharded_kv else None
        store = cls(cfg, run.kv_dtype, group, ownership, reuse_current=run.phases.current_reuse)
        store.bind(batch)
        return store

    def bind(self, batch: BatchLocs) -> None:
        """Serve the next chunk's batch (its logical locs name the requests' token slots)."""
        self.batch = batch

    @property
    def sharded(self) -> bool:
        return self.ownership is not None

    @property
    def store_path(self) -> str:
        return "+".join(sorted(self.paths)) or ("gathered" if self.sharded else "replicated")

    # ---- the chunk's requests -----------------------------------------------------------------

    def begin_chunk(self, request_ids: list[int], request_locs: list[torch.Tensor]) -> None:
        """Serve a chunk of requests ``request_ids`` (run-global) with logical locs ``request_locs`` (host)."""
        self.requests = list(request_ids)
        for req, locs in zip(request_ids, request_locs):
            self.locs[req] = locs.cpu()

    def entry_owner(self, req: int, entries: range | list[int]) -> list[int]:
        """Rank storing each CSA entry of run-global request ``req`` (sharded stores).

        Entry ``w`` takes **entry slot** ``loc(4 w) / 4`` (its tokens' slots, divided by the ratio;
        requests start on a page, so 4 divides it) and the ownership's interleave divided by 4:
        with the page interleave an entry lives with the page of its tokens; with interleave 1
        (round-robin) entries go round the ranks one by one (token ``4 w`` alone would put every
        entry on rank 0 when ``C`` divides 4).
        """
        assert self.ownership is not None
        return entry_owners(self.ownership, self.locs[req], entries)

    def owns(self, layer: int) -> bool:
        """Whether ``layer``'s entries are sharded (CSA layers of a sharded store)."""
        return self.sharded and self.cfg.ratio(layer) == 4

    # ---- prefixes -----------------------------------------------------------------------------

    def install(self, layer: int, req: int, cache: V4LayerCache) -> None:
        """Take what this rank keeps of an already-computed request prefix (the oracle's cache)."""
        w = self.cfg.window_size
        ids = torch.arange(cache.entries.shape[0])
        main, index = cache.entries, cache.index_keys
        if self.owns(layer):
            mine = torch.tensor(self.entry_owner(req, range(len(ids))), dtype=torch.long) == self.group.rank
            ids, main, index = ids[mine], main[mine], index[mine]
        self.layers[layer][req] = RequestState(
            cache.n_tokens, cache.window_tail(w).clone(), pack_pool(cache), ids, main.clone(), index.clone()
        )

    def state(self, layer: int, req: int) -> RequestState:
        """The request's state (an empty one for a request without prefix)."""
        if req not in self.layers[layer]:
            device = self.group.device
            ratio = self.cfg.ratio(layer)
            self.layers[layer][req] = RequestState(
                0,
                torch.empty(0, self.main_bytes, dtype=torch.uint8, device=device),
                torch.empty(0, pool_width(self.cfg, ratio), dtype=torch.float32, device=device),
                torch.empty(0, dtype=torch.long),
                torch.empty(0, self.main_bytes, dtype=torch.uint8, device=device),
                torch.empty(0, self.index_bytes_per if ratio == 4 else 0, dtype=torch.uint8, device=device),
            )
        return self.layers[layer][req]

    # ---- per layer ----------------------------------------------------------------------------

    def set_state(
        self, layer: int, windows: list[torch.Tensor], pools: Sequence[torch.Tensor | None], n_tokens: list[int]
    ) -> None:
        """The chunk requests' new window tails and compressor states (replicated)."""
        for req, window, pool, n in zip(self.requests, windows, pools, n_tokens):
            st = self.state(layer, req)
            st.window, st.n_tokens = window, n
            if pool is not None:
                st.pool = pool

    def set_checkpoints(
        self, layer: int, tails: dict[tuple[int, int], torch.Tensor], pools: dict[tuple[int, int], torch.Tensor]
    ) -> None:
        """Keep the window tails and compressor states the chunk's requests have at their hit points
        (``(chunk request index, position)`` keys; no state on sliding layers)."""
        for (i, q), window in tails.items():
            pool = pools.get((i, q))
            if pool is None:
                pool = torch.empty(0, pool_width(self.cfg, self.cfg.ratio(layer)), device=window.device)
            self._checkpoint(self.requests[i], q)[layer] = (window, pool)

    def _checkpoint(self, req: int, q: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        return self.checkpoints.setdefault((req, q), [None] * self.cfg.n_layers)

    def forget_freed(self, new: dict[int, int]) -> None:
        """Drop every held request whose pages a new request of ``new`` (request -> tokens it shares by
        reference) opens fresh: the page table handed them out again, so their holder was freed."""
        for req, shared in new.items():
            fresh = set((self.locs[req][shared:] // self.batch.page_size).tolist())
            for old in [r for r in self.locs if r not in new]:
                if fresh.intersection((self.locs[old] // self.batch.page_size).tolist()):
                    self.drop(old)

    def keep_only(self, resident: frozenset[int]) -> None:
        """Drop every held request the page table no longer lists (freed, or evicted by a pool budget),
        whether or not its pages were handed out again (:mod:`~.eviction`)."""
        for old in [r for r in self.locs if r not in resident]:
            self.drop(old)

    def drop(self, old: int) -> None:
        """Let request ``old`` go with its pages: its entries, keys, window tail, compressor state and
        every checkpoint it kept (a hit that took its shared pages keeps its own copy of their entries)."""
        self.locs.pop(old, None)
        for states in self.layers:
            states.pop(old, None)
            for st in states.values():
                if st.source == old:  # its shared pages' entries are now counted with it
                    st.source, st.referenced = None, 0
        for key in [key for key in self.checkpoints if key[0] == old]:
            del self.checkpoints[key]

    def install_hit(self, req: int, source: int, n_tokens: int, shared_tokens: int) -> None:
        """Serve request ``req``'s first ``n_tokens`` tokens from ``source``'s cache (the module docstring's
        rules): its complete entries, and the window tail and compressor state of the checkpoint at
        ``n_tokens``; ``shared_tokens``: the leading tokens in pages ``req`` took by reference."""
        if any(source not in states for states in self.layers):
            raise AssertionError(
                f"request {req} hits request {source}, whose state this store dropped with its pages: the page "
                "table and the store disagree on what is cached (a stale hit is never served)"
            )
        checkpoint = self.checkpoints.get((source, n_tokens))
        if checkpoint is None or any(part is None for part in checkpoint):
            raise AssertionError(f"request {source} kept no checkpoint at {n_tokens} for request {req}")
        for layer in range(self.cfg.n_layers):
            # Copies, never views: the source may be evicted right after (its memory handed out again), and
            # nothing the hit keeps may read it then; a deployed pool copies the partial page's rows likewise.
            window, pool = (part.clone() for part in checkpoint[layer])  # type: ignore[union-attr]
            m = self.cfg.ratio(layer)
            if not self.carry_at_hits:
                pool = torch.zeros_like(pool)
            src = self.state(layer, source)
            n = n_tokens // m if m else 0
            if not self.owns(layer):
                ids, main, index = torch.arange(n), src.main[:n].clone(), src.index[:n].clone()
                referenced = shared_tokens // m if m else 0
            else:
                ids, main, index = self._hit_entries(req, source, src, n, shared_tokens // 4)
                referenced = int((ids < shared_tokens // 4).sum())
            self.layers[layer][req] = RequestState(n_tokens, window, pool, ids, main, index, source, referenced)

    def _hit_entries(
        self, req: int, source: int, src: RequestState, n: int, by_reference: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sharded CSA layer's entries ``[0, n)`` for ``req``: those of the whole shared pages
        (``[0, by_reference)``) where they are, the rest moved from ``source``'s owners to ``req``'s."""
        rank = self.group.rank
        kept = src.ids < by_reference
        moved = range(by_reference, n)
        senders = self.entry_owner(source, moved)
        lengths = [senders.count(r) for r in range(self.group.size)]
        mine = (src.ids >= by_reference) & (src.ids < n)
        packed = torch.cat([src.main[mine.to(src.main.device)], src.index[mine.to(src.main.device)]], dim=1)
        raw = self.group.all_gather_rows_padded_raw(packed, lengths, "v4_hit")
        width, seen, rows = max(1, max(lengths)), [0] * self.group.size, []
        for sender in senders:
            rows.append(sender * width + seen[sender])
            seen[sender] += 1
        receivers = self.entry_owner(req, moved)
        take = [k for k, r in enumerate(receivers) if r == rank]
        flat = raw.reshape(-1, packed.shape[1])
        got = flat.index_select(0, torch.tensor([rows[k] for k in take], dtype=torch.long, device=flat.device))
        self.transient_bytes = max(self.transient_bytes, raw.numel())
        main = torch.cat([src.main[kept.to(src.main.device)], got[:, : self.main_bytes]])
        index = torch.cat([src.index[kept.to(src.main.device)], got[:, self.main_bytes :]])
        ids = torch.cat([src.ids[kept], torch.tensor([by_reference + k for k in take], dtype=torch.long)])
        return ids, main, index

    def prepare(self, new_spans: list[range]) -> None:
        """Before a chunk's layer loop: which of each request's new CSA entries ``new_spans[i]`` this rank
        keeps (host work done once, so the loop reads only device indices)."""
        self.keep: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for req, span in zip(self.requests, new_spans):
            if not self.sharded:
                self.keep.append(None)
                continue
            mine = [k for k, r in enumerate(self.entry_owner(req, span)) if r == self.group.rank]
            self.keep.append(
                (
                    torch.tensor(mine, dtype=torch.long, device=self.group.device),
                    torch.tensor([span.start + k for k in mine], dtype=torch.long),
                )
            )

    def add_entries(
        self, layer: int, new: list[tuple[range, torch.Tensor, torch.Tensor]], selected: bool = False
    ) -> None:
        """Append each chunk request's new entries ``(entry ids, main rows, index rows)`` this rank keeps
        (:meth:`prepare` said which, for sharded CSA layers); ``selected``: the rows are already exactly
        the kept ones (phase 5's direct write of the rank's own entries)."""
        for i, (req, (span, main, index)) in enumerate(zip(self.requests, new)):
            st = self.state(layer, req)
            keep = self.keep[i] if self.owns(layer) else None
            if keep is None:
                ids = torch.arange(span.start, span.stop)
            else:
                rows, ids = keep
                if not selected:
                    main, index = main.index_select(0, rows), index.index_select(0, rows)
            st.ids = torch.cat([st.ids, ids])
            st.main = torch.cat([st.main, main])
            st.index = torch.cat([st.index, index])

    def history(self, layer: int, counts: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per chunk request, its stored entries ``[0, counts[i])`` (replicated layers: every rank has them)."""
        mains, indexes = [], []
        for req, n in zip(self.requests, counts):
            st = self.state(layer, req)
            mains.append(st.main[:n])
            indexes.append(st.index[:n])
        return mains, indexes

    def materialization(self, counts: list[int]) -> Materialization:
        """The gather plan rebuilding sharded CSA entries ``[0, counts[i])`` (host; once per chunk)."""
        c, rank = self.group.size, self.group.rank
        owners = [self.entry_owner(req, range(n)) for req, n in zip(self.requests, counts)]
        lengths = [sum(o.count(r) for o in owners) for r in range(c)]
        width = max(1, max(lengths))
        seen = [0] * c
        rows = []
        for o in owners:
            for r in o:
                rows.append(r * width + seen[r])
                seen[r] += 1
        send = [o.count(rank) for o in owners]
        return Materialization(counts, send, lengths, torch.tensor(rows, dtype=torch.long, device=self.group.device))

    def materialize(
        self, layer: int, plan: Materialization, tag: str = "materialize"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather the owned entries of ``plan`` -> dense ``(main [sum counts, B], index [sum counts, Bi])``."""
        mains, indexes = [], []
        for req, n in zip(self.requests, plan.send):
            st = self.state(layer, req)
            mains.append(st.main[:n])
            indexes.append(st.index[:n])
        packed = torch.cat([torch.cat(mains), torch.cat(indexes)], dim=1)
        raw = self.group.all_gather_rows_padded_raw(packed, plan.lengths, tag)
        flat = raw.reshape(-1, packed.shape[1])
        dense = flat.index_select(0, plan.rows) if plan.rows is not None and plan.rows.numel() else flat[:0]
        self.materialized_bytes += dense.numel()
        self.transient_bytes = max(self.transient_bytes, raw.numel())
        return dense[:, : self.main_bytes], dense[:, self.main_bytes :]

    # ---- accounting ---------------------------------------------------------------------------

    def _sum(self, what: str, kinds: tuple[int, ...]) -> int:
        total = 0
        for layer, states in enumerate(self.layers):
            if self.cfg.ratio(layer) in kinds:
                for st in states.values():
                    part = getattr(st, what)
                    rows = part.shape[0] - (st.referenced if what in ("main", "index") else 0)
                    total += rows * (part[0].numel() if part.shape[0] else 0) * part.element_size()
        return total

    @property
    def kv_bytes(self) -> int:
        """CSA and HCA entries at rest (the sharded CSA part is ~1/C per rank from phase 2); a hit's entries
        in pages it shares are counted once, with the request that holds them."""
        return self._sum("main", (4, 128))

    @property
    def index_bytes(self) -> int:
        """CSA indexer keys at rest."""
        return self._sum("index", (4,))

    def breakdown(self) -> dict[str, int]:
        """Bytes at rest by part: CSA entries and keys, HCA entries, window tails, compressor states."""
        return {
            "csa_bytes": self._sum("main", (4,)) + self._sum("index", (4,)),
            "hca_bytes": self._sum("main", (128,)),
            "window_bytes": self._sum("window", (0, 4, 128)),
            "compressor_state_bytes": self._sum("pool", (4, 128)),
        }

    def stored_rows(
        self, layer: int, request_locs: list[torch.Tensor] | None = None
    ) -> dict[int, tuple[torch.Tensor, ...]]:
        """What this rank holds for ``layer`` per request (run-global id, matched by logical locs):
        ``(n_tokens, window tail, compressor state, entry ids, entries, indexer keys)``."""
        out: dict[int, tuple[torch.Tensor, ...]] = {}
        wanted = request_locs if request_locs is not None else [self.locs[r] for r in self.requests]
        for k, locs in enumerate(wanted):
            req = next(  # the latest holder of those locs (an earlier one was freed)
                r
                for r, held in reversed(self.locs.items())
                if held.numel() == locs.numel() and torch.equal(held, locs.cpu())
            )
            st = self.state(layer, req)
            out[k] = (torch.tensor(st.n_tokens), st.window, st.pool, st.ids, st.main, st.index)
        return out


def entry_owners(own: Ownership, locs: torch.Tensor, entries: range | list[int]) -> list[int]:
    """Rank storing each CSA entry of a request at logical ``locs`` (host): :meth:`V4Store.entry_owner`'s rule."""
    slots = [int(locs[w * 4]) // 4 for w in entries]
    per_run = max(1, own.interleave // 4)
    return [(e // per_run) % own.cp_size for e in slots]


def pool_width(cfg: V4ModelConfig, ratio: int) -> int:
    """Float32 values per packed pre-pool row: kv and score (``2 D`` each on CSA, ``D`` on HCA), plus the
    indexer's (``2 Di`` each) on CSA; 0 on sliding layers."""
    if ratio == 0:
        return 0
    if ratio == 4:
        return 4 * cfg.head_dim + 4 * cfg.index_head_dim
    return 2 * cfg.head_dim


def pack_pool(cache: V4LayerCache) -> torch.Tensor:
    """A cache's compressor state as packed rows ``[kv | score [| index kv | index score]]``."""
    parts = [cache.pool_kv, cache.pool_score]
    if cache.ratio == 4:
        parts += [cache.index_pool_kv, cache.index_pool_score]
    return torch.cat(parts, dim=1).clone()


@torch.no_grad()
def install_v4_prefixes(
    run: RunConfig, model: torch.nn.Module, inputs: list[torch.Tensor], store: V4Store, chunk: Chunk
) -> None:
    """Fill the store with the prefixes of ``chunk``'s requests, computed as an earlier prefill did:
    every rank runs the single-device oracle over the prefix tokens (identical bytes everywhere)
    and keeps its share."""
    from reference_impl.families.deepseek_v4.model.oracle import V4Model, run_v4_oracle

    v4_model = cast(V4Model, model)  # the family's build_model made it
    requests = list(chunk.requests)
    store.begin_chunk(requests, list(store.batch.request_locs))
    todo = [req for req in requests if run.requests[req].prefix > 0 and req not in store.hits]  # misses too
    if not todo:
        return
    result = run_v4_oracle(
        v4_model, [0] * len(todo), [inputs[req][: run.requests[req].prefix] for req in todo], run.kv_dtype
    )
    for layer, caches in enumerate(result.caches):
        for req, cache in zip(todo, caches):
            store.install(layer, req, cache)
    # Hit points inside an installed prefix: the checkpoint that earlier prefill kept there.
    points = hit_points(run)
    for req in todo:
        for q in sorted(p for p in points.get(req, ()) if p <= run.requests[req].prefix):
            at_q = run_v4_oracle(v4_model, [0], [inputs[req][:q]], run.kv_dtype)
            for layer, (cache,) in enumerate(at_q.caches):
                store._checkpoint(req, q)[layer] = (cache.window_tail(store.cfg.window_size).clone(), pack_pool(cache))


def hit_points(run: RunConfig) -> dict[int, set[int]]:
    """Request -> the positions where a later request hits its prefix (``rN:P+E``: ``P`` of ``N``)."""
    points: dict[int, set[int]] = {}
    for r in run.requests:
        if r.shares is not None:
            points.setdefault(r.shares, set()).add(r.prefix)
    return points


def install_hits(run: RunConfig, store: V4Store, chunk: Chunk, shared_tokens: dict[int, int]) -> None:
    """Serve each of ``chunk``'s requests that starts with an earlier request's prefix from the store
    (:meth:`V4Store.install_hit`); every rank calls it alike (moving entries is a collective)."""
    for req in chunk.requests:
        source = run.requests[req].shares
        if source is not None and req in store.hits:  # the rest missed (an evicted source): recomputed
            store.install_hit(req, source, run.requests[req].prefix, shared_tokens.get(req, 0))


@torch.no_grad()
def install_synthetic_prefixes(run: RunConfig, store: V4Store, chunk: Chunk, seed: int = 0) -> None:
    """Fill the store with what ``chunk``'s prefixes would leave, from random values of the right
    shapes and codecs (for benchmarks: computing a 1M-token prefix with the oracle takes hours, and
    no timing or byte count depends on the values)."""
    from reference_impl.families.deepseek_v4.cache_layout import encode_index, encode_main

    cfg, device = store.cfg, store.group.device
    requests = list(chunk.requests)
    store.begin_chunk(requests, list(store.batch.request_locs))
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(rows: int, width: int) -> torch.Tensor:
        return torch.randn(rows, width, generator=gen, device=device)

    points = hit_points(run)
    for req in requests:
        n = run.requests[req].prefix
        if n == 0 or req in store.hits:
            continue
        for layer in range(cfg.n_layers):
            m = cfg.ratio(layer)
            entries = n // m if m else 0
            ids = torch.arange(entries)
            main = encode_main(randn(entries, cfg.head_dim), store.codec)
            index = encode_index(randn(entries, cfg.index_head_dim), store.codec) if m == 4 else main[:, :0]
            if store.owns(layer):
                mine = torch.tensor(store.entry_owner(req, range(entries)), dtype=torch.long) == store.group.rank
                ids, main, index = ids[mine], main[mine.to(device)], index[mine.to(device)]
            state_rows = n - state_start(n, m) if m else 0
            store.layers[layer][req] = RequestState(
                n,
                encode_main(randn(min(n, cfg.window_size - 1), cfg.head_dim), store.codec),
                randn(state_rows, pool_width(cfg, m)),
                ids,
                main,
                index,
            )
            for q in sorted(q for q in points.get(req, ()) if q <= n):  # where a later request hits it
                rows = q - state_start(q, m) if m else 0
                tail = encode_main(randn(min(q, cfg.window_size - 1), cfg.head_dim), store.codec)
                store._checkpoint(req, q)[layer] = (tail, randn(rows, pool_width(cfg, m)))

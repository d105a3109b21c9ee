"""One chunk's GLM-5.3 layer loop on one rank: :class:`Glm53Step`.

**KDA layers: the state handed along the sequence.** A rank holds blocks of each request (the in-seq
split: block ``r`` and block ``2C - 1 - r``, far apart). A block's tokens need the state after every
token before them, which other ranks' blocks produce; the recurrence is affine in the state, so:

1. *halo*: each rank all-gathers the last ``conv - 1`` convolution input rows of each of its blocks
   (tag ``glm53_kda_halo``); a block's halo is the last ``conv - 1`` rows of [the request's cached tail
   (its prefix, or the previous chunk), the earlier blocks' tails] (a block shorter than the halo
   passes its rows through);
2. *maps*: each rank computes its blocks' state maps ``S -> A S + B`` (float32 ``[H, Dk, Dk + Dv]``
   each, ``attn.ops.span_map``: the model's KDA kernel table, Triton on CUDA, else the torch
   :func:`~reference_impl.families.glm53.model.kda.span_map`) and all-gathers them (tag
   ``glm53_kda_state``: ``C x blocks x H x Dk x (Dk + Dv) x 4`` bytes per layer and chunk);
3. *compose*: every rank composes the maps in sequence order from the request's cached state
   (:func:`entering_states`): the state entering each block, and the state after the chunk, which
   every rank keeps (the same bytes everywhere: the cache of the next chunk, and what a decode needs);
4. each rank runs its blocks' recurrence from their entering states (``attn.ops.chunked``) and
   finishes its outputs.

**KDA layers under the round-robin split: a re-split.** Round-robin gives a rank single tokens
(token ``t`` on rank ``t % C``), and a map per token (``Dk x (Dk + Dv)`` floats per head) outweighs the
token many times over. So each KDA layer re-splits its input into contiguous blocks and back:

a. the chunk's normed layer input rows are all-gathered in sequence order (tag ``glm53_kda_resplit``:
   ``dim`` values per token, the narrowest per-token tensor of the layer; the convolution inputs are
   ``3 H Dk`` wide and the gates more again);
b. rank ``r`` takes block ``r`` of ``C`` contiguous blocks of each request's extend
   (:func:`kda_resplit_blocks`; the recurrence costs the same per token, so equal blocks balance it)
   and runs steps 1-4 above on them: the halo, the maps (``C`` per request, not ``2C``), the compose;
c. the blocks' outputs are all-gathered (tag ``glm53_kda_return``) and each rank keeps its round-robin
   tokens' rows.

The halo stays an exchange, though every rank holds the rows it is made of: the convolution tail every
rank keeps must be the same bytes everywhere, and a rank projecting three rows alone may round them
otherwise than the block's owner. The engine's group offers all-gathers only; an all-to-all would bring
a rank just its block's rows (``1/C`` of each gather). Replaying the recurrence on every rank instead
would gather the wider convolution inputs and gates and multiply the layer's work by ``C``.

**Checkpoints at hit points.** A later request ``rN:P+E`` needs request ``N``'s KDA states, convolution tails
and pending indexer rows at ``P``, and ``N`` keeps those at its end only; so ``N`` keeps a checkpoint as its
chunk passes ``P``. On a KDA layer the owner of the block holding token ``P - 1`` maps the block's tokens
before ``P`` and takes the convolution rows before ``P``; one all-gather (tag ``glm53_kda_checkpoint``) brings
them to every rank, which applies the map to the block's entering state (:meth:`Glm53Step._kda_checkpoints`).
On an indexed layer every rank slices the group incomplete at ``P`` from the gathered raw rows (:meth:`_pool`).

**Indexed layers.** The chunk's latent rows and raw indexer rows are all-gathered in sequence order
(tag ``glm53_current``); each rank stores the latent rows it owns and the keys of the groups whose last
token it owns (a group straddling a block, chunk or prefix boundary is completed from the request's
pending rows, once, by that owner); the request's latent rows and group keys are materialized from their
owners (``glm53_kv_view``, ``glm53_index_view``: one all-gather per table and layer for the whole chunk)
and each rank scores, selects and attends for its own queries. A layer sharing its selection reuses the
previous layer's rows.

**The phases here** (levels 0-8; each needs the ones the phase set names):

* 1 (narrow output): the engine's tail; nothing here.
* 2 (sharded at rest): latent rows and group keys on the owner of their loc (:mod:`.store`); each layer
  materializes the request's rows from position 0, after storing the chunk's.
* 3 (current-chunk reuse): the view is the materialized **history** (the rows stored before this chunk)
  followed by the chunk's rows straight from ``glm53_current``, encoded as the table stores them (the
  528-byte FP8 row, or bf16), so the view holds the bytes a materialization would bring and attention
  decodes both alike; every rank pools every group the chunk completes from the gathered raw indexer rows (it needs
  them all to score) and stores the ones it owns. Buys: the materialization drops the chunk's rows and
  keys (``materialized_bytes``); a chunk without history issues no materialization at all. Costs: each
  rank pools ``C`` times the groups it owns (a softmax over 16 rows per group: small).
* 4 (page-aligned split): the engine cuts the blocks on page boundaries; the KDA hand-off and the pooling
  take blocks of any length, so nothing changes here. Buys: the precondition of phase 5.
* 5 (compute-owner layout): the engine allocates each new page in its compute rank's lane, so the owner
  of a latent row is the rank that computes it and the owner of a group key the rank computing the
  group's last token; when every current token of the chunk is so placed
  (:func:`~reference_impl.cp.compute_owner.direct_write_ok`, once per chunk) a rank writes its own
  projected latent rows straight into its table, not its share of the gathered chunk (``store_path``
  ``direct``); otherwise (a prefix or chunk that ends mid-page, a request too short for aligned blocks)
  the chunk takes phase 2's path. Buys: the store write reads the rank's own ``T / C`` rows and depends
  on its projection alone (issued before the all-gather), not on picking rows out of the gathered chunk.
  Group keys still pool from the gathered raw rows: a group's tokens may span several ranks' blocks.
* 6 (sync-free layer loop): the chunk's metadata (request keys, the rows each rank stores, the
  materializations' send and receive rows, each request's query rows; under round-robin, the KDA
  re-split's rows, in ``__init__``) is built from the host locs once, before the loop; the loop reads
  nothing from the device (the API audit counts zero host syncs on a CPU). There is no paged physical
  layout here, so no page remap to make sort-free.
* 7 (fused kernels): the ``glm53_current`` rerange (and round-robin's ``glm53_kda_resplit``) runs from
  the padded buffer in one pass (the shared Triton rerange, dtype-agnostic). No fused store or
  materialization here: the FP8 row is packed by
  :func:`~reference_impl.kvcache.layout.pack_mla` and then copied into the table (DSA's fused store,
  :func:`~reference_impl.cp.fused_ops.fused_store_mla`, packs its own row in the scatter; it is not wired
  to this one), and the materialization is one gather and one reorder.
* 8 (prefix prefetch): an indexed layer's history (latent rows and group keys, tag ``glm53_prefetch``)
  is materialized ahead of it while the KDA layers in between run (:class:`_HistoryPrefetcher`: a
  CUDA side stream, or at once on a CPU), the layer waiting only when it reads it. Buys: the
  materialization off the critical path when the KDA layers take longer than it. Costs: one
  layer's history in flight beside the current one's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from reference_impl.cp.compute_owner import direct_write_ok
from reference_impl.cp.prefetch import CudaSideStream, InlineStream, Stream
from reference_impl.cp.rerange import gather_current
from reference_impl.cp.split import SplitMetadata
from reference_impl.families.base import ChunkInputs
from reference_impl.families.glm53.cp.store import Glm53Store, hit_points
from reference_impl.families.glm53.model.dsa import MLAttention, visible_groups
from reference_impl.families.glm53.model.kda import KDAttention, compose
from reference_impl.families.glm53.model.oracle import Glm53Block, KDACache

PREFETCH_TAG = "glm53_prefetch"  # phase 8's materializations (latent rows and group keys, one layer ahead)
PER_LAYER_TAGS = (
    "glm53_current",
    "glm53_kv_view",
    "glm53_index_view",
    "glm53_kda_halo",
    "glm53_kda_state",
    PREFETCH_TAG,
    "glm53_kda_resplit",
    "glm53_kda_return",
    "glm53_kda_checkpoint",
)
Block = tuple[int, int, int, int]  # request, its first absolute position, length, first row in the rank's rows


def kda_resplit_blocks(meta: SplitMetadata) -> list[list[Block]]:
    """Per rank, its KDA blocks under the round-robin split: block ``r`` of ``C`` contiguous blocks of each
    request's extend (the remainder one token each to the first blocks), rows numbered in request order."""
    out: list[list[Block]] = []
    for rank in range(meta.cp_size):
        blocks, row = [], 0
        for req, (prefix, extend) in enumerate(zip(meta.prefix_lens, meta.extend_lens)):
            base, remainder = divmod(extend, meta.cp_size)
            start = rank * base + min(rank, remainder)
            length = base + (rank < remainder)
            if length:
                blocks.append((req, prefix + start, length, row))
                row += length
        out.append(blocks)
    return out


def block_tokens(meta: SplitMetadata, blocks: list[Block]) -> list[int]:
    """Global token indices (the chunk's extend tokens, request after request) of ``blocks``' rows, in order."""
    offsets = list(itertools.accumulate(meta.extend_lens, initial=0))
    return [offsets[req] + pos - meta.prefix_lens[req] + j for req, pos, length, _ in blocks for j in range(length)]


def entering_states(
    initial: torch.Tensor, maps: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The state entering each block (``maps`` in sequence order) from ``initial``, and the state after the last."""
    states, state = [], initial
    for A, B in maps:
        states.append(state)
        state = compose(state, A, B)
    return states, state


@dataclass(frozen=True)
class _RequestPlan:
    """One chunk request's host ints and device index tensors for the indexed layers, built before the loop."""

    key: int  # the store's request key (run-global)
    points: tuple[int, ...]  # hit points of later requests inside the chunk: ``prefix < P <= prefix + extend``
    rows: slice  # its rows of the chunk's all-gathered current rows (sequence order)
    group_start: int  # the first position of its pending rows (``prefix // kpool * kpool``)
    new_groups: int  # groups its chunk completes (``(prefix + extend) // kpool - prefix // kpool``)
    own_groups: torch.Tensor  # int64: which of them this rank stores (their last token's loc is its own)
    own_group_locs: torch.Tensor  # int64: where (their last token's loc)
    n_own_groups: int
    local: torch.Tensor  # int64: this rank's query rows of the request (local order)
    n_local: int
    positions: torch.Tensor  # int64: those queries' positions


class Glm53Step:
    """See the module docstring."""

    def __init__(self, inputs: ChunkInputs) -> None:
        self.inputs = inputs
        self.store: Glm53Store = inputs.store
        meta, rank = inputs.meta, inputs.group.rank
        self.cfg = inputs.run.model
        # Every rank's KDA blocks (request, its first position, length, first row), in each rank's order.
        self.round_robin = meta.mode == "round-robin"
        if self.round_robin:  # re-split into contiguous blocks (module docstring)
            self.blocks = kda_resplit_blocks(meta)
            rows = [block_tokens(meta, b) for b in self.blocks]
            dev = inputs.group.device
            self.resplit_counts = [len(r) for r in rows]
            self.resplit_rows = torch.tensor(rows[rank], dtype=torch.long, device=dev)
            self.returned_tokens = torch.tensor([g for r in rows for g in r], dtype=torch.long, device=dev)
            self.local_tokens = torch.tensor(meta.local_tokens(rank), dtype=torch.long, device=dev)
        else:
            self.blocks = [
                [(s.request, s.q_abs_start, s.length, s.local_start) for s in meta.segments[r] if s.length]
                for r in range(meta.cp_size)
            ]
        self.mine = self.blocks[rank]
        # Hit points inside the chunk: the block whose tokens end at or pass each (module docstring, checkpoints)
        points = hit_points(inputs.run)
        self.points = [  # (chunk request, P, rank, the block's index in that rank's blocks, tokens of it before P)
            (req, q, r, n, q - pos)
            for r, blocks in enumerate(self.blocks)
            for n, (req, pos, length, _) in enumerate(blocks)
            for q in sorted(points.get(inputs.chunk.requests[req], ()))
            if pos < q <= pos + length
        ]
        self.point_counts = [sum(1 for p in self.points if p[2] == r) for r in range(meta.cp_size)]
        # A later chunk's pages may have evicted a cached request: drop it, and forget rows at locs no request
        # has computed, before the chunk's locs count as computed.
        store = inputs.store
        if store.timeline is not None:
            store.keep_only(store.timeline.resident_at(inputs.chunk))
        store.begin_chunk(inputs.chunk.requests, tuple(self._request_locs(i) for i in range(len(meta.extend_lens))))
        locals_ = meta.local_tokens(rank)
        self.local_request = torch.tensor([meta.token_request[g] for g in locals_], dtype=torch.long)
        self.transient_bytes = 0
        self.shared: torch.Tensor | None = None  # the last indexed layer's selection rows
        self._plan_chunk()

    def _plan_chunk(self) -> None:
        """The chunk's metadata, from the locs alone (the same decisions on every rank): the requests' cache keys,
        what each rank stores and what the views materialize. The chunk's locs are read on the host here,
        once, so that the layer loop reads nothing (phase 6)."""
        i, store, phases = self.inputs, self.store, self.inputs.run.phases
        meta, rank, device, P = i.meta, i.group.rank, i.group.device, self.cfg.index_kpool
        self.fused = phases.fused_kernels  # phase 7: the current rows' rerange in one pass
        self.reuse = phases.current_reuse and store.sharded  # phase 3
        host = [self._request_locs(req).cpu() for req in range(len(i.chunk.extend_lens))]
        extend_locs = torch.cat([locs[p:] for locs, p in zip(host, i.chunk.prefix_lens)])  # sequence order
        locals_ = torch.tensor(meta.local_tokens(rank), dtype=torch.long)
        # Phase 5: every current token's page in its compute rank's lane (a batch-level verdict of the metadata).
        self.direct = phases.compute_owner and store.sharded and direct_write_ok(meta, extend_locs, store.ownership)
        store.direct = self.direct
        if self.direct:  # the rank's own rows, in local order, are exactly the rows it stores
            self.local_locs = extend_locs[locals_].to(device)
        else:  # the rows of the gathered chunk this rank stores
            keep = store.mine(extend_locs)
            self.store_rows = torch.nonzero(keep).flatten().to(device)
            self.store_locs = extend_locs[keep].to(device)
        self.requests: list[_RequestPlan] = []
        latent_want, key_want, start = [], [], 0
        points = hit_points(i.run)
        for req, (prefix, extend) in enumerate(zip(i.chunk.prefix_lens, i.chunk.extend_lens)):
            locs, total = host[req], prefix + extend
            first, last = prefix // P, total // P  # the chunk completes groups first .. last - 1
            ends = locs[P - 1 :: P][:last]  # every complete group's last-token loc
            own = torch.nonzero(store.mine_keys(ends[first:])).flatten()  # the keys' owners, not the tokens'
            local = torch.nonzero(self.local_request == req).flatten()
            self.requests.append(
                _RequestPlan(
                    key=i.chunk.requests[req],
                    points=tuple(sorted(q for q in points.get(i.chunk.requests[req], ()) if prefix < q <= total)),
                    rows=slice(start, start + extend),
                    group_start=first * P,
                    new_groups=last - first,
                    own_groups=own.to(device),
                    own_group_locs=ends[first:][own].to(device),
                    n_own_groups=len(own),
                    local=local.to(device),
                    n_local=len(local),
                    positions=i.positions[local.to(i.positions.device)],
                )
            )
            start += extend
            # The views' materialized part: the history alone with phase 3, everything (after the writes) before.
            latent_want.append(locs[: prefix if self.reuse else total])
            key_want.append(ends[: first if self.reuse else last])
        self.latent_plan = store.row_gather(latent_want)
        self.key_plan = store.row_gather(key_want, keys=True)
        has_history = self.latent_plan.total + self.key_plan.total > 0
        self.prefetcher = (
            _HistoryPrefetcher(self) if phases.prefetch and self.reuse and has_history and store.dsa_layers else None
        )

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    def prefetch_wait_ms(self) -> list[float]:
        return self.prefetcher.stream.wait_ms() if self.prefetcher is not None else []

    def history(self, layer: int, prefetch: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Layer ``layer``'s materialized rows per chunk request: latent rows and (an indexed layer) group keys;
        ``prefetch``: under phase 8's tag."""
        store = self.store
        latent_tag, key_tag = (PREFETCH_TAG, PREFETCH_TAG) if prefetch else ("glm53_kv_view", "glm53_index_view")
        latent = store.latent_rows(layer, self.latent_plan, latent_tag)
        if layer not in store.group_keys:
            return latent, None
        return latent, store.group_key_rows(layer, self.key_plan, key_tag)

    def step(self, layer: int, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block = cast(Glm53Block, block)  # the model's layer ``layer``
        if self.prefetcher is not None:
            self.prefetcher.launch_before(layer)
        h = block.attn_norm(x)
        if isinstance(block.attn, KDAttention):
            out = self._kda(layer, block.attn, h)
            selection = torch.zeros(len(x), 0, dtype=torch.int32, device=x.device)
        else:
            out, selection = self._dsa(layer, block.attn, h)
        if self.inputs.on_layer_stored is not None:  # a PD send: the finished requests' layer is final from here
            self.inputs.on_layer_stored.layer_stored(layer)
        return x + out, selection

    # ---- KDA ------------------------------------------------------------------------------------
    def _request_locs(self, req: int) -> torch.Tensor:
        chunk = self.inputs.chunk
        return self.inputs.batch.request_locs[req][: chunk.prefix_lens[req] + chunk.extend_lens[req]]

    def _kda(self, layer: int, attn: KDAttention, h: torch.Tensor) -> torch.Tensor:
        if not self.round_robin:
            return self._kda_blocks(layer, attn, h)
        group = self.inputs.group
        # sequence order; phase 7 reranges it from the padded buffer in one pass, as the indexed layers' rows
        chunk_rows = gather_current(group, self.inputs.index, h, "glm53_kda_resplit", self.fused, group.debug)
        out = self._kda_blocks(layer, attn, chunk_rows[self.resplit_rows])
        moved = self.transient_bytes + chunk_rows.numel() * chunk_rows.element_size()
        returned = group.all_gather_padded(out, self.resplit_counts, "glm53_kda_return")
        in_order = torch.empty_like(returned)
        in_order[self.returned_tokens] = returned
        self.transient_bytes = moved + returned.numel() * returned.element_size()
        return in_order[self.local_tokens]

    def _kda_blocks(self, layer: int, attn: KDAttention, h: torch.Tensor) -> torch.Tensor:
        """Steps 1-4 of the module docstring on ``self.blocks``; ``h``: this rank's blocks' rows."""
        group, store, H = self.inputs.group, self.store, self.cfg.linear_num_heads
        halo, C = attn.halo, self.cfg.conv_dim
        mixed = attn.mixed(h)
        g, beta = attn.gates(h)
        # 1. the blocks' convolution tails, all-gathered
        tails = mixed.new_zeros(len(self.mine), halo, C)
        for n, (_, _, length, start) in enumerate(self.mine):
            take = min(length, halo)
            tails[n, halo - take :] = mixed[start + length - take : start + length]
        counts = [len(b) for b in self.blocks]
        all_tails = group.all_gather_padded(tails, counts, "glm53_kda_halo")
        flat = [b for r in range(len(self.blocks)) for b in self.blocks[r]]  # rank-major, as gathered
        order: dict[int, list[tuple[int, int]]] = {}  # request -> its blocks' rank-major indices in sequence order
        for i, (req, pos, _, _) in enumerate(flat):
            order.setdefault(req, []).append((pos, i))
        halos: dict[int, torch.Tensor] = {}  # rank-major index -> the block's halo
        for req, items in order.items():
            cache = store.kda_cache_of(layer, self.requests[req].key)
            rows = cache.conv.to(mixed.dtype)
            for _, i in sorted(items):
                halos[i] = rows[-halo:]
                take = min(flat[i][2], halo)
                rows = torch.cat([rows, all_tails[i, halo - take :]])
            new_conv = rows[-halo:].to(cache.conv.dtype)
            cache.conv = new_conv  # every rank: the same rows
        # 2. the blocks' state maps, all-gathered
        first_mine = sum(counts[: group.rank])
        Dk = self.cfg.linear_head_dim
        qkv, maps = [], mixed.new_zeros(len(self.mine), H, Dk, 2 * Dk, dtype=torch.float32)
        for n, (_, _, length, start) in enumerate(self.mine):
            span = slice(start, start + length)
            q, k, v = attn.qkv(attn.conv(mixed[span], halos[first_mine + n]))
            qkv.append((q, k, v))
            A, B = attn.ops.span_map(k, v, g[span], beta[span])  # the model's kernel table (Triton on CUDA)
            maps[n] = torch.cat([A, B], dim=-1)
        all_maps = group.all_gather_padded(maps, counts, "glm53_kda_state")
        # 3. compose in sequence order: the state entering every block, and after the chunk
        entering: dict[int, torch.Tensor] = {}
        for req, items in order.items():
            cache = store.kda_cache_of(layer, self.requests[req].key)
            ids = [i for _, i in sorted(items)]
            states, cache.state = entering_states(
                cache.state, [(all_maps[i, ..., :Dk], all_maps[i, ..., Dk:]) for i in ids]
            )
            entering.update(zip(ids, states))
        if self.points:  # 3b. the state and tail at each hit point inside the chunk (module docstring)
            self._kda_checkpoints(layer, attn, mixed, g, beta, qkv, entering, halos, first_block=counts)
        # 4. this rank's blocks from their entering states
        core = h.new_zeros(len(h), H, Dk, dtype=torch.float32)
        for n, (_, _, length, start) in enumerate(self.mine):
            q, k, v = qkv[n]
            span = slice(start, start + length)
            core[span], _ = attn.ops.chunked(q, k, v, g[span], beta[span], entering[first_mine + n])
        self.transient_bytes = all_maps.numel() * 4 + all_tails.numel() * all_tails.element_size()
        if not len(h):  # a rank with no block of the round-robin re-split (requests shorter than C) joined the gathers
            return h.new_zeros(0, self.cfg.dim)
        return attn.finish(h, core)

    def _kda_checkpoints(
        self,
        layer: int,
        attn: KDAttention,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        entering: dict[int, torch.Tensor],
        halos: dict[int, torch.Tensor],
        first_block: list[int],
    ) -> None:
        """The KDA state and convolution tail at every hit point ``P`` inside the chunk, on every rank: the owner
        of the block holding token ``P - 1`` maps the block's first ``P - pos`` tokens (``S -> A S + B``) and takes
        the convolution rows before ``P``; one all-gather (tag ``glm53_kda_checkpoint``, float32: the rows' dtype
        converts exactly) brings them to every rank, which composes the map onto the block's entering state."""
        group, H, Dk, halo = self.inputs.group, self.cfg.linear_num_heads, self.cfg.linear_head_dim, attn.halo
        C = self.cfg.conv_dim
        width = H * Dk * 2 * Dk
        mine = [p for p in self.points if p[2] == group.rank]
        packed = mixed.new_zeros(len(mine), width + halo * C, dtype=torch.float32)
        for m, (_, _, _, n, before) in enumerate(mine):
            q, k, v = qkv[n]
            start = self.mine[n][3]
            span = slice(start, start + before)
            A, B = attn.ops.span_map(k[:before], v[:before], g[span], beta[span])
            take = min(before, halo)
            tail = mixed.new_zeros(halo, C, dtype=torch.float32)
            tail[halo - take :] = mixed[start + before - take : start + before].float()
            packed[m] = torch.cat([torch.cat([A, B], dim=-1).flatten(), tail.flatten()])
        gathered = group.all_gather_padded(packed, self.point_counts, "glm53_kda_checkpoint")
        offsets = list(itertools.accumulate(first_block, initial=0))
        for m, (req, point, rank, n, before) in enumerate(self.points):
            block = offsets[rank] + n  # the block's rank-major index, as the maps and tails were gathered
            maps = gathered[m, :width].view(H, Dk, 2 * Dk)
            state = compose(entering[block], maps[..., :Dk], maps[..., Dk:])
            take = min(before, halo)
            tail = gathered[m, width:].view(halo, C)[halo - take :].to(mixed.dtype)
            cache = self.store.kda_cache_of(layer, self.requests[req].key)
            conv = torch.cat([halos[block], tail])[-halo:].to(cache.conv.dtype)
            self.store.checkpoint(self.requests[req].key, point)[layer] = KDACache(state, conv)

    # ---- indexed layers -------------------------------------------------------------------------
    def _dsa(self, layer: int, attn: MLAttention, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, store, cfg = self.inputs, self.store, self.cfg
        proj = attn.project(h)
        parts = [proj.latent]
        if proj.index_k is not None:
            assert proj.index_gate is not None  # project() makes the indexer's key and pooling logits together
            parts += [proj.index_k, proj.index_gate]
        # 1. this rank's share of the chunk's latent rows: its own rows (phase 5), before and apart from the
        # all-gather, or its owned rows of the gathered chunk
        if self.direct:
            store.put_latent(layer, self.local_locs, proj.latent)
        current = gather_current(  # sequence order
            i.group, i.index, torch.cat(parts, dim=-1), "glm53_current", self.fused, i.group.debug
        )
        R = cfg.kv_lora_rank
        if not self.direct:
            store.put_latent(layer, self.store_locs, current[:, :R].index_select(0, self.store_rows))
        # 2. the groups the chunk completes: each owner stores its own; with phase 3 every rank pools them all
        new_keys = self._pool(layer, attn, current[:, R:]) if proj.index_k is not None else None
        # 3. the views: materialized (history only with phase 3, prefetched with phase 8) + the current rows
        if self.prefetcher is not None:
            history, history_keys = self.prefetcher.consume(layer)
        else:
            history, history_keys = self.history(layer)
        out = h.new_zeros(len(h), cfg.dim)
        selection = torch.full((len(h), cfg.selection_width), -1, dtype=torch.int32, device=h.device)
        view_bytes = 0
        for req, rp in enumerate(self.requests):
            if not rp.n_local:
                continue
            latent = history[req]  # as stored: FP8 rows as their bytes
            if self.reuse:  # the chunk's rows encoded as the table stores them: what a materialization would bring
                latent = torch.cat([latent, store.stored_form(current[rp.rows, :R])])
            view_bytes += latent.numel() * latent.element_size()
            if proj.index_k is not None:
                assert proj.index_q is not None and proj.index_w is not None and history_keys is not None
                keys = history_keys[req]
                if new_keys is not None:
                    keys = torch.cat([keys, new_keys[req]])
                # the layer's indexer table (the DSA logits and top-k kernels on CUDA), as _kda routes through
                # attn.ops; a query sees a prefix of the request's groups
                visible = visible_groups(rp.positions, cfg.index_kpool, len(keys))
                q_local, w_local = proj.index_q[rp.local], proj.index_w[rp.local]
                scores = attn.ops.scores(q_local, w_local, keys, cfg.index_head_dim, visible)
                rows_sel = attn.ops.select(cfg, scores, rp.positions)
            else:
                assert self.shared is not None, "a layer sharing its selection follows an indexed layer"
                rows_sel = self.shared[rp.local]
            selection[rp.local] = rows_sel
            out[rp.local] = attn.attend(proj.q[rp.local], store.rows.decode(latent), rows_sel)  # decoded once, here
        self.shared = selection
        self.transient_bytes = current.numel() * current.element_size() + view_bytes
        return out, selection

    def _pool(self, layer: int, attn: MLAttention, raw: torch.Tensor) -> list[torch.Tensor] | None:
        """Complete each request's groups with this chunk's raw rows ``raw [T, 2 Di]`` (sequence order): each
        owner stores its own keys. Phase 3: every rank pools every completed group (its view reads them all)
        and returns their keys per request, as stored; before it, a rank pools only its own."""
        store, P, Di = self.store, self.cfg.index_kpool, self.cfg.index_head_dim
        new: list[torch.Tensor] = []
        for rp in self.requests:
            pend_k, pend_g = store.pending_of(layer, rp.key)
            rows = raw[rp.rows]
            keys = torch.cat([pend_k, rows[:, :Di].to(pend_k.dtype)])  # from a group boundary
            gates = torch.cat([pend_g, rows[:, Di:].to(pend_g.dtype)])
            full = rp.new_groups * P
            grouped_k, grouped_g = keys[:full].view(-1, P, Di), gates[:full].view(-1, P, Di)
            if self.reuse:
                pooled = attn.pool(grouped_k, grouped_g)
                if rp.n_own_groups:
                    store.write_group_keys(layer, rp.own_group_locs, pooled.index_select(0, rp.own_groups))
                new.append(store.stored_keys(pooled))
            elif rp.n_own_groups:
                own_k, own_g = grouped_k.index_select(0, rp.own_groups), grouped_g.index_select(0, rp.own_groups)
                store.write_group_keys(layer, rp.own_group_locs, attn.pool(own_k, own_g))
            store.set_pending_of(layer, rp.key, keys[full:], gates[full:])
            for q in rp.points:  # a later request's hit point: the raw rows of its group incomplete there
                a, b = q // P * P - rp.group_start, q - rp.group_start  # ``keys`` starts at a group boundary
                store.checkpoint(rp.key, q)[layer] = (keys[a:b].clone(), gates[a:b].clone())
        return new if self.reuse else None


class _HistoryPrefetcher:
    """Phase 8: materialize an indexed layer's history (latent rows, group keys) ahead of it, on a side stream
    (CUDA) or at once (CPU, :class:`~reference_impl.cp.prefetch.InlineStream`); the layer waits only when it
    reads them. A layer is launched at the start of the layer after the previous indexed layer (so over the
    KDA layers between them), and at the latest one layer ahead; the history was stored before the chunk, so
    it does not depend on the layers in between. Every rank launches at the same layers: the same collectives
    in the same order."""

    def __init__(self, step: Glm53Step) -> None:
        self.step = step
        self.layers = list(step.store.dsa_layers)
        device = step.inputs.group.device
        self.stream: Stream = CudaSideStream(device) if device.type == "cuda" else InlineStream()
        self.results: dict[int, tuple[list[torch.Tensor], list[torch.Tensor] | None]] = {}
        self.handles: dict[int, Any] = {}
        self.next = 0  # index into ``layers`` of the next layer to launch

    def launch_before(self, layer: int) -> None:
        """At the start of ``layer``: launch the indexed layers whose time has come (see the class docstring)."""
        while self.next < len(self.layers):
            target, previous = self.layers[self.next], self.layers[self.next - 1] if self.next else -1
            if not (previous < layer or target <= layer + 1):
                return

            def work(target: int = target) -> None:
                self.results[target] = self.step.history(target, prefetch=True)

            self.handles[target] = self.stream.submit(work, self.next % 2)
            self.next += 1

    def consume(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        self.stream.wait(self.handles.pop(layer))
        latent, keys = self.results.pop(layer)
        if self.step.inputs.group.device.type == "cuda":  # made on the side stream, read on this one
            for t in [*latent, *(keys or [])]:
                t.record_stream(torch.cuda.current_stream())
        self.stream.release(self.layers.index(layer) % 2)
        return latent, keys

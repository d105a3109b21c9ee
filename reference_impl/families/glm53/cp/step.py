"""One chunk's GLM-5.3 layer loop on one rank: :class:`Glm53Step`.

**KDA layers: the state handed along the sequence.** A rank holds blocks of each request (the in-seq
split: block ``r`` and block ``2C - 1 - r``, far apart). A block's tokens need the state after every
token before them, which other ranks' blocks produce; the recurrence is affine in the state, so:

1. *halo*: each rank all-gathers the last ``conv - 1`` convolution input rows of each of its blocks
   (tag ``glm53_kda_halo``); a block's halo is the last ``conv - 1`` rows of [the request's cached tail
   (its prefix, or the previous chunk), the earlier blocks' tails] (a block shorter than the halo
   passes its rows through);
2. *maps*: each rank computes its blocks' state maps ``S -> A S + B`` (float32 ``[H, Dk, Dk + Dv]``
   each, :func:`~reference_impl.families.glm53.model.kda.span_map`) and all-gathers them (tag
   ``glm53_kda_state``: ``C x blocks x H x Dk x (Dk + Dv) x 4`` bytes per layer and chunk);
3. *compose*: every rank composes the maps in sequence order from the request's cached state
   (:func:`entering_states`): the state entering each block, and the state after the chunk, which
   every rank keeps (the same bytes everywhere: the cache of the next chunk, and what a decode needs);
4. each rank runs its blocks' recurrence from their entering states and finishes its outputs.

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

**Indexed layers.** The chunk's latent rows and raw indexer rows are all-gathered in sequence order
(tag ``glm53_current``); each rank stores the latent rows it owns and pools the groups whose last
token it owns (a group straddling a block, chunk or prefix boundary is completed from the request's
pending rows, once, by that owner); the request's latent rows and group keys are all-gathered from
their owners (``glm53_kv_view``, ``glm53_index_view``) and each rank scores, selects and attends for
its own queries. A layer sharing its selection reuses the previous layer's rows.
"""

from __future__ import annotations

import itertools
from typing import cast

import torch
from torch import nn

from reference_impl.cp.rerange import gather_current
from reference_impl.cp.split import SplitMetadata
from reference_impl.families.base import ChunkInputs
from reference_impl.families.glm53.cp.store import Glm53Store
from reference_impl.families.glm53.model.dsa import MLAttention, group_scores, select
from reference_impl.families.glm53.model.kda import KDAttention, compose, kda_chunked, span_map
from reference_impl.families.glm53.model.oracle import Glm53Block

PER_LAYER_TAGS = (
    "glm53_current",
    "glm53_kv_view",
    "glm53_index_view",
    "glm53_kda_halo",
    "glm53_kda_state",
    "glm53_kda_resplit",
    "glm53_kda_return",
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
        locals_ = meta.local_tokens(rank)
        self.local_request = torch.tensor([meta.token_request[g] for g in locals_], dtype=torch.long)
        self.transient_bytes = 0
        self.shared: torch.Tensor | None = None  # the last indexed layer's selection rows

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    def prefetch_wait_ms(self) -> list[float]:
        return []

    def step(self, layer: int, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block = cast(Glm53Block, block)  # the model's layer ``layer``
        h = block.attn_norm(x)
        if isinstance(block.attn, KDAttention):
            out = self._kda(layer, block.attn, h)
            return x + out, torch.zeros(len(x), 0, dtype=torch.int32, device=x.device)
        out, selection = self._dsa(layer, block.attn, h)
        return x + out, selection

    # ---- KDA ------------------------------------------------------------------------------------
    def _request_locs(self, req: int) -> torch.Tensor:
        chunk = self.inputs.chunk
        return self.inputs.batch.request_locs[req][: chunk.prefix_lens[req] + chunk.extend_lens[req]]

    def _kda(self, layer: int, attn: KDAttention, h: torch.Tensor) -> torch.Tensor:
        if not self.round_robin:
            return self._kda_blocks(layer, attn, h)
        group = self.inputs.group
        chunk_rows = gather_current(group, self.inputs.index, h, "glm53_kda_resplit")  # sequence order
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
            cache = store.kda_cache(layer, self._request_locs(req))
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
            A, B = span_map(k, v, g[span], beta[span])
            maps[n] = torch.cat([A, B], dim=-1)
        all_maps = group.all_gather_padded(maps, counts, "glm53_kda_state")
        # 3. compose in sequence order: the state entering every block, and after the chunk
        entering: dict[int, torch.Tensor] = {}
        for req, items in order.items():
            cache = store.kda_cache(layer, self._request_locs(req))
            ids = [i for _, i in sorted(items)]
            states, cache.state = entering_states(
                cache.state, [(all_maps[i, ..., :Dk], all_maps[i, ..., Dk:]) for i in ids]
            )
            entering.update(zip(ids, states))
        # 4. this rank's blocks from their entering states
        core = h.new_zeros(len(h), H, Dk, dtype=torch.float32)
        for n, (_, _, length, start) in enumerate(self.mine):
            q, k, v = qkv[n]
            span = slice(start, start + length)
            core[span], _ = kda_chunked(q, k, v, g[span], beta[span], entering[first_mine + n])
        self.transient_bytes = all_maps.numel() * 4 + all_tails.numel() * all_tails.element_size()
        if not len(h):  # a rank with no block of the round-robin re-split (requests shorter than C) joined the gathers
            return h.new_zeros(0, self.cfg.dim)
        return attn.finish(h, core)

    # ---- indexed layers -------------------------------------------------------------------------
    def _dsa(self, layer: int, attn: MLAttention, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, store, cfg = self.inputs, self.store, self.cfg
        proj = attn.project(h)
        parts = [proj.latent]
        if proj.index_k is not None:
            assert proj.index_gate is not None  # project() makes the indexer's key and pooling logits together
            parts += [proj.index_k, proj.index_gate]
        current = gather_current(i.group, i.index, torch.cat(parts, dim=-1), "glm53_current")  # sequence order
        R = cfg.kv_lora_rank
        out = h.new_zeros(len(h), cfg.dim)
        selection = torch.full((len(h), cfg.selection_width), -1, dtype=torch.int32, device=h.device)
        start = 0
        for req, (prefix, extend) in enumerate(zip(i.chunk.prefix_lens, i.chunk.extend_lens)):
            locs = self._request_locs(req)
            rows = current[start : start + extend]
            start += extend
            store.write_latent(layer, locs[prefix:], rows[:, :R])
            if proj.index_k is not None:
                self._pool(layer, attn, locs, prefix, rows[:, R:])
            latent = store.latent_view(layer, locs)
            keys = store.group_key_view(layer, locs) if proj.index_k is not None else None
            local = torch.nonzero(self.local_request == req).flatten()
            if not len(local):
                continue
            if keys is not None:
                assert proj.index_q is not None and proj.index_w is not None
                scores = group_scores(proj.index_q[local], proj.index_w[local], keys, cfg.index_head_dim)
                rows_sel = select(cfg, scores, i.positions[local])
            else:
                assert self.shared is not None, "a layer sharing its selection follows an indexed layer"
                rows_sel = self.shared[local]
            selection[local] = rows_sel
            out[local] = attn.attend(proj.q[local], latent, rows_sel)
        self.shared = selection
        self.transient_bytes = current.numel() * current.element_size()
        return out, selection

    def _pool(self, layer: int, attn: MLAttention, locs: torch.Tensor, prefix: int, raw: torch.Tensor) -> None:
        """Complete the request's groups with this chunk's raw rows ``[extend, 2 Di]``: each owner pools its own."""
        store, P, Di = self.store, self.cfg.index_kpool, self.cfg.index_head_dim
        pend_k, pend_g = store.pending_rows(layer, locs)
        keys = torch.cat([pend_k, raw[:, :Di].to(pend_k.dtype)])
        gates = torch.cat([pend_g, raw[:, Di:].to(pend_g.dtype)])
        first = prefix - len(pend_k)  # position of keys[0]: a group boundary
        full = len(keys) // P * P
        if full:
            ends = locs[first + P - 1 : first + full : P]
            mine = store.mine(ends)
            if bool(mine.any()):
                grouped_k, grouped_g = keys[:full].view(-1, P, Di), gates[:full].view(-1, P, Di)
                store.write_group_keys(layer, ends[mine], attn.pool(grouped_k[mine], grouped_g[mine]))
        store.set_pending(layer, locs, keys[full:], gates[full:])

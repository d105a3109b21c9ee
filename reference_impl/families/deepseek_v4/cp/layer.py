"""One CP rank's V4 layer step: what the engine's layer loop runs for a DeepSeek-V4 model.

Per layer (``m`` its compress ratio; the collectives every rank issues in the same order):

1. project the rank's own tokens (queries, raw entry, pre-pool rows, indexer query) and encode
   their raw entries;
2. **window halo** (all-gather ``v4_window``): the encoded raw entries other ranks' windows and
   every request's next window tail need; the rank's window table is then
   ``[window tails | own | halo]``;
3. CSA / HCA: **compressor halo** (all-gather ``v4_pool``): the pre-pool rows other ranks need
   for the entries they compute and for every request's next compressor state; the rank pools
   the entries whose last token it holds (their compute owner), finishes and encodes them;
4. **entry all-gather** (``v4_entries``): every rank gets the chunk's new entries (and CSA keys):
   compressed entries cross the wire, not raw tokens;
5. the store keeps its share (:mod:`reference_impl.families.deepseek_v4.cp.store`) and the layer's **entry view**
   is built: stored history (replicated) or materialized history (all-gather ``materialize``,
   phase 2; history only with phase 3, phase 8 one layer ahead) plus the new entries;
6. CSA: the indexer selects ``index_topk`` entries per query; attention with sinks over
   ``[window | selected]`` (CSA), ``[window | visible entries]`` (HCA) or the window alone.

A split boundary never changes the math: the halo brings the rows of an entry's or a window's
earlier tokens to the rank that needs them, exactly (bit for bit on a CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from reference_impl.config import RunConfig
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.prefetch import CudaSideStream, InlineStream
from reference_impl.cp.split import SplitMetadata
from reference_impl.families.deepseek_v4.cache_layout import decode_index, decode_main, encode_index, encode_main
from reference_impl.families.deepseek_v4.config import V4ModelConfig
from reference_impl.families.deepseek_v4.cp.plan import RatioPlan, V4ChunkPlan, build_plan
from reference_impl.families.deepseek_v4.cp.store import Materialization, V4Store, hit_points

WINDOW_TAG, POOL_TAG, ENTRY_TAG = "v4_window", "v4_pool", "v4_entries"
PER_LAYER_TAGS_V4 = (WINDOW_TAG, POOL_TAG, ENTRY_TAG, "materialize", "prefetch_v4")


def _long(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


class _RatioIndex:
    """Device tensors of a :class:`RatioPlan` and the rank's queries (built before the layer loop)."""

    def __init__(self, rp: RatioPlan, plan: V4ChunkPlan, device: torch.device) -> None:
        m = rp.ratio
        self.pool_send = _long(rp.pool.send[plan.rank], device)
        self.pool_lengths = rp.pool.lengths
        self.pool_rows = _long(rp.pool.rows, device)
        n_slots = 2 * m if m == 4 else m
        self.slot_rows = _long(rp.slot_rows, device).reshape(len(rp.owned), n_slots)
        self.owned_entries = _long([rp.entries[k][1] for k in rp.owned], device)
        self.new_state_rows = [_long(rows, device) for rows in rp.new_state_rows]
        self.checkpoint_state_rows = {key: _long(rows, device) for key, rows in rp.checkpoint_state_rows.items()}
        self.entry_rows = _long(rp.entry_rows, device)
        self.entry_lengths = rp.entry_lengths
        counts = [0] * len(plan.prefix_lens)
        for i, _ in rp.entries:
            counts[i] += 1
        self.new_counts = counts
        self.new_spans = [range(p // m, p // m + n) for p, n in zip(plan.prefix_lens, counts)]
        self.history_counts = [p // m for p in plan.prefix_lens]
        self.all_counts = rp.n_entries
        self.n_visible = _long([(t + 1) // m for t in plan.positions], device)
        starts = [rp.view_offsets[i] for i in plan.requests]
        self.key_start = _long(starts, device)
        self.max_visible = max(((t + 1) // m for t in plan.positions), default=0)
        # The same key ranges on the host: the indexer kernel sizes its tiles without reading the device.
        self.host_bounds = (starts, [s + (t + 1) // m for s, t in zip(starts, plan.positions)])


class V4ChunkRunner:
    """Runs one chunk's V4 layers on one rank (see the module docstring); built before the layer loop."""

    def __init__(
        self,
        group: CPGroup,
        cfg: V4ModelConfig,
        store: V4Store,
        meta: SplitMetadata,
        request_ids: list[int],
        request_locs: list[torch.Tensor],
        view_dtype: torch.dtype,
        prefetch: bool = False,
        direct_write: bool = False,
        hit_points: list[list[int]] | None = None,
    ) -> None:
        device = group.device
        self.group, self.cfg, self.store, self.view_dtype = group, cfg, store, view_dtype
        self.plan = build_plan(meta, cfg, group.rank, hit_points)
        plan = self.plan
        self.checkpoint_tail_rows = {key: _long(rows, device) for key, rows in plan.checkpoint_tail_rows.items()}
        self.positions = _long(plan.positions, device)
        self.raw_send = _long(plan.raw.send[group.rank], device)
        self.raw_rows = _long(plan.raw.rows, device)
        self.window_rows = _long(plan.window_rows, device).reshape(plan.n_local, cfg.window_size)
        self.new_tail_rows = [_long(rows, device) for rows in plan.new_tail_rows]
        self.ratios = {m: _RatioIndex(rp, plan, device) for m, rp in plan.ratios.items()}
        self.n_tokens = [p + e for p, e in zip(plan.prefix_lens, plan.extend_lens)]
        store.begin_chunk(request_ids, request_locs)
        csa = self.ratios.get(4)
        store.prepare(csa.new_spans if csa is not None else [range(0)] * len(request_ids))
        self.materialization: Materialization | None = None
        if store.sharded and csa is not None:
            self.materialization = store.materialization(csa.history_counts if store.reuse_current else csa.all_counts)
        # Phase 5: every sharded entry this rank keeps was computed here (a batch-level fact of the metadata).
        self.direct = direct_write and store.sharded and csa is not None and self._owners_compute(plan)
        if csa is not None:  # the rank's own new CSA entries per request (its compute order)
            rp = plan.ratios[4]
            self.own_counts = [sum(1 for k in rp.owned if rp.entries[k][0] == i) for i in range(len(request_ids))]
        store.paths.add("direct" if self.direct else ("gathered" if store.sharded else "replicated"))
        self.prefetcher = _HistoryPrefetcher(self) if prefetch and self.materialization is not None else None
        self.transient_bytes = 0

    @classmethod
    def for_run(
        cls,
        group: CPGroup,
        run: RunConfig,
        store: V4Store,
        meta: SplitMetadata,
        batch: BatchLocs,
        requests: tuple[int, ...],
    ) -> V4ChunkRunner:
        """The runner of one chunk of ``run`` (the engine's hook; views in bf16, like the oracle's)."""
        cfg = run.model
        assert isinstance(cfg, V4ModelConfig)
        points = hit_points(run)
        return cls(
            group,
            cfg,
            store,
            meta,
            list(requests),
            list(batch.request_locs),
            torch.bfloat16,
            prefetch=run.phases.prefetch,
            direct_write=run.phases.compute_owner,
            hit_points=[sorted(points.get(req, ())) for req in requests],
        )

    def _owners_compute(self, plan: V4ChunkPlan) -> bool:
        rp = plan.ratios[4]
        for (i, w), computed_by in zip(rp.entries, rp.entry_owner):
            if self.store.entry_owner(self.store.requests[i], [w])[0] != computed_by:
                return False
        return True

    # ---- the layer step -----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, layer: int, block: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer`` for the rank's tokens ``x [T_local, dim]`` -> ``(x + attention, top-k)``;
        top-k: CSA entries selected per query (request entry indices, ``-1`` padded; ``[T, 0]`` elsewhere)."""
        cfg, store, plan = self.cfg, self.store, self.plan
        if self.prefetcher is not None:
            self.prefetcher.launch_after(layer)
        attn, m = block.attn, cfg.ratio(layer)
        codec = store.codec
        proj = attn.project(block.attn_norm(x), self.positions, quantize_index=codec == "fp8")
        own_raw = encode_main(proj.kv, codec)
        halo = self._gather(own_raw, self.raw_send, plan.raw.lengths, self.raw_rows, WINDOW_TAG)
        table = torch.cat([*(store.state(layer, req).window for req in store.requests), own_raw, halo])
        tails = [table.index_select(0, rows) for rows in self.new_tail_rows]
        views = [decode_main(table, codec).to(self.view_dtype)]
        indices = [self.window_rows]
        topk = torch.full((plan.n_local, 0), -1, dtype=torch.int32, device=x.device)
        dense: tuple[torch.Tensor | None, torch.Tensor | None, int | None] = (None, None, None)
        transient = table.numel()
        checkpoint_tails = {key: table.index_select(0, rows) for key, rows in self.checkpoint_tail_rows.items()}
        if not m:
            store.set_state(layer, tails, [None] * len(tails), self.n_tokens)
            store.set_checkpoints(layer, checkpoint_tails, {})
        else:
            ri = self.ratios[m]
            main_rows, index_rows, pools, new_local, checkpoint_pools = self._entries(layer, attn, proj, ri, x.dtype)
            store.set_state(layer, tails, pools, self.n_tokens)
            store.set_checkpoints(layer, checkpoint_tails, checkpoint_pools)
            main_view, index_view = self._entry_view(layer, ri, main_rows, index_rows, new_local)
            offset = table.shape[0]
            views.append(decode_main(main_view, codec).to(self.view_dtype))
            transient += main_rows.numel() + index_rows.numel() + main_view.numel() + index_view.numel()
            if m == 4:
                keys = decode_index(index_view, codec, cfg.index_head_dim)
                if codec != "fp32":  # FP4 with power-of-two scales, or bf16: exact in bf16, the indexer kernel's input
                    keys = keys.to(torch.bfloat16)
                sel = attn.ops.select_entries(
                    proj.index_q,
                    proj.index_weights,
                    keys,
                    ri.key_start,
                    ri.n_visible,
                    cfg.index_topk,
                    host_bounds=ri.host_bounds,
                )
                indices.append(torch.where(sel >= 0, sel.long() + offset, torch.full_like(sel, -1, dtype=torch.long)))
                topk = torch.where(sel >= 0, sel - ri.key_start[:, None].to(sel.dtype), sel)
            else:
                dense = (ri.key_start + offset, ri.n_visible, ri.max_visible)
        view = torch.cat(views)
        self.transient_bytes = max(self.transient_bytes, transient + view.numel() * view.element_size())
        out = attn.attend(proj, self.positions, view, torch.cat(indices, dim=1), *dense)
        return x + out, topk

    def _gather(
        self, rows: torch.Tensor, send: torch.Tensor, lengths: list[int], recv: torch.Tensor, tag: str
    ) -> torch.Tensor:
        """One halo all-gather: ``rows[send]`` from every rank; this rank's needed rows, in need order."""
        if self.group.size == 1:
            return rows[:0]
        padded = self.group.all_gather_rows_padded_raw(rows.index_select(0, send), lengths, tag)
        return padded.reshape(-1, rows.shape[1]).index_select(0, recv)

    def _entries(
        self,
        layer: int,
        attn: Any,
        proj: Any,
        ri: _RatioIndex,
        dtype: torch.dtype,
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        list[torch.Tensor],
        tuple[torch.Tensor, torch.Tensor],
        dict[tuple[int, int], torch.Tensor],
    ]:
        """Compressor halo, this rank's entries, entry all-gather -> ``(new main rows, new index rows
        (chunk entry order), next compressor states, this rank's own encoded (main, index), compressor
        states at the checkpoints)``."""
        store, codec, m = self.store, self.store.codec, attn.ratio
        parts = [proj.pool_kv, proj.pool_score]
        if m == 4:
            parts += [proj.index_pool_kv, proj.index_pool_score]
        own_pool = torch.cat(parts, dim=1)
        halo = self._gather(own_pool, ri.pool_send, ri.pool_lengths, ri.pool_rows, POOL_TAG)
        table = torch.cat([*(store.state(layer, req).pool for req in store.requests), own_pool, halo])
        pools = [table.index_select(0, rows) for rows in ri.new_state_rows]
        checkpoint_pools = {key: table.index_select(0, rows) for key, rows in ri.checkpoint_state_rows.items()}
        width = proj.pool_kv.shape[1]
        main = attn.finish_entries(
            attn.ops.pool(table[:, :width], table[:, width : 2 * width], ri.slot_rows, m), ri.owned_entries, dtype
        )
        own_main = encode_main(main, codec)
        if m == 4:
            iw = proj.index_pool_kv.shape[1]
            keys = attn.ops.pool(table[:, 2 * width : 2 * width + iw], table[:, 2 * width + iw :], ri.slot_rows, m)
            own_index = encode_index(attn.finish_index_keys(keys, ri.owned_entries, dtype), codec)
        else:
            own_index = own_main.new_empty(own_main.shape[0], 0)
        packed = torch.cat([own_main, own_index], dim=1)
        if self.group.size == 1:
            gathered = packed
        else:
            padded = self.group.all_gather_rows_padded_raw(packed, ri.entry_lengths, ENTRY_TAG)
            gathered = padded.reshape(-1, packed.shape[1]).index_select(0, ri.entry_rows)
        b = own_main.shape[1]
        return gathered[:, :b], gathered[:, b:], pools, (own_main, own_index), checkpoint_pools

    def _entry_view(
        self,
        layer: int,
        ri: _RatioIndex,
        main_rows: torch.Tensor,
        index_rows: torch.Tensor,
        own: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this rank's share of the new entries and return the layer's entry view
        ``(main [entries of every chunk request], index)`` in request, then entry order."""
        store = self.store
        new_main, new_index = main_rows.split(ri.new_counts), index_rows.split(ri.new_counts)
        if self.direct and store.owns(layer):  # phase 5: the rank's own entries are the ones it keeps
            own_main, own_index = (t.split(self.own_counts) for t in own)
            store.add_entries(layer, list(zip(ri.new_spans, own_main, own_index)), selected=True)
        else:
            store.add_entries(layer, list(zip(ri.new_spans, new_main, new_index)))
        if not store.owns(layer):
            hist_main, hist_index = store.history(layer, ri.history_counts)
        elif store.reuse_current:
            assert self.materialization is not None
            if self.prefetcher is not None:
                dense_main, dense_index = self.prefetcher.consume(layer)
            else:
                dense_main, dense_index = store.materialize(layer, self.materialization)
            hist_main = list(dense_main.split(ri.history_counts))
            hist_index = list(dense_index.split(ri.history_counts))
        else:
            assert self.materialization is not None
            dense_main, dense_index = store.materialize(layer, self.materialization)
            return dense_main, dense_index
        main = torch.cat([t for pair in zip(hist_main, new_main) for t in pair])
        index = torch.cat([t for pair in zip(hist_index, new_index) for t in pair])
        return main, index


class _HistoryPrefetcher:
    """Phase 8: materialize the next CSA layer's history entries one layer ahead, on a side stream
    (CUDA) or at once (CPU); the consuming layer waits only when it reads them."""

    def __init__(self, runner: V4ChunkRunner) -> None:
        self.runner = runner
        cfg = runner.cfg
        self.csa_layers = [layer for layer in range(cfg.n_layers) if cfg.ratio(layer) == 4]
        device = runner.group.device
        self.stream = CudaSideStream(device) if device.type == "cuda" else InlineStream()
        self.results: dict[int, Any] = {}
        self.handles: dict[int, Any] = {}
        self.next = 0  # index into csa_layers of the next layer to launch

    def launch_after(self, layer: int) -> None:
        """At the start of ``layer``: launch every CSA layer up to ``layer + 1`` not launched yet."""
        while self.next < len(self.csa_layers) and self.csa_layers[self.next] <= layer + 1:
            target = self.csa_layers[self.next]
            slot = self.next % 2
            store, plan = self.runner.store, self.runner.materialization
            assert plan is not None

            def work(target: int = target, store: V4Store = store, plan: Materialization = plan) -> None:
                self.results[target] = store.materialize(target, plan, tag="prefetch_v4")

            self.handles[target] = self.stream.submit(work, slot)
            self.next += 1

    def consume(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.stream.wait(self.handles.pop(layer))
        main, index = self.results.pop(layer)
        if main.is_cuda:
            for t in (main, index):
                t.record_stream(torch.cuda.current_stream())
        self.stream.release(self.csa_layers.index(layer) % 2)
        return main, index

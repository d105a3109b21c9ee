"""One DSA layer for one rank's tokens of a chunk: the step the engine's layer loop calls.

Per layer (the baseline; the phases change what the store does, not these steps):

1. project the rank's own tokens (queries, latent KV row, indexer K);
2. **all-gather #1**: latent KV (576 wide) and indexer K (128 wide), padded, trimmed, reranged to
   sequence order (:func:`~reference_impl.cp.rerange.gather_current`; phase 7 fuses the rerange);
3. store the current chunk in the rank's pool and build the **full view** (the KV store: replicated,
   or sharded with phases 2, 3 and 5; phase 8 prefetches the next layer's prefix pages);
4. indexer top-k and sparse attention for the local queries; residual add.

IndexShare (GLM-5.2): a shared layer projects no indexer K, gathers none and attends with the last
full layer's top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from reference_impl.cp.prefetch import MlaPrefetcher
from reference_impl.cp.rerange import gather_current
from reference_impl.families.base import ChunkInputs
from reference_impl.model.sparse_attention import HostKeyBounds


class DSALayerStep:
    """The DSA layer step of one chunk on one rank (a :class:`~reference_impl.families.base.ChunkStep`)."""

    def __init__(
        self,
        inputs: ChunkInputs,
        host_bounds: HostKeyBounds | None,
        prefetcher: Callable[[Any, int], MlaPrefetcher] = MlaPrefetcher,
    ) -> None:
        self.group, self.run, self.store = inputs.group, inputs.run, inputs.store
        self.index, self.positions, self.on_layer_stored = inputs.index, inputs.positions, inputs.on_layer_stored
        local = self.index.local
        self.key_start = inputs.batch.key_start.index_select(0, local)
        self.key_end = inputs.batch.key_end.index_select(0, local)
        self.request_start = self.key_start[:, None].int()  # top-k rows -> positions in the request
        self.host_bounds = host_bounds  # phase 6: the indexer bounds its row chunks without reading the device
        self.fused = self.run.phases.fused_kernels  # phase 7: one-pass rerange of the per-layer all-gathers
        n_layers = len(inputs.model.layers)
        self.prefetch = prefetcher(self.store, n_layers) if self.run.phases.prefetch else None
        self.last_topk: torch.Tensor | None = None  # IndexShare: a shared layer attends with the last full layer's
        self.transient_bytes = 0

    def begin(self) -> None:
        if self.prefetch is not None:
            self.prefetch.launch(0)

    def step(self, layer: int, block: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        group, store, prefetch, debug = self.group, self.store, self.prefetch, self.group.debug
        if prefetch is not None:
            prefetch.launch(layer + 1)  # overlaps this layer's compute
        proj = block.attn.project(block.attn_norm(x), self.positions)
        kv_seq = gather_current(group, self.index, proj.kv, "kv", self.fused, debug)  # [T, 576] sequence order
        index_k_seq = (  # [T, 128]; none on an IndexShare shared layer (reference_impl.index_share)
            gather_current(group, self.index, proj.index_k, "index_k", self.fused, debug)
            if proj.index_k is not None
            else None
        )
        store.store_current(layer, kv_seq, index_k_seq, proj.kv, proj.index_k)
        if self.on_layer_stored is not None:
            self.on_layer_stored.layer_stored(layer)
        if prefetch is not None:
            view = store.full_view(layer, kv_seq, index_k_seq, prefetch.consume(layer))
        else:
            view = store.full_view(layer, kv_seq, index_k_seq)
        out, topk = block.attn.attend(
            proj,
            view.kv,
            view.index_k_fp8,
            view.index_k_scale,
            self.key_start,
            self.key_end,
            self.host_bounds,
            self.last_topk,
        )
        self.last_topk = topk
        if prefetch is not None:
            prefetch.release(layer)
        gathered = sum(t.numel() * t.element_size() for t in (kv_seq, index_k_seq) if t is not None)
        self.transient_bytes = gathered + view.nbytes + store.transient_bytes
        # Drop this layer's tensors now: the next layer would otherwise project, gather and attend with
        # them still allocated (q alone is [T, H, 576], 2.25 GiB at 16K local tokens).
        del proj, kv_seq, index_k_seq, view
        if self.run.check:  # only check runs read the selection: as positions in the request
            topk = torch.where(topk >= 0, topk - self.request_start, topk)
        return x + out, topk

    def end(self) -> None:
        pass

    def prefetch_wait_ms(self) -> list[float]:
        return self.prefetch.exposed_wait_ms() if self.prefetch is not None else []

"""DCP-interleave gather: each rank stores its decode-context-parallel shard and gathers every shard per layer.

vLLM's prefill context parallelism with decode context parallelism on sparse MLA: the KV cache is
sharded for decode, token ``t`` of a request on rank ``(t // I) mod C`` (``I``: vLLM's
``--cp-kv-cache-interleave-size``, default 1; here ``kv_interleave``, default 1 with this design),
packed densely in that rank's pages (:class:`~reference_impl.cp.ownership.Ownership`).

* **store**: after the prefill's all-gather of the chunk, every rank writes the tokens of its shard;
* **gather**: per layer, after the write, each rank reads its shard of the batch's requests
  (prefix **and** current tokens, in position order) into a contiguous buffer, and one padded
  all-gather per buffer (MLA rows, then index K rows: 128 FP8 bytes and the float32 scale) builds
  a **rank-major workspace** ``[rank 0's rows | rank 1's | ...]``; synchronous, no current reuse;
* **materialize**: the full view reads the workspace at ``owner * n_pad + k`` (``k``: the row's
  place in its owner's shard), one unpacking pass (torch ops: no fused kernel for this layout).

What the engine adds that this store leaves out: the workspace is filled request by request in
chunks of a bounded size (a plan every rank derives alike), and the indexer and the FlashMLA
kernel read it through translated indices instead of a dense view.
"""

from __future__ import annotations

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.designs.common import OwnedShare, empty_view
from reference_impl.cp.kv_store import FullView
from reference_impl.cp.ownership import Ownership
from reference_impl.kvcache.layout import SCALE_BYTES, KVLayout
from reference_impl.kvcache.pool import PagedKVPool, check_in_range


class DcpGatherKV(OwnedShare):
    """The rank's DCP shard at interleave ``I`` and a per-layer rank-major workspace of every shard."""

    name = "dcp-gather"
    sharded = True

    def __init__(
        self,
        batch: BatchLocs,
        layout: KVLayout,
        n_layers: int,
        group: CPGroup,
        debug: bool,
        fused: bool = False,
        interleave: int = 1,
    ) -> None:
        self.layout, self.group, self.debug, self.fused = layout, group, debug, fused
        self.ownership = Ownership(group.size, interleave, batch.page_size)
        self.pool = PagedKVPool(
            n_layers, self.ownership.pages_held(batch.n_pages, group.rank), batch.page_size, layout, group.device, debug
        )
        self.batch = batch
        self.materialized_bytes = 0
        self.transient_bytes = 0
        self.bind(batch)

    def bind(self, batch: BatchLocs) -> None:
        """Plan the batch once: owned rows of the chunk, this rank's shard rows of the view (send
        list), each rank's row count and the workspace row of every view row."""
        if batch.n_pages != self.batch.n_pages:
            raise ConfigError(f"chunk batch spans {batch.n_pages} pages, the pool was built for {self.batch.n_pages}")
        self.batch = batch
        rank, cp_size = self.group.rank, self.group.size
        self.plan_store(batch)

        owner = self.ownership.owner(batch.view_locs)  # [S]
        self.counts = [int(c) for c in torch.bincount(owner, minlength=cp_size)]  # shard rows per rank
        self.n_pad = max(self.counts)
        # Place of each view row in its owner's shard (view order within an owner): a stable sort by owner.
        order = torch.sort(owner, stable=True).indices
        place = torch.empty_like(order)
        starts = torch.cumsum(torch.tensor([0] + self.counts[:-1], device=owner.device), 0)
        place[order] = torch.arange(owner.numel(), device=owner.device) - starts[owner[order]]
        self._row_source = owner * self.n_pad + place  # [S] row of the rank-major workspace
        self._send = self.ownership.physical(batch.view_locs[owner == rank])  # this rank's shard rows, view order
        check_in_range("shard rows", self._send, self.pool.n_slots)
        check_in_range("workspace rows", self._row_source, cp_size * self.n_pad)

    def full_view(
        self, layer: int, kv_seq: torch.Tensor, index_k_seq: torch.Tensor, prefetched_kv: torch.Tensor | None = None
    ) -> FullView:
        """Gather every rank's shard of the batch (two padded all-gathers) and unpack the workspace into the view."""
        if prefetched_kv is not None:
            raise ConfigError("dcp-gather gathers synchronously: phase 8 does not run beside it")
        layout = self.layout
        mla = self.pool.read_mla(layer, self._send)  # [n_r, mla_bytes]
        k_fp8, k_scale = self.pool.read_index(layer, self._send)
        index = torch.cat([k_fp8.view(torch.uint8), k_scale.view(torch.uint8).reshape(-1, SCALE_BYTES)], dim=1)
        mla_ws = self.group.all_gather_rows_padded_raw(mla, self.counts, tag="materialize")
        index_ws = self.group.all_gather_rows_padded_raw(index, self.counts, tag="materialize_index")
        mla_ws = mla_ws.reshape(-1, layout.mla_bytes)  # [C * n_pad, mla_bytes] rank-major (one rank: [n_r, ...])
        index_ws = index_ws.reshape(-1, layout.index_head_dim + SCALE_BYTES)
        source = self._row_source
        view = empty_view(self.batch, layout, kv_seq.device)
        view.kv.copy_(layout.dequantize_mla(mla_ws.index_select(0, source)))
        picked = index_ws.index_select(0, source)
        view.index_k_fp8.view(torch.uint8).copy_(picked[:, : layout.index_head_dim])
        view.index_k_scale.copy_(picked[:, layout.index_head_dim :].contiguous().view(torch.float32).reshape(-1))
        workspace = mla_ws.numel() + index_ws.numel()
        self.materialized_bytes += workspace
        self.transient_bytes = workspace
        return view

    def owned_pages(self) -> torch.Tensor:
        raise ConfigError("dcp-gather keeps a token-interleaved shard: send it as it is (reference_impl.pd.dcp)")

"""Per-layer full-view cost of phase 2 (materialize every page) vs phase 3 (history only).

``time_full_view`` runs on every rank of a group started by :func:`~reference_impl.launch.launch`:
it builds one request of ``prefix + extend`` tokens at the given model's dims, a sharded store whose
pool holds random bytes (values do not change the data movement), and times
``ShardedKV.full_view`` for one layer under both phases: median of ``repeats`` after a warm-up, a
barrier before each repeat. ``pool_memory`` measures the device memory one rank's pool takes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from reference_impl.config import KVDtype, get_preset
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.cp.ownership import owned_page_count
from reference_impl.cp.split import build_split
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool


@dataclass(frozen=True)
class FullViewBench:
    prefix: int
    extend: int
    preset: str = "deepseek-v3.2"
    kv_dtype: KVDtype = "fp8"
    page_size: int = 64
    repeats: int = 5


@torch.no_grad()
def time_full_view(group: CPGroup, bench: FullViewBench) -> dict[str, float]:
    """Median ms of one layer's full view under phase 2 and phase 3, and the bytes each materializes."""
    cfg = get_preset(bench.preset)
    meta = build_split("in-seq", group.size, [bench.extend], [bench.prefix], page_size=bench.page_size)
    batch = BatchLocs.build(meta, group.device)
    layout = KVLayout.from_config(cfg, bench.kv_dtype, bench.page_size)
    gen = torch.Generator(device=group.device).manual_seed(group.rank)
    dtype = torch.bfloat16 if group.device.type == "cuda" else torch.float32
    kv_seq = torch.randn(meta.total_tokens, layout.kv_width, generator=gen, device=group.device).to(dtype)
    index_k = torch.randn(meta.total_tokens, layout.index_head_dim, generator=gen, device=group.device).to(dtype)
    out: dict[str, float] = {}
    for name, reuse in (("phase2", False), ("phase3", True)):
        store = ShardedKV(batch, layout, 1, group, debug=False, reuse_current=reuse)
        store.pool.mla.random_(0, 256, generator=gen)
        store.pool.index.random_(0, 256, generator=gen)
        times = []
        for i in range(bench.repeats + 1):
            group.barrier()
            if group.device.type == "cuda":
                torch.cuda.synchronize(group.device)
            start = time.perf_counter()
            store.full_view(0, kv_seq, index_k)
            if group.device.type == "cuda":
                torch.cuda.synchronize(group.device)
            if i:  # the first call is the warm-up
                times.append((time.perf_counter() - start) * 1e3)
        out[f"{name}_ms"] = statistics.median(times)
        out[f"{name}_materialized_bytes"] = store.materialized_bytes // (bench.repeats + 1)
    return out


def pool_memory(preset: str, tokens: int, cp_size: int, sharded: bool, device: str, kv_dtype: KVDtype = "fp8") -> int:
    """Device bytes one rank's pool takes (rank 0), measured with ``torch.cuda.memory_allocated``."""
    cfg = get_preset(preset)
    layout = KVLayout.from_config(cfg, kv_dtype, 64)
    pages = -(-tokens // 64)
    held = owned_page_count(pages, 0, cp_size) if sharded else pages
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    pool = PagedKVPool(cfg.n_layers, held, 64, layout, device)
    torch.cuda.synchronize(device)
    used = torch.cuda.memory_allocated(device) - before
    del pool
    torch.cuda.empty_cache()
    return used

"""Per-layer store path: phase 2 (owned share of the gathered chunk) vs phase 5 (direct write).

The store path has no collective, so one process measures one rank's work exactly: rank 0 of a
``C``-rank group with a page-aligned split of one request. Phase 2 selects the tokens whose pages
it owns from the gathered ``[T, 576]`` / ``[T, 128]`` chunk, quantizes and scatters them; phase 5
quantizes and writes the ``T / C`` rows it computed itself. Timed on CUDA as the replay of a CUDA
graph of one store (``triton.testing.do_bench`` median: device time, not launch rate), with
``perf_counter`` medians on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from reference_impl.bench.timing import cpu_median_ms
from reference_impl.config import KVDtype, get_preset
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.cp.split import build_split
from reference_impl.cp.split_index import local_index_tensor
from reference_impl.kvcache.layout import KVLayout


@dataclass(frozen=True)
class RankIdentity:
    """What a store reads from its CP group (rank, size, device); storing needs no collective."""

    rank: int
    size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def _median_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median ms of ``fn``'s device work.

    On CUDA ``fn`` is captured once in a CUDA graph and the replays are timed: one store is ~20
    launches of a few microseconds of GPU work each, so timing the eager calls would measure the
    host's launch rate, not the store. The path has no host sync, so it captures.
    """
    if device.type == "cuda":
        import triton.testing

        fn()  # compile and allocate outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return float(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))
    return cpu_median_ms(fn, repeats)


@torch.no_grad()
def time_store_paths(
    tokens: int, cp_size: int, device: str, preset: str = "deepseek-v3.2", kv_dtype: KVDtype = "fp8", repeats: int = 5
) -> dict[str, float]:
    """One layer's store on rank 0: median ms and bytes moved of phase 2 vs phase 5, on the torch path
    and fused (phase 7: the selection of phase 2's rows happens inside the kernel)."""
    dev = torch.device(device)
    cfg = get_preset(preset)
    meta = build_split("in-seq", cp_size, [tokens], [0], 64, page_aligned=True)
    batch = BatchLocs.build(meta, dev, compute_owner=True)
    layout = KVLayout.from_config(cfg, kv_dtype, 64)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kv_seq = torch.randn(tokens, layout.kv_width, device=dev).to(dtype)
    index_seq = torch.randn(tokens, layout.index_head_dim, device=dev).to(dtype)
    local = local_index_tensor(meta, 0, dev)
    kv_local, index_local = kv_seq.index_select(0, local), index_seq.index_select(0, local)
    out: dict[str, float] = {"tokens": tokens, "cp_size": cp_size, "local_tokens": int(local.numel())}
    # Bytes a store reads (its bf16 input rows) and writes (packed rows): the same rows on both paths.
    row_in = (layout.kv_width + layout.index_head_dim) * (2 if dtype == torch.bfloat16 else 4)
    payload = int(local.numel()) * (row_in + layout.mla_bytes + layout.index_bytes)
    select = int(local.numel()) * row_in * 2  # phase 2 on torch: index_select of its rows, read + write
    for name, direct, fused in (
        ("phase2", False, False),
        ("phase5", True, False),
        ("phase2_fused", False, True),
        ("phase5_fused", True, True),
    ):
        store = ShardedKV(
            batch,
            layout,
            1,
            RankIdentity(0, cp_size, dev),
            debug=False,
            reuse_current=True,  # type: ignore[arg-type]
            direct_write=direct,
            fused=fused,
        )
        assert store.direct_write == direct
        out[f"{name}_ms"] = _median_ms(
            lambda s=store: s.store_current(0, kv_seq, index_seq, kv_local, index_local), dev, repeats
        )
        out[f"{name}_bytes"] = payload + (select if not direct and not fused else 0)
    return out

"""Timing of the two all-gathers on whatever ranks :func:`~reference_impl.launch.launch` starts.

``time_collectives`` runs on every rank (SPMD): it builds a synthetic batch of ``T`` tokens split
in-seq over the group, then times, with a barrier before each repeat and the median over repeats,

* all-gather #1 of one layer: latent KV ``[n_local, 576]`` and indexer K ``[n_local, 128]``
  (bf16 on CUDA), padded, trimmed, reranged to sequence order;
* the tail: the full gather of ``[n_local, hidden]`` vs the narrow gather of the requests' last rows.

Ranks that share one GPU talk through gloo (NCCL refuses two ranks on one device): those times
include gloo's host staging and are an upper bound for NCCL on one GPU per rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reference_impl.cp.comm import CPGroup
from reference_impl.cp.narrow_output import collect_narrow
from reference_impl.cp.rerange import gather_current
from reference_impl.cp.split import build_split
from reference_impl.cp.split_index import SplitIndex
from reference_impl.cp.tail import OutputSpec, collect_full


@dataclass(frozen=True)
class CollectiveBench:
    """One timing point: ``tokens`` split over the group as ``n_requests`` equal requests."""

    tokens: int
    hidden: int = 7168
    kv_width: int = 576
    index_dim: int = 128
    n_requests: int = 1
    repeats: int = 10
    dtype: torch.dtype = torch.bfloat16


def _median_ms(group: CPGroup, fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first collective sets up the communicator
    times = []
    for _ in range(repeats):
        group.barrier()
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)
        start = time.perf_counter()
        fn()
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def time_collectives(group: CPGroup, bench: CollectiveBench) -> dict[str, float]:
    """Median wall times (ms) of all-gather #1 (one layer) and of the full / narrow tail on this rank."""
    per_req = bench.tokens // bench.n_requests
    meta = build_split("in-seq", group.size, [per_req] * bench.n_requests, page_size=64)
    n_local, device = meta.rank_lengths[group.rank], group.device
    gen = torch.Generator(device=device).manual_seed(group.rank)
    kv = torch.randn(n_local, bench.kv_width, generator=gen, device=device).to(bench.dtype)
    index_k = torch.randn(n_local, bench.index_dim, generator=gen, device=device).to(bench.dtype)
    hidden = torch.randn(n_local, bench.hidden, generator=gen, device=device).to(bench.dtype)
    spec = OutputSpec()
    index = SplitIndex.build(meta, group.rank, device)

    def layer_gather() -> None:
        gather_current(group, index, kv, tag="kv")
        gather_current(group, index, index_k, tag="index_k")

    return {
        "layer_gather_ms": _median_ms(group, layer_gather, bench.repeats),
        "tail_full_ms": _median_ms(group, lambda: collect_full(group, meta, hidden, spec), bench.repeats),
        "tail_narrow_ms": _median_ms(group, lambda: collect_narrow(group, meta, hidden, spec), bench.repeats),
    }


def sweep_collectives(cp_size: int, sizes: list[int], repeats: int, dtype: torch.dtype) -> list[dict[str, float]]:
    """``time_collectives`` on ``cp_size`` launched ranks for each size; the slowest rank's times."""
    from reference_impl.launch import launch

    points = []
    for tokens in sizes:
        per_rank = launch(time_collectives, cp_size, CollectiveBench(tokens=tokens, repeats=repeats, dtype=dtype))
        points.append({"tokens": tokens, **{k: max(r[k] for r in per_rank) for k in per_rank[0]}})
    return points

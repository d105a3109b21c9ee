"""The fused-kernel benchmark's pieces: one :class:`Case` per kernel and size (the Triton kernel
and its torch path on the same inputs, with the bytes each must move), the copy-bandwidth ceiling,
and the remap comparison. :mod:`reference_impl.bench.kernels` drives them and writes the JSON."""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from reference_impl.bench.timing import cpu_median_ms, queued_median_ms
from reference_impl.kernels.fused_configs import LaunchConfig

COPY_BYTES_GPU = 1 << 30
BAR_FRACTION = 0.8
BAR_MIN_TOKENS = 32768
REPS = 200


def make_timer(device: torch.device, cpu_repeats: int, reps: int = REPS) -> Callable[[Callable[[], object]], float]:
    """On CUDA, :func:`~reference_impl.bench.timing.queued_median_ms` over ``reps`` calls (device
    time, L2 flushed before each call, the host's launch work kept out); on a CPU the median of
    ``cpu_repeats`` wall-clock calls."""

    def time_ms(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            return queued_median_ms(fn, reps)
        return cpu_median_ms(fn, cpu_repeats)

    return time_ms


class SameSizeCopy:
    """The copy that moves a row's bytes: ``payload / 2`` bytes read and as many written, by
    ``Tensor.copy_``, timed like the kernels. A 1 GiB copy sets the bandwidth ceiling; this one
    says what a transfer of the row's size reaches, launch, ramp-up and the grid's tail included
    (the buffers are kept per size, so several rows of one size share one measurement)."""

    def __init__(self, device: torch.device, time_ms: Callable[[Callable[[], object]], float]) -> None:
        self.device, self.time_ms = device, time_ms
        self.ms: dict[int, float] = {}

    def __call__(self, payload: int) -> float:
        n = max(payload // 2, 1)
        if n not in self.ms:
            src = torch.empty(n, dtype=torch.uint8, device=self.device).random_(0, 255)
            dst = torch.empty_like(src)
            self.ms[n] = self.time_ms(lambda: dst.copy_(src))
        return self.ms[n]


def copy_bandwidth(device: torch.device, time_ms: Callable[[Callable[[], object]], float]) -> dict[str, Any]:
    """A large device-to-device copy: GB/s counting bytes read + written."""
    n = COPY_BYTES_GPU if device.type == "cuda" else 1 << 22
    ms = SameSizeCopy(device, time_ms)(2 * n)
    return {"bytes": 2 * n, "ms": ms, "gbps": 2 * n / ms / 1e6}


def _bytes_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


@dataclass
class Case:
    """One benchmark row: a Triton kernel (``run(config)``, ``config`` its launch keywords) against
    its torch path (``reference()``), both writing the tensors ``outputs()`` returns."""

    op: str
    kernel: str  # the launch-config name (reference_impl.kernels.fused_configs) the row runs with
    rows: int
    payload: int
    index_bytes: int
    run: Callable[[LaunchConfig], object]
    reference: Callable[[], object]
    outputs: Callable[[], list[torch.Tensor]]

    def reference_bytes(self) -> list[torch.Tensor]:
        """Run the torch path; a copy of its outputs."""
        self.reference()
        return [t.clone() for t in self.outputs()]

    def kernel_bytes(self, config: LaunchConfig, want: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        """Zero the outputs, run the kernel with ``config``: (bytes differing from ``want``, a copy of the outputs)."""
        for t in self.outputs():  # the kernel must write every byte the check compares
            t.view(torch.uint8).zero_()
        self.run(config)
        got = [t.clone() for t in self.outputs()]
        return sum(_bytes_diff(a, b) for a, b in zip(got, want)), got


def _row(
    case: Case,
    config: LaunchConfig,
    tokens: int,
    time_ms: Callable[[Callable[[], object]], float],
    copy_gbps: float,
    same_size_copy: SameSizeCopy,
    repeats: int = 1,
) -> dict[str, Any]:
    """Check the kernel's bytes against the torch path, then time both (``repeats`` timings each,
    interleaved; the row keeps their median and, with several, all of them)."""
    differing, _ = case.kernel_bytes(config, case.reference_bytes())
    row: dict[str, Any] = {
        "op": case.op,
        "T": tokens,
        "rows": case.rows,
        "bytes": case.payload,
        "index_vector_bytes": case.index_bytes,
        "config": config,
    }
    row["check"] = {"differing_bytes": differing, "bytes_equal": differing == 0}
    paths = {"triton": lambda: case.run(config), "torch": case.reference}
    timings: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            timings[name].append(time_ms(fn))
    for name, times in timings.items():
        ms = statistics.median(times)
        row[f"{name}_ms"] = ms
        if repeats > 1:
            row[f"{name}_ms_repeats"] = times
        row[f"{name}_gbps"] = case.payload / ms / 1e6
        row[f"{name}_fraction_of_copy"] = case.payload / ms / 1e6 / copy_gbps
    row["speedup"] = row["torch_ms"] / row["triton_ms"]
    row["same_size_copy_ms"] = same_size_copy(case.payload)
    row["triton_fraction_of_same_size_copy"] = row["same_size_copy_ms"] / row["triton_ms"]
    return row


def build_cases(tokens: int, args: argparse.Namespace) -> list[Case]:
    """Every benchmark row at ``tokens`` tokens, inputs allocated once (the rows share them)."""
    from reference_impl.config import get_preset
    from reference_impl.cp.split import build_split
    from reference_impl.cp.split_index import rerange_tensor
    from reference_impl.kernels import fused_torch
    from reference_impl.kernels.fused_materialize import materialize_rows_triton
    from reference_impl.kernels.fused_rerange import rerange_padded_triton
    from reference_impl.kernels.fused_store import store_index_triton, store_mla_triton
    from reference_impl.kvcache.layout import KVLayout

    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(args.seed + tokens)
    cfg = get_preset(args.preset)
    page = args.page_size
    n_pages = -(-tokens // page)
    on_gpu = device.type == "cuda"
    cases: list[Case] = []

    # Store: all T rows to page-shuffled slots (an allocator's pages, slots in order).
    kv = torch.randn(tokens, cfg.kv_lora_rank + cfg.qk_rope_head_dim, device=device, generator=gen).to(torch.bfloat16)
    k = torch.randn(tokens, cfg.index_head_dim, device=device, generator=gen).to(torch.bfloat16)
    pages = torch.randperm(n_pages, device=device, generator=gen)
    locs = (pages[:, None] * page + torch.arange(page, device=device)).flatten()[:tokens].contiguous()
    for kv_dtype in ("fp8", "bf16"):
        layout = KVLayout.from_config(cfg, kv_dtype, page)
        pool = torch.zeros(n_pages * page, layout.mla_bytes, dtype=torch.uint8, device=device)
        store_bytes = tokens * (kv.shape[1] * 2 + layout.mla_bytes)

        def store_mla(config: LaunchConfig, layout: KVLayout = layout, pool: torch.Tensor = pool, **kw: Any) -> None:
            store_mla_triton(kv, None, locs, pool, layout, **config, **kw)

        def store_mla_ref(layout: KVLayout = layout, pool: torch.Tensor = pool) -> None:
            fused_torch.store_mla_torch(kv, None, locs, pool, layout)

        def pool_out(pool: torch.Tensor = pool) -> list[torch.Tensor]:
            return [pool]

        name = f"store_mla_{kv_dtype}"
        cases.append(Case(name, name, tokens, store_bytes, tokens * 8, store_mla, store_mla_ref, pool_out))
        if kv_dtype == "fp8" and on_gpu:  # the software fp8/bf16 conversion, timed on the GPU too
            soft = functools.partial(store_mla, soft=True)
            cases.append(
                Case(f"{name}_soft_convert", name, tokens, store_bytes, tokens * 8, soft, store_mla_ref, pool_out)
            )
    layout = KVLayout.from_config(cfg, "fp8", page)
    index_pool = torch.zeros(n_pages, layout.index_page_bytes, dtype=torch.uint8, device=device)
    index_store_bytes = tokens * (k.shape[1] * 2 + layout.index_bytes)

    def store_index(config: LaunchConfig, **kw: Any) -> None:
        store_index_triton(k, None, locs, index_pool, layout, **config, **kw)

    def store_index_ref() -> None:
        fused_torch.store_index_torch(k, None, locs, index_pool, layout)

    cases.append(
        Case(
            "store_index",
            "store_index",
            tokens,
            index_store_bytes,
            tokens * 8,
            store_index,
            store_index_ref,
            lambda: [index_pool],
        )
    )
    if on_gpu:
        soft_index = functools.partial(store_index, soft=True)
        cases.append(
            Case(
                "store_index_soft_convert",
                "store_index",
                tokens,
                index_store_bytes,
                tokens * 8,
                soft_index,
                store_index_ref,
                lambda: [index_pool],
            )
        )

    # Rerange: the padded all-gather buffer of the in-seq split of one request.
    meta = build_split("in-seq", args.cp_size, [tokens], [0], page)
    padded_index, rerange_index = rerange_tensor(meta, device, padded=True), rerange_tensor(meta, device)
    for name, width in (("kv", kv.shape[1]), ("index", k.shape[1])):
        raw = torch.randn(args.cp_size, meta.max_rank_len, width, device=device, generator=gen).to(torch.bfloat16)
        holder: list[torch.Tensor] = []  # each path allocates its result, as the engine would
        rerange_bytes = tokens * width * 2 * 2

        def rerange(config: LaunchConfig, raw: torch.Tensor = raw, holder: list[torch.Tensor] = holder) -> None:
            holder[:] = [rerange_padded_triton(raw, padded_index, **config)]

        def rerange_ref(raw: torch.Tensor = raw, holder: list[torch.Tensor] = holder) -> None:
            holder[:] = [fused_torch.rerange_padded_torch(raw, meta.rank_lengths, rerange_index)]

        def held(holder: list[torch.Tensor] = holder) -> list[torch.Tensor]:
            return holder

        op = f"rerange_{name}"
        cases.append(Case(op, op, tokens, rerange_bytes, tokens * 8, rerange, rerange_ref, held))
        if name == "kv":
            flat = raw.view(-1, width)

            def padded_gather(flat: torch.Tensor = flat, holder: list[torch.Tensor] = holder) -> None:
                holder[:] = [flat.index_select(0, padded_index)]

            cases.append(
                Case(
                    "rerange_kv_torch_padded_gather",
                    op,
                    tokens,
                    rerange_bytes,
                    tokens * 8,
                    rerange,
                    padded_gather,
                    held,
                )
            )

    # Materialize: every page gathered (MLA half and index half of one packed buffer, no copy).
    split = page * layout.mla_bytes
    gathered = torch.empty(n_pages, split + layout.index_page_bytes, dtype=torch.uint8, device=device)
    mla_rows = torch.zeros(n_pages * page, layout.mla_bytes, dtype=torch.uint8, device=device)
    fused_torch.store_mla_torch(kv, None, torch.arange(tokens, device=device), mla_rows, layout)
    gathered[:, :split].copy_(mla_rows.view(n_pages, split))
    del mla_rows
    fused_torch.store_index_torch(k, None, torch.arange(tokens, device=device), gathered[:, split:], layout)
    row_source = locs  # gathered page order is arbitrary: reuse the shuffled page order
    view_rows = torch.arange(tokens, device=device)
    view = torch.empty(tokens, kv.shape[1], dtype=torch.bfloat16, device=device)
    index_fp8 = torch.empty(tokens, k.shape[1], dtype=torch.float8_e4m3fn, device=device)
    index_scale = torch.empty(tokens, dtype=torch.float32, device=device)
    margs = (gathered[:, :split], gathered[:, split:], row_source, view_rows, view, index_fp8, index_scale, layout)
    cases.append(
        Case(
            "materialize_fp8",
            "materialize_fp8",
            tokens,
            tokens * (layout.mla_bytes + layout.index_bytes + kv.shape[1] * 2 + layout.index_bytes),
            tokens * 16,
            lambda config: materialize_rows_triton(*margs, **config),
            lambda: fused_torch.materialize_rows_torch(*margs),
            lambda: [view, index_fp8, index_scale],
        )
    )
    return cases


def bench_tokens(
    tokens: int,
    args: argparse.Namespace,
    time_ms: Callable[[Callable[[], object]], float],
    copy_gbps: float,
    configs: dict[str, LaunchConfig],
) -> list[dict[str, Any]]:
    """Every row at ``tokens``, each kernel with its config from ``configs`` (by launch-config name),
    timed ``args.repeats`` times, next to a copy of the same bytes."""
    rows_out: list[dict[str, Any]] = []
    same_size_copy = SameSizeCopy(torch.device(args.device), time_ms)
    for case in build_cases(tokens, args):
        row = _row(case, configs[case.kernel], tokens, time_ms, copy_gbps, same_size_copy, args.repeats)
        rows_out.append(row)
        print(
            f"  {case.op:<34}{row['triton_ms']:>9.3f} ms{row['torch_ms']:>9.3f} ms  check "
            f"{'ok' if row['check']['bytes_equal'] else 'DIFF'}",
            flush=True,
        )
    return rows_out


def bench_remap(
    tokens: int, args: argparse.Namespace, time_ms: Callable[[Callable[[], object]], float]
) -> dict[str, Any]:
    from reference_impl.config import get_preset
    from reference_impl.cp.remap import owned_slot_table, page_inverse_remap, sorted_remap

    device = torch.device(args.device)
    page, cp, rank = args.page_size, args.cp_size, 0
    n_pages = -(-tokens // page)
    locs = torch.arange(tokens, device=device)
    table = owned_slot_table(page, cp, rank, n_pages, device)
    fast = page_inverse_remap(locs, page, cp, rank)
    slow = sorted_remap(locs, page, cp, rank, n_pages, slot_table=table)
    sorted_ms = time_ms(lambda: sorted_remap(locs, page, cp, rank, n_pages, slot_table=table))
    page_ms = time_ms(lambda: page_inverse_remap(locs, page, cp, rank))
    layers = get_preset(args.preset).n_layers
    return {
        "T": tokens,
        "cp_size": cp,
        "page_size": page,
        "equal": bool(torch.equal(fast, slow)),
        "sorted_ms": sorted_ms,
        "page_inverse_ms": page_ms,
        "per_call_ratio": sorted_ms / page_ms,
        "per_layer_ratio": 2 * sorted_ms / page_ms,  # baseline per layer (MLA + index) vs page inverse once per forward
        "per_forward_ratio": 2 * layers * sorted_ms / page_ms,
        "layers": layers,
    }

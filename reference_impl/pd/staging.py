"""The device leg of a layer-wise PD send on CUDA: rows out of the pool into pinned host memory,
on a side stream, timed against the prefill.

A prefill rank's send of layer ``l`` must not hold up layer ``l + 1``. :class:`SideStreamStaging`
runs everything a send does on the GPU on its own stream: it waits for the main stream (the layer
is stored), gathers the rows from the pool (``pool.read_*``, kernels on the side stream) and copies
them into pinned host memory with ``non_blocking=True`` (the copy engine, so the PCIe transfer
runs beside the main stream's kernels). Each staged block carries two timing events: when its
work started and when its bytes were in host memory. What the network leg then does (gloo in
:mod:`reference_impl.pd.transport`, an RDMA write in Mooncake or NIXL) starts from those bytes.

:func:`overlap` turns the events into the figure the PD report gives: how much of the staging
time ran before the layer loop's last kernel finished (hidden behind it), and how long the last
block landed after it (exposed).

No host sync in the layer loop: the side stream waits on the main one by an event, the pinned
buffers come from torch's caching host allocator, and nothing reads a device value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from reference_impl.pd.transport import RowBlock


@dataclass(frozen=True)
class StagedBlock:
    """A row block whose tensors are in pinned host memory once ``done`` has completed."""

    block: RowBlock  # host tensors (pinned); read them only after ``done``
    started: torch.cuda.Event  # side stream: the block's gather began (after the layer was stored)
    done: torch.cuda.Event  # side stream: the last byte is in host memory


class SideStreamStaging:
    """Gathers and copies row blocks to pinned host memory on one side stream per prefill rank."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.staged: list[StagedBlock] = []
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record()  # on the main stream, before the first loop: the origin of every interval

    def stage(self, read_block: Callable[[], RowBlock]) -> StagedBlock:
        """Run ``read_block`` (the pool reads) on the side stream after the main stream's work so far,
        then copy its tensors into pinned host memory there; returns at once."""
        main = torch.cuda.current_stream(self.device)
        started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(main)  # the layer's rows are stored
            started.record()
            block = read_block()  # allocated on the side stream: freed for its own later work only
            host = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                for t in (block.positions, block.mla, block.index, block.scale)
            ]
            for dst, src in zip(host, (block.positions, block.mla, block.index, block.scale)):
                dst.copy_(src, non_blocking=True)  # read n*(B+D+4+8) bytes over PCIe, write them to host
            done.record()
        positions, mla, index, scale = host
        staged = StagedBlock(
            RowBlock(block.request, block.layer, positions, mla, index, scale, block.part), started, done
        )
        self.staged.append(staged)
        return staged


@dataclass(frozen=True)
class Overlap:
    """How the staged sends of one prefill rank sat against its layer loop (milliseconds)."""

    staging_ms: float  # the sum of every block's interval, start to done
    hidden_ms: float  # the part of it before the layer loop's last kernel finished
    exposed_after_loop_ms: float  # the last block landed this long after the loop ended (0 if before)
    loop_end_ms: float  # from the staging's origin (before the first loop) to the last loop's end

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_ms / self.staging_ms if self.staging_ms else 1.0


def overlap(staging: SideStreamStaging, loop_end: torch.cuda.Event) -> Overlap:
    """Intervals of every staged block against ``loop_end`` (recorded on the main stream right after
    the layer loop); synchronizes the device (after the prefill, outside the layer loop)."""
    torch.cuda.synchronize(staging.device)
    origin = staging.origin
    end = origin.elapsed_time(loop_end)
    total = hidden = last = 0.0
    for s in staging.staged:
        a, b = origin.elapsed_time(s.started), origin.elapsed_time(s.done)
        total += b - a
        hidden += max(0.0, min(b, end) - a)
        last = max(last, b)
    return Overlap(total, hidden, max(0.0, last - end), end)

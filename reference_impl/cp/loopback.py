"""One rank of a CP group, alone in one process: the per-layer work of rank ``r`` of ``C`` on one device.

A single GPU cannot run ``C`` NCCL ranks (NCCL refuses two ranks on one device), and ranks that
share a GPU through gloo interleave their kernels and stage every collective through the host, so
their per-layer times say little about one rank of a real deployment. :class:`LoopbackGroup` is a
:class:`~reference_impl.cp.comm.CPGroup` whose collectives never leave the process: every slot of
an all-gather receives **this rank's own rows** (padded to the slot's length). Shapes, byte
counts, the collective sequence and every kernel the rank launches are those of rank ``r`` of
``C``; the **values** gathered from the "other ranks" are copies, so outputs are meaningless and
runs on it are for timing and memory only (``RunConfig(check=False)``).

What the time includes: the rank's whole layer (projections, the local copy that stands in for
each all-gather, rerange, store, full-view build, indexer, attention). What it leaves out: the
wire. ``wire_gbps`` models it: after each gather's local copy the collective's stream spins for
``bytes received / wire_gbps`` (``torch.cuda._sleep``, one thread, no memory traffic), so a
collective occupies its stream as long as an interconnect of that bandwidth would. The model is
optimistic (a real NCCL all-gather also uses SMs and HBM bandwidth); say which was used.
"""

from __future__ import annotations

import functools

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.comm import CollectiveRecorder, CPGroup


@functools.lru_cache(maxsize=8)
def _sleep_cycles_per_ms(device_index: int) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured once per device."""
    with torch.cuda.device(device_index):
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        stop.record()
        stop.synchronize()
        return cycles / start.elapsed_time(stop)


class LoopbackGroup(CPGroup):
    """Rank ``rank`` of a ``size``-rank CP group whose all-gathers copy this rank's rows into every slot.

    Args:
        rank: the rank to play, ``0 <= rank < size``.
        size: the CP group's size ``C``.
        device: where the rank's tensors live.
        wire_gbps: if set (CUDA only), each all-gather also holds its stream for
            ``(size - 1) x padded bytes / wire_gbps`` (1e9 B/s), a modeled interconnect.
    """

    def __init__(self, rank: int, size: int, device: torch.device | str, wire_gbps: float | None = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(f"LoopbackGroup: rank {rank} is not in a group of {size} ranks")
        dev = torch.device(device)
        if wire_gbps is not None and (wire_gbps <= 0 or dev.type != "cuda"):
            raise ConfigError(f"LoopbackGroup: wire_gbps={wire_gbps} needs a positive rate and a CUDA device")
        self._pg, self._size, self._rank, self.backend = None, size, rank, "loopback"
        self._device = dev
        self.debug = False
        self.recorder: CollectiveRecorder | None = None
        self.stats = []
        self._fused_gather = True
        self.wire_gbps = wire_gbps
        # Measured here, not at the first gather: the measurement synchronizes the device.
        self._cycles_per_ms = _sleep_cycles_per_ms(dev.index or 0) if wire_gbps is not None else 0.0

    @property
    def is_trivial(self) -> bool:
        return self._size == 1

    def __repr__(self) -> str:
        wire = f", wire_gbps={self.wire_gbps}" if self.wire_gbps else ""
        return f"LoopbackGroup(rank={self.rank}, size={self.size}, device={self.device}{wire})"

    def _exchange(self, out_bytes: torch.Tensor, send_bytes: torch.Tensor) -> None:
        # write C x padded bytes (what a real gather writes), read the padded send buffer
        out_bytes.copy_(send_bytes.unsqueeze(0).expand_as(out_bytes))
        if self.wire_gbps is not None:
            received = (self._size - 1) * send_bytes.numel()
            ms = received / self.wire_gbps / 1e6
            torch.cuda._sleep(int(ms * self._cycles_per_ms))

    def _broadcast_exchange(self, data: torch.Tensor, src: int) -> None:
        # A receiver writes the n bytes it receives (zeros here: the values are meaningless anyway)
        # and, with a modeled wire, waits n / wire_gbps; the source sends and writes nothing.
        if src == self._rank:
            return
        data.zero_()
        if self.wire_gbps is not None:
            ms = data.numel() / self.wire_gbps / 1e6
            torch.cuda._sleep(int(ms * self._cycles_per_ms))

    def barrier(self, tag: str = "barrier") -> None:
        """Nothing to wait for: the other ranks do not exist."""

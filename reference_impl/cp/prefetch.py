"""Phase 8: one-layer-ahead prefetch of the history MLA KV.

With phases 2-3 every layer materializes its history (the prefix pages) synchronously before its
attention can start. The history does not depend on the layer's own computation (the prefix was
cached before this forward), so while layer ``l`` computes, a side stream materializes layer
``l + 1``'s history MLA rows into the other of **two alternating buffers** (full-view KV buffers:
the history is written where attention reads it); layer ``l + 1`` waits on an event only when it
consumes its buffer. One wait policy: wait at consumption, nowhere else.

* MLA only: the indexer K history stays synchronous (v1 scope).
* The page gather is the store's, built once per batch and shared by every layer.
* Buffer reuse is safe: before the side stream overwrites a slot it waits for the event the main
  stream recorded after the slot's previous consumer (two layers back) used it.
* On CPU (and where no CUDA stream exists) the same code runs synchronously and stays correct.

Collectives: the prefetch's all-gather (tag ``prefetch_mla``) is issued at the start of layer
``l`` for layer ``l + 1``, in the same place on every rank, so the collective order is identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from reference_impl.config import ConfigError
from reference_impl.cp.kv_sharded import ShardedKV
from reference_impl.cp.kv_store import KVStore


class Stream(Protocol):
    """Where the prefetch work runs: ``submit`` returns a handle that ``wait`` blocks the consumer on."""

    def submit(self, work: Callable[[], None], slot: int) -> Any: ...
    def wait(self, handle: Any) -> None: ...
    def release(self, slot: int) -> None: ...
    def wait_ms(self) -> list[float]: ...


class InlineStream:
    """CPU: run the work at once; nothing to wait for."""

    def submit(self, work: Callable[[], None], slot: int) -> Any:
        work()
        return None

    def wait(self, handle: Any) -> None:
        return None

    def release(self, slot: int) -> None:
        return None

    def wait_ms(self) -> list[float]:
        """Nothing is ever waited for: the work ran at submit."""
        return []


class CudaSideStream:
    """A CUDA side stream with per-slot events: consumer waits on the producer, producer on the last consumer."""

    def __init__(self, device: torch.device) -> None:
        self.side = torch.cuda.Stream(device=device)
        self._consumed: list[torch.cuda.Event | None] = [None, None]
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def submit(self, work: Callable[[], None], slot: int) -> Any:
        released = self._consumed[slot]
        if released is not None:
            self.side.wait_event(released)  # the slot's previous consumer has finished reading it
        else:
            self.side.wait_stream(torch.cuda.current_stream())  # inputs written on the main stream
        with torch.cuda.stream(self.side):
            work()
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def wait(self, handle: Any) -> None:
        # Timing events on each side of the wait: their distance on the main stream is the time
        # the consumer stalled for the producer, the part of the prefetch that was not hidden.
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        torch.cuda.current_stream().wait_event(handle)
        after.record()
        self._waits.append((before, after))

    def wait_ms(self) -> list[float]:
        """The main stream's stall at each wait so far, in ms (synchronizes the device)."""
        torch.cuda.synchronize()
        return [before.elapsed_time(after) for before, after in self._waits]

    def release(self, slot: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        self._consumed[slot] = event


class MlaPrefetcher:
    """Prefetch ``store``'s history MLA rows one layer ahead into two alternating full-view KV buffers.

    Slot ``l % 2`` is a bf16 ``[view_len, kv_width]`` buffer: the side stream writes layer ``l``'s
    history rows into it, and layer ``l`` takes the whole buffer as its view's ``kv`` (the current
    rows are filled in on the main stream), so the history is written once, where it is read.
    """

    def __init__(self, store: KVStore, n_layers: int, stream: Stream | None = None) -> None:
        if not isinstance(store, ShardedKV):
            raise ConfigError(f"phase 8 prefetches history from sharded storage (phase 2); got a {store.name!r} store")
        self.store, self.n_layers = store, n_layers
        self.active = store.page_gather is not None and store.batch_kind != "fallback"
        if stream is None:
            device = store.pool.mla.device
            stream = CudaSideStream(device) if device.type == "cuda" else InlineStream()
        self.stream = stream
        # Allocated on the main stream, before any side-stream work: they live for the whole batch.
        self._buffers = [store.new_view_kv(), store.new_view_kv()] if self.active else []
        self._handles: list[Any] = [None, None]

    def launch(self, layer: int) -> None:
        """Start materializing ``layer``'s history into slot ``layer % 2`` (no-op past the last layer)."""
        if not self.active or layer >= self.n_layers:
            return
        slot = layer % 2
        buffer = self._buffers[slot]
        self._handles[slot] = self.stream.submit(lambda: self.store.materialize_history_mla(layer, buffer), slot)

    def consume(self, layer: int) -> torch.Tensor | None:
        """``layer``'s view KV buffer with its history rows written, after waiting for them (the one wait)."""
        if not self.active:
            return None
        slot = layer % 2
        self.stream.wait(self._handles[slot])
        return self._buffers[slot]

    def release(self, layer: int) -> None:
        """Mark ``layer``'s slot free once its consumer (this layer's attention) has been issued."""
        if self.active:
            self.stream.release(layer % 2)

    def exposed_wait_ms(self) -> list[float]:
        """Per consumed layer, how long the main stream stalled at the wait (``[]`` on CPU).

        The direct measure of what the prefetch failed to hide; read it after the layer loop.
        """
        return self.stream.wait_ms() if self.active else []

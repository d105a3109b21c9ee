"""The wire between a prefill rank and a decode rank: row blocks over one small interface.

A :class:`RowBlock` is what one prefill rank sends for one (request, layer): the positions of the
tokens it stores and their rows in the cache's byte layout (MLA bytes, index FP8 bytes, index
scale). Positions are request positions, never page ids, so the decode side places the rows in
pages it allocates itself.

:class:`BlockTransport` is the whole interface a backend implements (``send`` / ``recv`` of one
block between two ranks). :class:`TorchDistributedTransport` runs it on torch.distributed
point-to-point: gloo for host tensors, NCCL for CUDA tensors when each process has its own GPU.
A CUDA prefill rank on gloo hands over blocks already staged in pinned host memory
(:mod:`reference_impl.pd.staging`) with the event that says when their bytes are there; the
transport sends them from one ordered sender thread once that event completes, so the layer loop
never waits. :class:`InProcessTransport` is the same interface inside one process (the benchmark's
decode side, and tests). :class:`~reference_impl.pd.mooncake.MooncakeTransport` implements it with
one-sided writes into the decode's registered pool: its ``complete`` is the notice the decode waits
for, where the two-sided transports have nothing to add.

On torch.distributed a block travels as a header ``int64 [6]`` (request, layer, rows, MLA row
bytes, index row bytes, part) and then, if it has rows, four tensors: positions ``int64 [n]``, MLA
``uint8 [n, B]``, index ``uint8 [n, D]``, scale ``float32 [n]``. A block without index K (an
IndexShare shared layer, or a family whose rows are one byte string) has index width 0 and sends
neither index nor scale. ``part`` names what the rows are where a family ships several kinds per
layer (DeepSeek-V4: compressed entries, the window tail, the compressor state); 0 for the DSA rows.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from reference_impl.config import ConfigError

HEADER = 6


@dataclass(frozen=True)
class RowBlock:
    """One prefill rank's rows of one request and layer (CPU or CUDA tensors, one device)."""

    request: int
    layer: int
    positions: torch.Tensor  # int64 [n] request positions
    mla: torch.Tensor  # uint8 [n, mla row bytes]
    index: torch.Tensor  # uint8 [n, index head dim] (FP8 bytes); [n, 0] without index K
    scale: torch.Tensor  # float32 [n]; [0] without index K
    part: int = 0  # what the rows are, where a family ships several kinds per layer (module docstring)

    def __post_init__(self) -> None:
        n = self.positions.shape[0]
        scales = n if self.has_index else 0
        if not (self.mla.shape[0] == self.index.shape[0] == n and self.scale.shape[0] == scales):
            raise ConfigError(
                f"request {self.request} layer {self.layer}: a row block's tensors disagree on the row count"
            )

    @property
    def has_index(self) -> bool:
        """Whether the rows carry index K (and its scales): not on an IndexShare shared layer."""
        return self.index.dim() == 2 and self.index.shape[1] > 0

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def payload_bytes(self) -> int:
        """Cache bytes carried (MLA, index, scale): what the rows occupy at rest."""
        return sum(t.numel() * t.element_size() for t in (self.mla, self.index, self.scale))


class Pending(Protocol):
    """A send in flight: ``wait()`` returns once the block has left (and may be reused)."""

    def wait(self) -> None: ...


class BlockTransport(Protocol):
    """Moves row blocks between ranks: ``send`` blocks, ``isend`` returns at once (layer-wise streaming).

    ``ready``: the block's tensors hold their bytes only once this CUDA event completes (they were
    staged on a side stream); the transport must not read them before, and must not make the
    caller wait for it."""

    def send(self, block: RowBlock, dst: int) -> None: ...

    def isend(
        self, block: RowBlock, dst: int, header: torch.Tensor | None = None, ready: torch.cuda.Event | None = None
    ) -> Pending: ...

    def complete(self, request: int, dst: int) -> Pending:
        """Every block of ``request`` has been posted: a one-sided transport tells ``dst`` that its
        rows are all there once they are; a two-sided one has nothing to add (the receiver counts)."""
        ...

    def recv(self, src: int) -> RowBlock: ...


def headers(
    request: int,
    n_layers: int,
    n_rows: int,
    mla_width: int,
    index_width: int,
    device: torch.device | str = "cpu",
    index_layers: tuple[int, ...] | None = None,
    part: int = 0,
) -> torch.Tensor:
    """The headers of a request's blocks for layers ``0 .. n_layers-1``: ``int64 [n_layers, 6]``;
    ``index_layers``: the layers whose rows carry index K (``None``: every layer)."""
    return torch.tensor(
        [
            [
                request,
                layer,
                n_rows,
                mla_width,
                index_width if index_layers is None or layer in index_layers else 0,
                part,
            ]
            for layer in range(n_layers)
        ],
        dtype=torch.long,
        device=device,
    )


class TorchDistributedTransport:
    """:class:`BlockTransport` on torch.distributed point-to-point (the default process group).

    ``device``: where received tensors land and what the backend moves (``cpu`` for gloo; with
    NCCL, the process's own GPU).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._sender: ThreadPoolExecutor | None = None  # one thread: the sends to a rank stay in order

    def _wire(self, block: RowBlock, header: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Header then the four tensors; ``header`` prebuilt (:func:`headers`) keeps a layer loop free
        of host-built tensors."""
        if header is None:
            header = headers(
                block.request,
                block.layer + 1,
                block.n_rows,
                block.mla.shape[1],
                block.index.shape[1],
                self.device,
                part=block.part,
            )[block.layer]
        parts: tuple[torch.Tensor, ...] = (block.positions, block.mla) if block.n_rows else ()
        if block.n_rows and block.has_index:
            parts += (block.index, block.scale)
        return [header, *(t.to(self.device).contiguous() for t in parts)]

    def send(self, block: RowBlock, dst: int) -> None:
        for tensor in self._wire(block):
            dist.send(tensor, dst)

    def isend(
        self, block: RowBlock, dst: int, header: torch.Tensor | None = None, ready: torch.cuda.Event | None = None
    ) -> Pending:
        tensors = self._wire(block, header)
        if ready is None:
            return _Sends([dist.isend(tensor, dst) for tensor in tensors], tensors)
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-send")

        def send_when_staged() -> None:
            ready.synchronize()  # the sender thread waits for the copy, never the layer loop
            for tensor in tensors:
                dist.send(tensor, dst)

        return _Future(self._sender.submit(send_when_staged))

    def complete(self, request: int, dst: int) -> Pending:
        return _Event(None)  # the decode counts the blocks it receives

    def close(self) -> None:
        """Stop the sender thread (after every pending send was waited for)."""
        if self._sender is not None:
            self._sender.shutdown(wait=True)
            self._sender = None

    def recv(self, src: int) -> RowBlock:
        header = torch.empty(HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, src)
        request, layer, n, mla_width, index_width, part = header.tolist()
        parts = [
            torch.empty(n, dtype=torch.long, device=self.device),
            torch.empty(n, mla_width, dtype=torch.uint8, device=self.device),
            torch.empty(n, index_width, dtype=torch.uint8, device=self.device),
            torch.empty(n if index_width else 0, dtype=torch.float32, device=self.device),
        ]
        if n:
            for tensor in parts if index_width else parts[:2]:
                dist.recv(tensor, src)
        positions, mla, index, scale = parts
        return RowBlock(request, layer, positions, mla, index, scale, part)


class InProcessTransport:
    """:class:`BlockTransport` inside one process, which plays both ends: ``isend`` posts the block
    from ``sender_rank`` to ``dst``'s mailbox, ``recv(src, dst)`` takes the oldest block ``src``
    posted to ``dst`` (the benchmark's decode side; tests)."""

    def __init__(self, sender_rank: int = 0) -> None:
        self._mail: dict[tuple[int, int], deque[tuple[RowBlock, torch.cuda.Event | None]]] = {}
        self.rank = sender_rank

    def send(self, block: RowBlock, dst: int) -> None:
        self.isend(block, dst)

    def isend(
        self, block: RowBlock, dst: int, header: torch.Tensor | None = None, ready: torch.cuda.Event | None = None
    ) -> Pending:
        self._mail.setdefault((self.rank, dst), deque()).append((block, ready))
        return _Event(ready)

    def complete(self, request: int, dst: int) -> Pending:
        return _Event(None)

    def recv(self, src: int, dst: int = 0) -> RowBlock:
        mailbox = self._mail.get((src, dst))
        if not mailbox:
            raise ConfigError(f"rank {dst} expects a row block from rank {src}, and none was sent")
        block, ready = mailbox.popleft()
        if ready is not None:
            ready.synchronize()
        return block


class _Event:
    """A send that is complete once its staging event is (in-process: nothing else to wait for)."""

    def __init__(self, ready: torch.cuda.Event | None) -> None:
        self.ready = ready

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class _Future:
    """A send handed to the sender thread."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()  # re-raises what the sender thread hit


class _Sends:
    """The point-to-point sends of one block; holds the tensors until they have left."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self.works, self.tensors = works, tensors

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.tensors = []

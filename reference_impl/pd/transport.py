"""The wire between a prefill rank and a decode rank: row blocks over one small interface.

A :class:`RowBlock` is what one prefill rank sends for one (request, layer): the positions of the
tokens it stores and their rows in the cache's byte layout (MLA bytes, index FP8 bytes, index
scale). Positions are request positions, never page ids, so the decode side places the rows in
pages it allocates itself.

:class:`BlockTransport` is the whole interface a backend implements (``send`` / ``recv`` of one
block between two ranks). :class:`TorchDistributedTransport` runs it on torch.distributed
point-to-point: gloo for CPU tensors (and CUDA tensors staged through the host when processes share
a GPU), NCCL for CUDA tensors when each process has its own GPU. A Mooncake or NIXL backend would
implement the same two methods with its own registration and RDMA writes; nothing else changes.

On torch.distributed a block travels as a header ``int64 [6]`` (request, layer, rows, MLA row
bytes, index row bytes, 0) and then, if it has rows, four tensors: positions ``int64 [n]``, MLA
``uint8 [n, B]``, index ``uint8 [n, D]``, scale ``float32 [n]``.
"""

from __future__ import annotations

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
    index: torch.Tensor  # uint8 [n, index head dim] (FP8 bytes)
    scale: torch.Tensor  # float32 [n]

    def __post_init__(self) -> None:
        n = self.positions.shape[0]
        if not (self.mla.shape[0] == self.index.shape[0] == self.scale.shape[0] == n):
            raise ConfigError(f"request {self.request} layer {self.layer}: a row block's tensors disagree on the row count")

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
    """Moves row blocks between ranks: ``send`` blocks, ``isend`` returns at once (layer-wise streaming)."""

    def send(self, block: RowBlock, dst: int) -> None: ...

    def isend(self, block: RowBlock, dst: int, header: torch.Tensor | None = None) -> Pending: ...

    def recv(self, src: int) -> RowBlock: ...


def headers(request: int, n_layers: int, n_rows: int, mla_width: int, index_width: int,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """The headers of a request's blocks for layers ``0 .. n_layers-1``: ``int64 [n_layers, 6]``."""
    return torch.tensor([[request, layer, n_rows, mla_width, index_width, 0] for layer in range(n_layers)],
                        dtype=torch.long, device=device)


class TorchDistributedTransport:
    """:class:`BlockTransport` on torch.distributed point-to-point (the default process group).

    ``device``: where received tensors land and what the backend moves (``cpu`` for gloo; with
    NCCL, the process's own GPU).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def _wire(self, block: RowBlock, header: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Header then the four tensors; ``header`` prebuilt (:func:`headers`) keeps a layer loop free
        of host-built tensors."""
        if header is None:
            header = headers(block.request, block.layer + 1, block.n_rows, block.mla.shape[1], block.index.shape[1],
                             self.device)[block.layer]
        parts = (block.positions, block.mla, block.index, block.scale) if block.n_rows else ()
        return [header, *(t.to(self.device).contiguous() for t in parts)]

    def send(self, block: RowBlock, dst: int) -> None:
        for tensor in self._wire(block):
            dist.send(tensor, dst)

    def isend(self, block: RowBlock, dst: int, header: torch.Tensor | None = None) -> Pending:
        tensors = self._wire(block, header)
        return _Sends([dist.isend(tensor, dst) for tensor in tensors], tensors)

    def recv(self, src: int) -> RowBlock:
        header = torch.empty(HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, src)
        request, layer, n, mla_width, index_width, _ = header.tolist()
        parts = [
            torch.empty(n, dtype=torch.long, device=self.device),
            torch.empty(n, mla_width, dtype=torch.uint8, device=self.device),
            torch.empty(n, index_width, dtype=torch.uint8, device=self.device),
            torch.empty(n, dtype=torch.float32, device=self.device),
        ]
        if n:
            for tensor in parts:
                dist.recv(tensor, src)
        return RowBlock(request, layer, *parts)


class _Sends:
    """The point-to-point sends of one block; holds the tensors until they have left."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self.works, self.tensors = works, tensors

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.tensors = []

"""The scaffolding of a family's PD payload (:class:`~reference_impl.families.base.PDPayload`): what is the
same whatever the family's cache parts are.

A family ships its cache as **parts**, each a :class:`~reference_impl.pd.transport.RowBlock` with a
``part`` tag, its rows one region of bytes (:func:`part_block`). :class:`PartStreamer` is a prefill
rank's layer-wise send of them: the family plans, before a chunk's layer loop, the rows each block will
hold (:meth:`PartStreamer.expect`) and reads a block (:meth:`PartStreamer.block`); the streamer posts one
block per part, layer and finished request (:class:`~reference_impl.pd.stream.LayerSends`) and checks each
block holds the rows planned. The decode side is :class:`~reference_impl.pd.arena.BookedArena`.

The **replica sender** of a request (:func:`replica_sender`) is the rank that owns its last token's slot:
every rank holds the replicated parts, exactly one ships them, and requests spread that work over the ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial

import torch

from reference_impl.config import RunConfig, compute_dtype
from reference_impl.cp.ownership import Ownership
from reference_impl.errors import ConfigError

from .stream import LayerSends
from .transport import BlockTransport, RowBlock


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, width]`` of any dtype -> ``uint8 [n, bytes per row]`` (the wire's row form; empty ones too)."""
    return t.contiguous().view(torch.uint8)


def part_block(request: int, layer: int, part: int, positions: torch.Tensor, rows: torch.Tensor) -> RowBlock:
    """A block of one part: ``rows`` (``uint8 [n, row bytes]``) at ``positions``, no index bytes or scales."""
    return RowBlock(request, layer, positions, rows, rows.new_empty(rows.shape[0], 0), torch.zeros(0), part)


def replica_sender(own: Ownership, locs: torch.Tensor) -> int:
    """The rank that ships a request's replicated parts: the owner of its last token's slot
    (``locs``: the request's logical locs)."""
    return int(own.owner(locs[-1:].cpu())[0])


def next_token_inputs(run: RunConfig, device: torch.device) -> list[torch.Tensor]:
    """Per request, the layer-0 input ``[1, dim]`` of the token after its prompt (a stand-in for the
    sampled token's embedding; the workload's inputs are seeded hidden states too), from ``seed + 2``."""
    gen = torch.Generator(device=device).manual_seed(run.seed + 2)
    dtype = compute_dtype(run, device)
    return [torch.randn(1, run.model.dim, generator=gen, device=device).to(dtype) for _ in run.requests]


def relative_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """The largest difference of ``got`` from ``want``, each relative to the reference's largest value
    (at least 1): the decode's next tokens against the oracle's step."""
    err = 0.0
    for a, b in zip(got, want):
        scale = max(1.0, b.float().abs().max().item())
        err = max(err, (a.float().cpu() - b.float().cpu()).abs().max().item() / scale)
    return err


class PartStreamer(LayerSends):
    """A prefill rank's layer-wise send of a family's cache parts (an engine
    :class:`~reference_impl.engine.LayerStoredHook`): after layer ``l`` is stored, one block per part for
    each request the chunk finishes, empty where this rank ships nothing of it, so a two-sided decode knows
    how many blocks to expect.

    A family's streamer implements ``begin_chunk`` (check the store, then :meth:`start_chunk` and one
    :meth:`expect` per request, layer and part), :meth:`parts` and :meth:`block`."""

    def __init__(self, transport: BlockTransport, decode_rank: int, part_names: dict[int, str]) -> None:
        super().__init__(transport, decode_rank)
        self.part_names = part_names
        self.requests: list[int] = []  # the chunk's finished requests
        self.n_layers = 0
        self.headers: dict[tuple[int, int, int], tuple[int, torch.Tensor]] = {}  # (req, layer, part) -> rows, header

    def start_chunk(self, device: torch.device, finished: Iterable[int], n_layers: int) -> None:
        """Before a chunk's plan: its finished requests, the store's device and layer count."""
        self.stage_on(device)
        self.requests, self.n_layers, self.headers = list(finished), n_layers, {}

    def expect(self, request: int, layer: int, part: int, rows: int, row_bytes: int) -> None:
        """Plan a block: the rows it will hold, and its wire header, built here: a tensor built from host data
        inside the layer loop counts as a host sync (phase 6)."""
        header = torch.tensor([request, layer, rows, row_bytes, 0, part], dtype=torch.long)
        self.headers[request, layer, part] = (rows, header)

    def parts(self, layer: int) -> tuple[int, ...]:
        """The parts ``layer`` ships."""
        raise NotImplementedError

    def block(self, layer: int, request: int, part: int) -> RowBlock:
        """This rank's ``part`` of ``request`` on ``layer`` (no rows where it ships nothing of it); on CUDA
        called on the side stream."""
        raise NotImplementedError

    def layer_stored(self, layer: int) -> None:
        for req in self.requests:
            for part in self.parts(layer):
                rows, header = self.headers[req, layer, part]
                block = self.post(req, header, partial(self.block, layer, req, part))
                if block.n_rows != rows:  # shapes only: no device read
                    raise ConfigError(
                        f"request {req} layer {layer}: this rank holds {block.n_rows} {self.part_names[part]} rows, "
                        f"its ownership says {rows}"
                    )
            if layer == self.n_layers - 1:
                self.finish(req)

"""The scaffolding of a family's PD payload (:class:`~reference_impl.families.base.PDPayload`): what is the
same whatever the family's cache parts are.

A family ships its cache as **parts**, each a :class:`~reference_impl.pd.transport.RowBlock` with a
``part`` tag, its rows one region of bytes (:func:`part_block`), and describes them for a run as a
:class:`PartLayout`: which parts each layer ships, their rows and widths, and who ships them. A
**sharded** part's rows each come from the rank that stores it; a **replicated** part, which every rank
holds, comes whole from the request's **replica sender** (:func:`replica_sender`: the rank that owns its
last token's slot), so exactly one rank ships it and requests spread that work over the ranks.

From the layout: what a rank ships (:func:`rows_shipped`, :func:`bytes_to_ship`), the decode's arena
(:func:`arena_shapes` for a :class:`~reference_impl.pd.arena.BookedArena`), and a prefill rank's
layer-wise send (:class:`PartStreamer`), for which a family reads each block itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any, Protocol

import torch

from reference_impl.config import RunConfig, compute_dtype
from reference_impl.cp.ownership import Ownership
from reference_impl.errors import ConfigError

from .arena import RegionKey
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


class PartLayout(Protocol):
    """A family's cache parts for one run (the module docstring)."""

    part_names: dict[int, str]  # each part's name in errors
    n_layers: int

    def parts(self, layer: int) -> tuple[int, ...]:
        """The parts ``layer`` ships."""
        ...

    def row_bytes(self, layer: int, part: int) -> int: ...

    def first_and_count(self, layer: int, part: int, n_tokens: int) -> tuple[int, int]:
        """``(first position, rows)`` of a request's ``part`` on ``layer`` after ``n_tokens`` tokens."""
        ...

    def rows_stored(self, own: Ownership, rank: int, locs: torch.Tensor, layer: int, part: int) -> int | None:
        """The rows of a sharded ``part`` that ``rank`` stores (``locs``: the request's logical locs, host);
        None for a replicated part."""
        ...

    def ships_replicas(self, own: Ownership, locs: torch.Tensor, rank: int) -> bool:
        """Whether ``rank`` ships the replicated parts of the request at ``locs`` (host)."""
        ...


def rows_shipped(
    layout: PartLayout, own: Ownership, rank: int, locs: torch.Tensor, layer: int, part: int, replica: bool
) -> int:
    """The rows of a request's ``part`` on ``layer`` that ``rank`` ships (``locs``: the request's logical
    locs, host, one per token; ``replica``: whether ``rank`` is its replica sender)."""
    stored = layout.rows_stored(own, rank, locs, layer, part)
    if stored is not None:
        return stored
    return layout.first_and_count(layer, part, len(locs))[1] if replica else 0


def bytes_to_ship(layout: PartLayout, run: RunConfig, rank: int, request_locs: dict[int, torch.Tensor]) -> int:
    """What ``rank`` is to ship of every request, counted from the ownership (its page table's locs) and the
    layout's arithmetic (``request_locs``: request -> its logical locs, :func:`reference_impl.engine.request_locs`)."""
    own = Ownership(run.cp_size, run.interleave, run.page_size)
    total = 0
    for req, locs in request_locs.items():
        host = locs[: run.requests[req].total].cpu()
        replica = layout.ships_replicas(own, host, rank)
        for layer in range(layout.n_layers):
            for part in layout.parts(layer):
                total += rows_shipped(layout, own, rank, host, layer, part, replica) * layout.row_bytes(layer, part)
    return total


def arena_shapes(layout: PartLayout, totals: Sequence[int]) -> Iterator[tuple[RegionKey, int, int, int]]:
    """The decode's regions, request by request (``totals``: each request's tokens):
    ``((request, layer, part), first position, rows, row bytes)``."""
    for req, n in enumerate(totals):
        for layer in range(layout.n_layers):
            for part in layout.parts(layer):
                yield (req, layer, part), *layout.first_and_count(layer, part, n), layout.row_bytes(layer, part)


class PartStreamer(LayerSends):
    """A prefill rank's layer-wise send of a family's cache parts (an engine
    :class:`~reference_impl.engine.LayerStoredHook`): after layer ``l`` is stored, one block per part for
    each request the chunk finishes, empty where this rank ships nothing of it, so a two-sided decode knows
    how many blocks to expect; on CUDA the reads and the copy to pinned host run on a side stream
    (:mod:`reference_impl.pd.staging`).

    A family's streamer implements ``begin_chunk`` (check the store, then :meth:`start_chunk` and one
    :meth:`plan_request` per finished request) and :meth:`block`."""

    def __init__(self, transport: BlockTransport, decode_rank: int, layout: PartLayout) -> None:
        super().__init__(transport, decode_rank)
        self.layout = layout
        self.requests: list[int] = []  # the chunk's finished requests
        self.headers: dict[tuple[int, int, int], tuple[int, torch.Tensor]] = {}  # (req, layer, part) -> rows, header

    def start_chunk(self, device: torch.device, finished: Iterable[int]) -> None:
        """Before a chunk's plan: its finished requests, and the store's device."""
        self.stage_on(device)
        self.requests, self.headers = list(finished), {}

    def plan_request(self, own: Ownership, rank: int, request: int, locs: torch.Tensor) -> bool:
        """Plan a finished request's blocks (``locs``: its logical locs): the rows each will hold and its wire
        header, built here: a tensor built from host data inside the layer loop counts as a host sync
        (phase 6). Whether this rank ships the request's replicated parts."""
        layout, host = self.layout, locs.cpu()
        replica = layout.ships_replicas(own, host, rank)
        for layer in range(layout.n_layers):
            for part in layout.parts(layer):
                rows, width = rows_shipped(layout, own, rank, host, layer, part, replica), layout.row_bytes(layer, part)
                header = torch.tensor([request, layer, rows, width, 0, part], dtype=torch.long)
                self.headers[request, layer, part] = (rows, header)
        return replica

    def block(self, layer: int, request: int, part: int) -> RowBlock:
        """This rank's ``part`` of ``request`` on ``layer`` (no rows where it ships nothing of it); on CUDA
        called on the side stream."""
        raise NotImplementedError

    def layer_stored(self, layer: int) -> None:
        for req in self.requests:
            for part in self.layout.parts(layer):
                rows, header = self.headers[req, layer, part]
                block = self.post(req, header, partial(self.block, layer, req, part))
                if block.n_rows != rows:  # shapes only: no device read
                    raise ConfigError(
                        f"request {req} layer {layer}: this rank holds {block.n_rows} "
                        f"{self.layout.part_names[part]} rows, its ownership says {rows}"
                    )
            if layer == self.layout.n_layers - 1:
                self.finish(req)


class PartPayload:
    """What a family's :class:`~reference_impl.families.base.PDPayload` does the same way whatever its parts
    (``layout``): count what a rank ships, make the next token's inputs, compare the decode's next tokens with
    the oracle's step. A family adds its sender, decoder and cache checks, and :meth:`step`."""

    def __init__(self, run: RunConfig, layout: PartLayout) -> None:
        self.run, self.layout = run, layout

    def bytes_at_rest(self, rank: int, request_locs: dict[int, torch.Tensor]) -> int:
        return bytes_to_ship(self.layout, self.run, rank, request_locs)

    def next_inputs(self, device: torch.device) -> list[torch.Tensor]:
        return next_token_inputs(self.run, device)

    def step(self, model: torch.nn.Module, caches: Any, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each request's next token (``inputs[req]``) through ``model`` over (copies of) ``caches``
        ``[layer][request]``: its final hidden state."""
        raise NotImplementedError

    def next_token_error(
        self, model: torch.nn.Module, oracle: Any, inputs: Sequence[torch.Tensor], got: Sequence[torch.Tensor]
    ) -> float:
        """The decode's next tokens ``got`` against the same step over the oracle's own caches
        (:func:`relative_error`)."""
        return relative_error(got, self.step(model, oracle.caches, inputs))

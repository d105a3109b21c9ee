"""The decode's booked arena: a family's own cache parts in one byte buffer, every row booked exactly once.

A family whose decode lays out its own cache (:meth:`~reference_impl.families.base.PDPayload.decoder`)
names each region, per (request, layer, part): its first position, its rows and the bytes of a row.
:class:`BookedArena` allocates them in one ``uint8`` buffer, places a two-sided transport's blocks
(:meth:`~BookedArena.receive`) at ``position - first position``, books the rows a one-sided transport
wrote (:meth:`~BookedArena.landed`) and checks that every row arrived once
(:meth:`~BookedArena.check_complete`): a row no prefill rank shipped, or two did, is an error naming it.
Over Mooncake the decode registers the arena (:class:`ArenaReceiver`) and publishes its regions
(:class:`ArenaTarget`, a :class:`~reference_impl.pd.mooncake.WriteTarget`) for the prefill ranks to write into.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from reference_impl.errors import ConfigError

from .mooncake import Completion, await_completions
from .mooncake_engine import MooncakeEngine
from .transport import RowBlock

ALIGN = 16  # each region starts on a multiple of this many bytes: the families read regions as float32 / bf16

RegionKey = tuple[int, int, int]  # (request, layer, part)


@dataclass(frozen=True)
class Region:
    """One request's ``part`` of one layer in the decode's arena."""

    offset: int  # bytes from the arena's start
    row_bytes: int
    first: int  # position of row 0
    rows: int

    def row_indices(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The region's rows of ``positions`` (host int64), or None where one falls outside it."""
        rows = positions.cpu() - self.first
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            return None
        return rows


def _outside(key: RegionKey, name: str, region: Region, positions: torch.Tensor) -> ConfigError:
    req, layer, _ = key
    return ConfigError(
        f"request {req} layer {layer}: {name} positions {int(positions.min())}.."
        f"{int(positions.max())} outside the decode's [{region.first}, {region.first + region.rows})"
    )


def _wrong_width(block: RowBlock, region: Region | None) -> bool:
    """Whether ``block``'s rows are not ``region``'s (a part block carries one row region, no index)."""
    return region is None or block.has_index or bool(block.n_rows and block.mla.shape[1] != region.row_bytes)


class BookedArena:
    """The decode's cache of every request as regions of one arena, each row booked once (the module docstring).

    ``shapes``: per region, ``((request, layer, part), first position, rows, row bytes)``, in arena order;
    ``part_names``: each part's name in errors."""

    def __init__(
        self,
        shapes: Iterable[tuple[RegionKey, int, int, int]],
        part_names: Mapping[int, str],
        device: torch.device | str = "cpu",
    ) -> None:
        self.part_names = dict(part_names)
        self.regions: dict[RegionKey, Region] = {}
        offset = 0
        for key, first, rows, width in shapes:
            self.regions[key] = Region(offset, width, first, rows)
            offset = -(-(offset + rows * width) // ALIGN) * ALIGN
        self.buffer = torch.zeros(offset, dtype=torch.uint8, device=device)
        self.written = {key: torch.zeros(r.rows, dtype=torch.int32) for key, r in self.regions.items()}
        self.bytes_received = 0

    @property
    def blocks_per_rank(self) -> int:
        """Blocks each prefill rank sends (one per part, layer and request, empty ones included)."""
        return len(self.regions)

    def view(self, req: int, layer: int, part: int) -> torch.Tensor:
        """``uint8 [rows, row bytes]``: the region in the arena."""
        r = self.regions[req, layer, part]
        return self.buffer[r.offset : r.offset + r.rows * r.row_bytes].view(r.rows, r.row_bytes)

    def typed(self, req: int, layer: int, part: int, dtype: torch.dtype) -> torch.Tensor:
        """The region as ``dtype [rows, row bytes / itemsize]`` (a view of the arena)."""
        region = self.view(req, layer, part)
        width = region.shape[1] * region.element_size() // dtype.itemsize  # named: a region may have no rows
        return region.reshape(-1).view(dtype).reshape(region.shape[0], width)

    def _rows(self, req: int, layer: int, part: int, positions: torch.Tensor) -> torch.Tensor:
        key = (req, layer, part)
        if key not in self.regions:
            name = self.part_names.get(part, part)
            raise ConfigError(f"request {req} layer {layer}: the decode keeps no {name} rows there")
        rows = self.regions[key].row_indices(positions)
        if rows is None:
            raise _outside(key, self.part_names[part], self.regions[key], positions)
        return rows

    def _book(self, req: int, layer: int, part: int, rows: torch.Tensor) -> None:
        counts = self.written[req, layer, part]
        if bool((counts[rows] > 0).any()):
            raise ConfigError(f"request {req} layer {layer}: a {self.part_names[part]} row arrived twice")
        counts[rows] += 1

    def receive(self, block: RowBlock) -> None:
        """Place a block's rows in their region (two-sided transports)."""
        rows = self._rows(block.request, block.layer, block.part, block.positions)
        r = self.regions[block.request, block.layer, block.part]
        if _wrong_width(block, r):
            raise ConfigError(
                f"request {block.request} layer {block.layer}: {self.part_names[block.part]} rows of "
                f"{block.mla.shape[1]} bytes, the decode's are {r.row_bytes}"
            )
        self._book(block.request, block.layer, block.part, rows)
        view = self.view(block.request, block.layer, block.part)
        view.index_copy_(0, rows.to(view.device), block.mla.to(view.device))
        self.bytes_received += block.payload_bytes

    def landed(self, req: int, layer: int, part: int, positions: torch.Tensor) -> None:
        """Book rows a one-sided transport wrote into the arena itself."""
        self._book(req, layer, part, self._rows(req, layer, part, positions))

    def check_complete(self) -> None:
        """:class:`ConfigError` unless every row of every region arrived exactly once."""
        for (req, layer, part), counts in self.written.items():
            if bool((counts != 1).any()):
                row = int((counts != 1).nonzero()[0])
                first = self.regions[req, layer, part].first
                raise ConfigError(
                    f"request {req} layer {layer}: the decode's {self.part_names[part]} row at position "
                    f"{first + row} arrived {int(counts[row])} times (no prefill rank shipped it, or two did)"
                )

    def mooncake_receiver(self, engine: MooncakeEngine) -> ArenaReceiver:
        return ArenaReceiver(self, engine)

    def target(self, session_id: str) -> ArenaTarget:
        """Where the prefill ranks write (the arena registered with the decode's Mooncake engine)."""
        return ArenaTarget(session_id, self.buffer.data_ptr(), dict(self.regions), self.part_names)


@dataclass(frozen=True)
class ArenaTarget:
    """A :class:`~reference_impl.pd.mooncake.WriteTarget`: the decode's arena and its regions."""

    session_id: str
    arena_address: int
    regions: dict[RegionKey, Region]
    part_names: dict[int, str]

    @property
    def notify_address(self) -> int:
        return self.arena_address

    def check_widths(self, rank: int, block: RowBlock) -> None:
        if _wrong_width(block, self.regions.get((block.request, block.layer, block.part))):
            raise ConfigError(
                f"rank {rank} sends {self.part_names.get(block.part, block.part)} rows of request {block.request} "
                f"layer {block.layer} the decode has no region of that width for"
            )

    def destinations(self, request: int, layer: int, positions: torch.Tensor, part: int = 0) -> tuple[torch.Tensor]:
        key = (request, layer, part)
        region = self.regions[key]
        rows = region.row_indices(positions)
        if rows is None:
            raise _outside(key, self.part_names[part], region, positions)
        return (self.arena_address + region.offset + rows * region.row_bytes,)


class ArenaReceiver:
    """The decode side over Mooncake: registers the arena, publishes :attr:`target`, books each
    completion's blocks (:attr:`~reference_impl.pd.mooncake.Completion.blocks`)."""

    def __init__(self, arena: BookedArena, engine: MooncakeEngine) -> None:
        self.arena, self.engine = arena, engine
        engine.register(arena.buffer)
        self.target = arena.target(engine.session_id)

    def wait(
        self, requests: Sequence[int], prefill_ranks: Sequence[int], n_layers: int, deadline_s: float
    ) -> list[Completion]:
        """One completion per (request, prefill rank); :class:`~reference_impl.pd.mooncake.TransferTimeoutError`
        names the missing."""

        def book(done: Completion) -> None:
            for layer, part, runs in done.blocks:
                pieces = [torch.arange(a, a + n) for a, n in runs]
                positions = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
                self.arena.landed(done.request, layer, part, positions)
            self.arena.bytes_received += done.nbytes

        return await_completions(self.engine, requests, prefill_ranks, deadline_s, book)

    def close(self) -> None:
        self.engine.unregister(self.arena.buffer)

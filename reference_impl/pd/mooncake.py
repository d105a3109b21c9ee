"""PD over the Mooncake Transfer Engine: each prefill rank writes its rows into the decode's pool.

The decode and the prefill ranks each start a :class:`~reference_impl.pd.mooncake_engine.MooncakeEngine`.

* **The decode registers its pool** (:class:`MooncakeReceiver`): the two buffers of its
  :class:`~reference_impl.pd.dcp.DcpDecodeShard` (MLA rows ``uint8 [L, slots, B]``, index pages
  ``uint8 [L, pages, P * (D + 4)]``), allocates its own pages per request, and publishes a
  :class:`DecodeTarget`: its session id, the two buffers' addresses and geometry, and per request
  the decode slot of every position. The driver hands it to the prefill ranks over the existing
  control path (a torch.distributed broadcast) before the prefill starts.
* **Each prefill rank writes its rows** (:class:`MooncakeTransport`, a
  :class:`~reference_impl.pd.transport.BlockTransport`): the layer-wise send posts one row block
  per (request, layer) as today; the transport's one sender thread copies the block into its
  registered send buffer (``[MLA n*B | index n*D | scale n*4]``) and writes it with one batch of
  one-sided writes: the MLA row, the index bytes and the scale of each row go to the addresses of
  that position's decode slot (runs of adjacent slots merged into one piece). Nothing is received
  by the decode's CPU; bytes written equal the rows the rank holds at rest.
* **Completion**: after a request's last layer, the transport sends a zero-length write that
  carries a Mooncake notification (:class:`Completion`: request, prefill rank, layers, rows,
  bytes, positions as runs). Mooncake sends a batch's notification only once the batch completed,
  and one rank's batches complete in order (one sender thread, synchronous writes), so when the
  decode holds the notification every byte of that rank's rows of that request is in its pool.
  The decode's :meth:`MooncakeReceiver.wait` collects one per (request, prefill rank) and books
  them with the shard's exactly-once check; a deadline turns a missing one into an error naming it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from reference_impl.errors import ConfigError

from .dcp import DcpDecodeShard
from .mooncake_engine import MooncakeEngine
from .transport import Pending, RowBlock, _Future

NOTIFY_NAME = "dsacp-pd-complete"
SCALE_BYTES = 4


class TransferTimeoutError(RuntimeError):
    """The decode waited past its deadline for prefill ranks' completions (the missing ones named)."""


@dataclass(frozen=True)
class DecodeTarget:
    """Where a decode wants each request's rows: what a prefill rank needs to write them itself."""

    session_id: str  # the decode engine's ``host:port``
    mla_address: int  # MLA rows: uint8 [n_layers, n_slots, mla_bytes]
    index_address: int  # index pages: uint8 [n_layers, n_pages, page_size * (index_dim + 4)]
    n_layers: int
    n_pages: int
    page_size: int
    mla_bytes: int
    index_dim: int
    slots: tuple[torch.Tensor, ...]  # per request: int64 [n_tokens], the decode slot of each position
    index_layers: tuple[int, ...] | None = None  # layers with index pages, in row order (IndexShare); None: all

    @property
    def n_slots(self) -> int:
        return self.n_pages * self.page_size

    @property
    def notify_address(self) -> int:
        return self.mla_address

    @property
    def index_page_bytes(self) -> int:
        return self.page_size * (self.index_dim + SCALE_BYTES)

    def check_widths(self, rank: int, block: RowBlock) -> None:
        """A block's row widths must be the pool's (index K only on the layers that keep it)."""
        keeps = self.index_layers is None or block.layer in self.index_layers
        dim = self.index_dim if keeps else 0
        width, got_dim = block.mla.shape[1], block.index.shape[1]
        if (width, got_dim) != (self.mla_bytes, dim) and block.n_rows:
            raise ConfigError(
                f"rank {rank} sends rows of {width}+{got_dim} bytes for layer {block.layer}; the decode's pool "
                f"holds {self.mla_bytes}+{dim}"
            )

    def destinations(
        self, request: int, layer: int, positions: torch.Tensor, part: int = 0
    ) -> tuple[torch.Tensor, ...]:
        """Addresses (``int64 [n]`` each) of the MLA row, the index bytes and the scale of ``positions``;
        the MLA row's only on a layer without index pages (an IndexShare shared layer)."""
        if part != 0:
            raise ConfigError(
                f"request {request} layer {layer}: the decode's pool holds DSA rows only, not part {part}"
            )
        if not 0 <= request < len(self.slots) or not 0 <= layer < self.n_layers:
            raise ConfigError(
                f"request {request} layer {layer}: the decode published {len(self.slots)} requests and "
                f"{self.n_layers} layers"
            )
        slots = self.slots[request]
        if positions.numel() and int(positions.max()) >= slots.numel():
            raise ConfigError(
                f"request {request}: position {int(positions.max())} beyond the {slots.numel()} the decode allocated"
            )
        loc = slots.index_select(0, positions)
        mla = self.mla_address + (layer * self.n_slots + loc) * self.mla_bytes
        if self.index_layers is not None and layer not in self.index_layers:
            return (mla,)
        row = layer if self.index_layers is None else self.index_layers.index(layer)
        page = self.index_address + (row * self.n_pages + loc // self.page_size) * self.index_page_bytes
        slot = loc % self.page_size
        return mla, page + slot * self.index_dim, page + self.page_size * self.index_dim + slot * SCALE_BYTES


class WriteTarget(Protocol):
    """Where a decode wants a prefill rank's blocks (:class:`DecodeTarget` for the DSA pool; a family
    with its own decode layout publishes its arena's regions, :class:`~reference_impl.pd.arena.ArenaTarget`)."""

    @property
    def session_id(self) -> str: ...

    @property
    def notify_address(self) -> int:
        """An address inside the decode's registered memory: the zero-length write carrying a completion."""
        ...

    def check_widths(self, rank: int, block: RowBlock) -> None: ...

    def destinations(
        self, request: int, layer: int, positions: torch.Tensor, part: int = 0
    ) -> tuple[torch.Tensor, ...]:
        """Per region of the block (MLA rows, then index bytes and scales where it has them), the
        address of each row (``int64 [n]``)."""
        ...


def merge_runs(sources: torch.Tensor, destinations: torch.Tensor, width: int) -> tuple[list[int], list[int], list[int]]:
    """Pieces of ``width`` bytes (``int64 [n]`` addresses, sources adjacent) -> one piece per run
    of adjacent destinations: ``(sources, destinations, lengths)``."""
    n = destinations.numel()
    if not n:
        return [], [], []
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = destinations[1:] != destinations[:-1] + width
    first = starts.nonzero().flatten()
    lengths = torch.diff(first, append=torch.tensor([n])) * width
    return sources[first].tolist(), destinations[first].tolist(), lengths.tolist()


def position_runs(positions: torch.Tensor) -> list[list[int]]:
    """``[[start, length], ...]`` of sorted-or-not positions, in their order."""
    src = torch.arange(positions.numel(), dtype=torch.long)
    starts, _, lengths = merge_runs(src, positions.cpu(), 1)
    return [[int(positions[s]), n] for s, n in zip(starts, lengths)]


@dataclass(frozen=True)
class Completion:
    """One prefill rank's notice that every row it holds of a request is in the decode's pool."""

    request: int
    rank: int
    layers: tuple[int, ...]
    rows: int  # per layer
    nbytes: int  # every layer
    runs: tuple[tuple[int, int], ...]  # the positions written, as (start, length) runs
    # per block, in write order: (layer, part, runs of its positions); the rows of a family whose
    # blocks differ from layer to layer (DeepSeek-V4) are booked from these
    blocks: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...] = ()

    def message(self) -> str:
        return json.dumps(
            {
                "request": self.request,
                "rank": self.rank,
                "layers": list(self.layers),
                "rows": self.rows,
                "bytes": self.nbytes,
                "runs": [list(r) for r in self.runs],
                "blocks": [[layer, part, [list(r) for r in runs]] for layer, part, runs in self.blocks],
            }
        )

    @classmethod
    def parse(cls, message: str) -> Completion:
        doc = json.loads(message)
        return cls(
            doc["request"],
            doc["rank"],
            tuple(doc["layers"]),
            doc["rows"],
            doc["bytes"],
            tuple((int(a), int(b)) for a, b in doc["runs"]),
            tuple(
                (int(layer), int(part), tuple((int(a), int(b)) for a, b in runs))
                for layer, part, runs in doc.get("blocks", [])
            ),
        )

    def positions(self) -> torch.Tensor:
        parts = [torch.arange(a, a + n) for a, n in self.runs]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass
class _Written:
    """What the sender wrote of one request so far."""

    layers: list[int] = field(default_factory=list)
    rows: int = 0
    nbytes: int = 0
    runs: list[list[int]] = field(default_factory=list)
    blocks: list[tuple[int, int, tuple[tuple[int, int], ...]]] = field(default_factory=list)


@dataclass(frozen=True)
class WriteTiming:
    """One block's network leg on the sender thread (``time.perf_counter`` seconds)."""

    request: int
    layer: int
    nbytes: int
    pieces: int
    start: float
    end: float


class MooncakeTransport:
    """:class:`~reference_impl.pd.transport.BlockTransport` of a prefill rank: one-sided writes
    into the decode's pool (:class:`DecodeTarget`) through ``engine``, from one ordered sender thread.

    ``rank``: this prefill rank (named in completions). The registered send buffer is host memory,
    pinned when CUDA is present (the staged blocks are host memory already)."""

    def __init__(self, engine: MooncakeEngine, target: WriteTarget, rank: int) -> None:
        self.engine, self.target, self.rank = engine, target, rank
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-mooncake")
        self._written: dict[int, _Written] = {}
        self._lock = threading.Lock()
        self.timings: list[WriteTiming] = []
        self.bytes_written = 0

    # ---- BlockTransport --------------------------------------------------------------------

    def send(self, block: RowBlock, dst: int) -> None:
        self.isend(block, dst).wait()

    def isend(
        self, block: RowBlock, dst: int, header: torch.Tensor | None = None, ready: torch.cuda.Event | None = None
    ) -> Pending:
        """Queue ``block``'s write; ``dst`` and ``header`` are unused (the target names the decode)."""
        return _Future(self._sender.submit(self._write_block, block, ready))

    def complete(self, request: int, dst: int) -> Pending:
        """Queue the request's completion notice behind its blocks (:class:`Completion`)."""
        return _Future(self._sender.submit(self._notify, request))

    def recv(self, src: int) -> RowBlock:
        raise ConfigError(
            "the mooncake transport writes into the decode's pool: the decode waits for completions "
            "(MooncakeReceiver.wait), it receives no blocks"
        )

    def close(self) -> None:
        """Finish queued writes, stop the sender thread, unregister the send buffer."""
        self._sender.shutdown(wait=True)
        self.engine.unregister(self._buffer)

    # ---- the sender thread -----------------------------------------------------------------

    def _send_buffer(self, nbytes: int) -> torch.Tensor:
        if self._buffer.numel() < nbytes:
            self.engine.unregister(self._buffer)
            self._buffer = torch.empty(
                max(nbytes, 2 * self._buffer.numel()), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
            self.engine.register(self._buffer)
        return self._buffer

    def _write_block(self, block: RowBlock, ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            ready.synchronize()  # the staged bytes are in host memory (the layer loop never waits)
        start = time.perf_counter()
        n, width, dim = block.n_rows, block.mla.shape[1], block.index.shape[1]
        target = self.target
        target.check_widths(self.rank, block)
        positions = block.positions.cpu()
        pieces = 0
        if n:
            regions: tuple[torch.Tensor, ...] = (block.mla,)
            widths: tuple[int, ...] = (width,)
            if block.has_index:  # not on an IndexShare shared layer
                regions += (block.index, block.scale.view(torch.uint8).reshape(n, SCALE_BYTES))
                widths += (dim, SCALE_BYTES)
            buffer = self._send_buffer(n * sum(widths))
            sources: list[int] = []
            destinations: list[int] = []
            lengths: list[int] = []
            offset = 0
            destinations_of = target.destinations(block.request, block.layer, positions, block.part)
            if len(destinations_of) != len(regions):
                raise ConfigError(
                    f"request {block.request} layer {block.layer}: the block has {len(regions)} regions, "
                    f"the decode takes {len(destinations_of)}"
                )
            for rows, row_bytes, dst in zip(regions, widths, destinations_of):
                buffer[offset : offset + n * row_bytes].view(n, row_bytes).copy_(rows)
                src = buffer.data_ptr() + offset + torch.arange(n, dtype=torch.long) * row_bytes
                s, d, lens = merge_runs(src, dst, row_bytes)
                sources += s
                destinations += d
                lengths += lens
                offset += n * row_bytes
            self.engine.write(target.session_id, sources, destinations, lengths)
            pieces = len(lengths)
        with self._lock:
            written = self._written.setdefault(block.request, _Written())
            written.layers.append(block.layer)
            written.rows = n
            written.nbytes += block.payload_bytes
            if not written.runs:
                written.runs = position_runs(positions)
            written.blocks.append((block.layer, block.part, tuple((a, b) for a, b in position_runs(positions))))
            self.bytes_written += block.payload_bytes
            self.timings.append(
                WriteTiming(block.request, block.layer, block.payload_bytes, pieces, start, time.perf_counter())
            )

    def _notify(self, request: int) -> None:
        with self._lock:
            written = self._written.get(request, _Written())
        done = Completion(
            request,
            self.rank,
            tuple(sorted(written.layers)),
            written.rows,
            written.nbytes,
            tuple((a, b) for a, b in written.runs),
            tuple(written.blocks),
        )
        buffer = self._send_buffer(1)
        # A zero-length piece inside the decode's pool carries the notification.
        self.engine.write(
            self.target.session_id,
            [buffer.data_ptr()],
            [self.target.notify_address],
            [0],
            notify=(NOTIFY_NAME, done.message()),
        )


class MooncakeReceiver:
    """The decode side: registers ``shard``'s pool with ``engine`` and publishes :attr:`target`."""

    def __init__(self, shard: DcpDecodeShard, engine: MooncakeEngine, requests: Sequence[int]) -> None:
        if shard.layout.cp_size != 1:
            raise ConfigError("the mooncake transport writes into one decode rank's pool (a DCP decode is not wired)")
        self.shard, self.engine = shard, engine
        pool = shard.pool
        engine.register(pool.mla)
        engine.register(pool.index)
        layout = shard.kv_layout
        slots = tuple(shard.table.locs(request).cpu() for request in requests)
        self.target = DecodeTarget(
            engine.session_id,
            pool.mla.data_ptr(),
            pool.index.data_ptr(),
            pool.n_layers,
            pool.n_pages,
            pool.page_size,
            layout.mla_bytes,
            layout.index_head_dim,
            slots,
            pool.index_layers,
        )
        self.completions: list[Completion] = []

    def wait(
        self,
        requests: Sequence[int],
        prefill_ranks: Sequence[int],
        n_layers: int,
        deadline_s: float,
        poll_s: float = 0.001,
    ) -> list[Completion]:
        """Wait for one completion per (request, prefill rank) and book each (the shard's
        exactly-once check); raises :class:`TransferTimeoutError` naming the missing ones after
        ``deadline_s`` seconds."""

        def book(done: Completion) -> None:
            if done.layers != tuple(range(n_layers)):
                raise ConfigError(
                    f"request {done.request} from prefill rank {done.rank}: layers {done.layers} "
                    f"written, expected 0..{n_layers - 1}"
                )
            self.shard.landed(done.request, done.positions(), done.layers, done.nbytes)
            self.completions.append(done)

        await_completions(self.engine, requests, prefill_ranks, deadline_s, book, poll_s)
        return self.completions

    def close(self) -> None:
        """Unregister the pool (after the completions: nothing writes into it any more)."""
        self.engine.unregister(self.shard.pool.mla)
        self.engine.unregister(self.shard.pool.index)


def await_completions(
    engine: MooncakeEngine,
    requests: Sequence[int],
    prefill_ranks: Sequence[int],
    deadline_s: float,
    book: Callable[[Completion], None],
    poll_s: float = 0.001,
) -> list[Completion]:
    """The decode's wait: poll ``engine`` for one completion per (request, prefill rank), handing each
    to ``book`` as it comes; raises :class:`TransferTimeoutError` naming the missing ones after
    ``deadline_s`` seconds, and :class:`ConfigError` on a completion not expected or seen before."""
    missing = {(r, k) for r in requests for k in prefill_ranks}
    stop, arrived = time.monotonic() + deadline_s, []
    while missing:
        for name, message in engine.notifications():
            if name != NOTIFY_NAME:
                continue
            done = Completion.parse(message)
            if (done.request, done.rank) not in missing:
                raise ConfigError(
                    f"an unexpected or repeated completion: request {done.request} from prefill rank {done.rank}"
                )
            book(done)
            arrived.append(done)
            missing.discard((done.request, done.rank))
        if missing and time.monotonic() > stop:
            pairs = ", ".join(f"request {r} from prefill rank {k}" for r, k in sorted(missing)[:6])
            raise TransferTimeoutError(
                f"the decode waited {deadline_s:.0f} s for Mooncake completions; missing {len(missing)}: {pairs}"
            )
        if missing:
            time.sleep(poll_s)
    return arrived

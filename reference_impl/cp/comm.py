"""The CP group: the collectives a context-parallel prefill runs, with byte accounting and a debug recorder.

:class:`CPGroup` wraps a ``torch.distributed`` process group, or stands alone as a trivial
single-rank group when the world has one rank or no process group exists, so single-device runs
need no ``init_process_group``.

Collectives move rows: ``all_gather_padded`` pads each rank's ``[n_local, ...]`` rows to the
largest rank length (every rank knows all lengths from the shared split metadata, so no length
exchange runs), gathers once, and trims. Every collective appends a :class:`CollectiveRecord` to
``group.stats`` with the real (padded) buffer sizes, which the engine report sums.

Debug mode (``debug=True`` or ``DSACP_DEBUG=1``) records each rank's collective sequence and,
before every collective, exchanges a 40-byte digest of the sequence so far: ranks that diverge
raise :class:`CollectiveMismatchError` naming the first differing collective, instead of hanging
or silently gathering the wrong tensors. Off by default: no extra collective runs when off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from reference_impl.config import ConfigError, env_flag
from reference_impl.sync_audit import diagnostic, transport

logger = logging.getLogger(__name__)

# torch >= 2.13 renames all_gather_into_tensor to all_gather_single (same contract, stack form
# accepted); the GPU box's torch 2.11 only has the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_DIGEST_BYTES = 8 + 32  # little-endian int64 collective count + sha256 of the sequence


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collective sequences (debug mode); names the first differing index."""

    def __init__(self, message: str, index: int = -1, entries: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.entries = entries or {}


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as this rank ran it.

    ``shape`` is the padded send buffer's shape (identical on all ranks when the sequence is
    consistent). Byte counts are real buffer sizes, padding included: ``bytes_sent`` is this rank's
    send buffer, ``bytes_received`` what arrives from the other ``C-1`` ranks, ``buffer_bytes`` the
    gathered output buffer (``C`` slots, this rank's own included).
    """

    op: str
    tag: str
    shape: tuple[int, ...]
    dtype: str
    bytes_sent: int
    bytes_received: int
    buffer_bytes: int


@dataclass(frozen=True)
class CollectiveEntry:
    """What the debug recorder keeps per collective: enough to tell two ranks' calls apart."""

    op: str
    tag: str
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.op}[{self.tag}] shape={tuple(self.shape)} dtype={self.dtype}"


class CollectiveRecorder:
    """A rank's collective sequence and a running sha256 over it (the digest of every prefix is O(1))."""

    def __init__(self) -> None:
        self.entries: list[CollectiveEntry] = []
        self._hash = hashlib.sha256()

    def record(self, entry: CollectiveEntry) -> None:
        self.entries.append(entry)
        self._hash.update(str(entry).encode() + b"\n")

    def digest(self) -> bytes:
        """``_DIGEST_BYTES`` bytes: the entry count (int64 LE) then the sha256 of the sequence."""
        return len(self.entries).to_bytes(8, "little") + self._hash.copy().digest()


def first_mismatch(sequences: Sequence[Sequence[str]]) -> int | None:
    """Index of the first collective where the ranks' sequences differ (or one ends); None if equal."""
    longest = max((len(s) for s in sequences), default=0)
    for i in range(longest):
        column = {s[i] if i < len(s) else None for s in sequences}
        if len(column) > 1:
            return i
    return None


class ProgressReporter(Protocol):
    """Told when this process enters and leaves each collective, so a supervisor can say which rank
    a hang left behind (:mod:`reference_impl.rank_processes`); a reporter with a ``step()`` method
    also hears of each unit of work done (:func:`note_step`: the model built, each layer), so the
    supervisor can show progress."""

    def enter(self, op: str, tag: str) -> None: ...
    def leave(self) -> None: ...


_progress: ProgressReporter | None = None


def report_progress_to(reporter: ProgressReporter | None) -> None:
    """Every CP group of this process reports its collectives to ``reporter`` (``None``: nobody)."""
    global _progress
    _progress = reporter


def note_step() -> None:
    """One unit of this rank's work is done (the engine: its model built, then each layer of each
    chunk); a host-side counter in shared memory, no device work, no sync."""
    step = getattr(_progress, "step", None)
    if step is not None:
        step()


@contextlib.contextmanager
def _in_collective(op: str, tag: str) -> Iterator[None]:
    if _progress is None:
        yield
        return
    _progress.enter(op, tag)
    try:
        yield
    finally:
        _progress.leave()


def _row_shape_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


class CPGroup:
    """``C`` ranks of one CP group: ``rank``, ``size``, ``device``, and the collectives the prefill runs.

    Args:
        process_group: the group to wrap; ``None`` means the default (world) group when
            ``torch.distributed`` is initialized, else a trivial single-rank group.
        device: where this rank's tensors live; default ``cuda:<current>`` under NCCL, else CPU.
        debug: record and cross-check the collective sequence; ``None`` reads ``DSACP_DEBUG``.
    """

    def __init__(
        self,
        process_group: Any | None = None,
        *,
        device: torch.device | str | None = None,
        debug: bool | None = None,
    ) -> None:
        if dist.is_available() and dist.is_initialized():
            self._pg = process_group if process_group is not None else dist.group.WORLD
            self._size = dist.get_world_size(self._pg)
            self._rank = dist.get_rank(self._pg)
            self.backend = str(dist.get_backend(self._pg)).lower()
        elif process_group is not None:
            raise ConfigError("CPGroup got a process group but torch.distributed is not initialized")
        else:
            self._pg, self._size, self._rank, self.backend = None, 1, 0, "none"
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if self.backend == "nccl" else "cpu"
        self._device = torch.device(device)
        self.debug = env_flag("debug") if debug is None else debug
        self.recorder: CollectiveRecorder | None = CollectiveRecorder() if self.debug else None
        self.stats: list[CollectiveRecord] = []
        # NCCL gathers into one contiguous buffer in one call; gloo takes a list of per-rank views.
        self._fused_gather = self.backend == "nccl"

    @classmethod
    def single(cls, device: torch.device | str = "cpu", debug: bool | None = None) -> CPGroup:
        """A trivial one-rank group (no process group), whatever the state of torch.distributed."""
        group = cls.__new__(cls)
        group._pg, group._size, group._rank, group.backend = None, 1, 0, "none"
        group._device = torch.device(device)
        group.debug = env_flag("debug") if debug is None else debug
        group.recorder = CollectiveRecorder() if group.debug else None
        group.stats = []
        group._fused_gather = False
        return group

    # ---------------------------------------------------------------------------------- identity

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_trivial(self) -> bool:
        """True for a single-rank group: collectives are local copies and record no stats."""
        return self._pg is None or self._size == 1

    def __repr__(self) -> str:
        return f"CPGroup(rank={self.rank}, size={self.size}, backend={self.backend}, device={self.device})"

    # ------------------------------------------------------------------------------ collectives

    def all_gather_rows_padded_raw(self, local: torch.Tensor, lengths: Sequence[int], tag: str) -> torch.Tensor:
        """Gather every rank's rows, padded: ``local [lengths[rank], ...]`` -> ``[C, max(lengths), ...]``.

        Slot ``r`` holds rank ``r``'s rows in ``[:lengths[r]]``; the rows after that are padding
        with unspecified contents (zero on this rank's own slot). ``lengths`` must be the same on
        every rank (shared metadata). The primitive of :meth:`all_gather_padded`, exposed for a
        fused trim + rerange. Any dtype (bf16, fp8, uint8, ...): the bytes move as ``uint8``.
        """
        self._check_rows(local, lengths)
        max_len = max(lengths)
        rows = tuple(local.shape[1:])
        if self.is_trivial:
            self._record_debug("all_gather", tag, (max_len, *rows), local.dtype)
            return local.unsqueeze(0)
        out = torch.empty((self._size, max_len, *rows), dtype=local.dtype, device=local.device)
        row_bytes = _row_shape_bytes(local)
        if max_len == 0 or row_bytes == 0:
            return out  # nothing to move; every rank takes this branch (same lengths, same shapes)
        self._before_collective("all_gather", tag, (max_len, *rows), local.dtype)

        send = local.new_empty((max_len, *rows)) if local.shape[0] < max_len else local.contiguous()
        if local.shape[0] < max_len:
            send[: local.shape[0]].copy_(local)
            send[local.shape[0] :].zero_()
        # Reinterpret rows as raw bytes: a gather is pure data movement and gloo lacks some dtypes.
        send_bytes = send.reshape(max_len, -1).view(torch.uint8)
        out_bytes = out.view(self._size, max_len, -1).view(torch.uint8)
        staged = self.backend == "gloo" and local.is_cuda  # gloo moves CUDA tensors through host memory
        with transport(stages_through_host=staged), _in_collective("all_gather", tag):
            self._exchange(out_bytes, send_bytes)

        padded = max_len * row_bytes
        self.stats.append(
            CollectiveRecord(
                op="all_gather",
                tag=tag,
                shape=(max_len, *rows),
                dtype=str(local.dtype).removeprefix("torch."),
                bytes_sent=padded,
                bytes_received=(self._size - 1) * padded,
                buffer_bytes=self._size * padded,
            )
        )
        return out

    def all_gather_padded(self, local: torch.Tensor, lengths: Sequence[int], tag: str) -> torch.Tensor:
        """Gather every rank's rows in rank-major order: ``local [lengths[rank], ...]`` -> ``[sum(lengths), ...]``.

        Rank 0's rows, then rank 1's, ...; padding removed. One collective (see
        :meth:`all_gather_rows_padded_raw`); the caller applies the rerange to sequence order. On
        a single-rank group the result is ``local`` itself (no copy).
        """
        raw = self.all_gather_rows_padded_raw(local, lengths, tag)
        if self.is_trivial:
            return local
        max_len = raw.shape[1]
        if all(n == max_len for n in lengths):
            return raw.reshape(self._size * max_len, *raw.shape[2:])  # no padding: a view
        return torch.cat([raw[r, :n] for r, n in enumerate(lengths)])

    def broadcast_rows(self, rows: torch.Tensor, src: int, tag: str) -> torch.Tensor:
        """Rank ``src``'s ``rows [n, ...]`` on every rank: one broadcast, written into ``rows`` in place.

        Every rank passes a tensor of the same shape and dtype (on the others its contents are
        overwritten); ``rows`` must be contiguous. Any dtype: the bytes move as ``uint8``. Recorded
        like the all-gathers: ``bytes_received`` is ``n`` row bytes on every rank but ``src``.
        """
        if not 0 <= src < self._size:
            raise ConfigError(f"broadcast: source rank {src} is not in a CP group of {self._size} ranks")
        if not rows.is_contiguous():
            raise ConfigError(f"broadcast: rows {tuple(rows.shape)} must be contiguous (they are written in place)")
        shape = tuple(rows.shape)
        if self.is_trivial:
            self._record_debug("broadcast", tag, shape, rows.dtype)
            return rows
        nbytes = rows.numel() * rows.element_size()
        if nbytes == 0:
            return rows  # nothing to move; every rank takes this branch (same shapes)
        self._before_collective("broadcast", tag, shape, rows.dtype)
        staged = self.backend == "gloo" and rows.is_cuda
        with transport(stages_through_host=staged), _in_collective("broadcast", tag):
            self._broadcast_exchange(rows.view(-1).view(torch.uint8), src)
        mine = self._rank == src
        self.stats.append(
            CollectiveRecord(
                op="broadcast",
                tag=tag,
                shape=shape,
                dtype=str(rows.dtype).removeprefix("torch."),
                bytes_sent=nbytes if mine else 0,
                bytes_received=0 if mine else nbytes,
                buffer_bytes=nbytes,
            )
        )
        return rows

    def _broadcast_exchange(self, data: torch.Tensor, src: int) -> None:
        """The wire of :meth:`broadcast_rows`: ``data`` (uint8, flat) of group rank ``src`` into every
        rank's ``data``."""
        dist.broadcast(data, src=dist.get_global_rank(self._pg, src), group=self._pg)

    def _exchange(self, out_bytes: torch.Tensor, send_bytes: torch.Tensor) -> None:
        """The wire: ``send_bytes [max_len, row_bytes]`` of every rank into ``out_bytes [C, max_len, row_bytes]``."""
        if self._fused_gather:
            _all_gather_single(out_bytes, send_bytes, group=self._pg)
        else:
            dist.all_gather(list(out_bytes.unbind(0)), send_bytes, group=self._pg)

    def barrier(self, tag: str = "barrier") -> None:
        """Wait for every rank (recorded, zero bytes)."""
        if self.is_trivial:
            self._record_debug("barrier", tag, (), None)
            return
        self._before_collective("barrier", tag, (), None)
        with _in_collective("barrier", tag):
            if self.backend == "nccl" and self._device.type == "cuda":
                dist.barrier(group=self._pg, device_ids=[self._device.index or 0])
            else:
                dist.barrier(group=self._pg)
        self.stats.append(CollectiveRecord("barrier", tag, (), "none", 0, 0, 0))

    # ----------------------------------------------------------------------------------- stats

    def stats_summary(self) -> dict[str, int]:
        """Totals over ``stats``: ``collectives``, ``bytes_sent``, ``bytes_received``, ``buffer_bytes``."""
        return {
            "collectives": len(self.stats),
            "bytes_sent": sum(s.bytes_sent for s in self.stats),
            "bytes_received": sum(s.bytes_received for s in self.stats),
            "buffer_bytes": sum(s.buffer_bytes for s in self.stats),
        }

    # ----------------------------------------------------------------------------------- debug

    def check_consistent(self) -> None:
        """Raise :class:`CollectiveMismatchError` on every rank if the ranks' sequences differ.

        A collective itself (a digest exchange, then on mismatch an exchange of the sequences):
        every rank must call it. No-op when debug is off or the group is trivial.
        """
        if self.recorder is None or self.is_trivial:
            return
        digest_device = self._device if self.backend == "nccl" else torch.device("cpu")
        mine = torch.frombuffer(bytearray(self.recorder.digest()), dtype=torch.uint8).to(digest_device)
        everyone = torch.empty((self._size, _DIGEST_BYTES), dtype=torch.uint8, device=digest_device)
        dist.all_gather(list(everyone.unbind(0)), mine, group=self._pg)
        if bool((everyone == everyone[0]).all()):
            return
        # Every rank saw the same digests, so every rank takes this branch: the exchange matches up.
        sequences: list[Any] = [None] * self._size
        dist.all_gather_object(sequences, [str(e) for e in self.recorder.entries], group=self._pg)
        index = first_mismatch(sequences)
        assert index is not None, "digests differ but sequences are equal"
        entries = {
            r: (seq[index] if index < len(seq) else f"<none: {len(seq)} collectives so far>")
            for r, seq in enumerate(sequences)
        }
        detail = "; ".join(f"rank {r}: {e}" for r, e in entries.items())
        raise CollectiveMismatchError(
            f"collective sequence differs across ranks at collective #{index}: {detail}", index, entries
        )

    def _record_debug(self, op: str, tag: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> None:
        if self.recorder is not None:
            name = "none" if dtype is None else str(dtype).removeprefix("torch.")
            self.recorder.record(CollectiveEntry(op, tag, tuple(shape), name))

    def _before_collective(self, op: str, tag: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> None:
        """In debug mode record the call and check the sequence so far before running it."""
        if self.recorder is None:
            return
        self._record_debug(op, tag, shape, dtype)
        with diagnostic():  # syncs on purpose; not counted by phase 6's audit
            self.check_consistent()

    def _check_rows(self, local: torch.Tensor, lengths: Sequence[int]) -> None:
        if len(lengths) != self._size:
            raise ConfigError(f"all_gather: {len(lengths)} lengths for a CP group of {self._size} ranks")
        if any(n < 0 for n in lengths):
            raise ConfigError(f"all_gather: negative length in {list(lengths)}")
        if local.dim() < 1 or local.shape[0] != lengths[self._rank]:
            raise ConfigError(
                f"all_gather: rank {self._rank} holds {tuple(local.shape)} rows but lengths[{self._rank}]="
                f"{lengths[self._rank]}"
            )

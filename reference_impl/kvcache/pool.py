"""Paged KV pools: the MLA latent and indexer K storage of all layers of one rank.

Both pools are raw ``torch.uint8`` buffers in the byte layouts of :mod:`.layout`:

* ``mla``: ``[n_layers, n_pages * page_size, mla_bytes]``, one row per token slot, addressed by
  loc (``page = loc // page_size``).
* ``index``: ``[n_index_layers, n_pages, index_page_bytes]``, one row per page: the page's
  ``page_size * 128`` fp8 bytes, then its ``page_size`` float32 scales. Every layer has one, except
  with IndexShare, where only the layout's ``index_layers`` do (:meth:`PagedKVPool.index_of` finds a
  layer's; ``pool.index[layer]`` is the same tensor when every layer has one).

The locs passed in are this pool's slots (physical locs; in the replicated baseline they equal
the logical locs). Range checks on loc values read them on the host, which syncs a device: they
run only with ``debug=True``. Shape and dtype checks use metadata only and always run.
"""

from __future__ import annotations

import torch

from reference_impl.config import ConfigError
from reference_impl.fp8 import FP8_DTYPE
from reference_impl.sync_audit import diagnostic

from .layout import SCALE_BYTES, KVLayout


class LocOutOfRangeError(ConfigError, IndexError):
    """A loc (or row index) outside the range of the buffer it addresses."""


def check_in_range(name: str, values: torch.Tensor, limit: int) -> None:
    """Raise :class:`LocOutOfRangeError` unless every value of ``values`` lies in ``[0, limit)``.

    Reads the values' extremes on the host: a device sync on a GPU. Run it once per batch, or in
    debug mode inside :func:`~reference_impl.sync_audit.diagnostic`.
    """
    if not values.numel():
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= limit:
        raise LocOutOfRangeError(f"{name} span [{lo}, {hi}] outside [0, {limit})")


class PagedKVPool:
    """MLA and indexer K pages of ``n_layers`` layers, ``n_pages`` pages of ``page_size`` tokens each."""

    def __init__(
        self,
        n_layers: int,
        n_pages: int,
        page_size: int,
        layout: KVLayout,
        device: torch.device | str = "cpu",
        debug: bool = False,
    ) -> None:
        if n_layers < 1 or n_pages < 0:
            raise ConfigError(f"PagedKVPool needs n_layers >= 1 and n_pages >= 0, got {n_layers} and {n_pages}")
        if page_size != layout.page_size:
            raise ConfigError(f"page_size={page_size} differs from the layout's page_size={layout.page_size}")
        self.n_layers = n_layers
        self.n_pages = n_pages
        self.page_size = page_size
        self.layout = layout
        self.device = torch.device(device)
        self.debug = debug
        self.mla = torch.zeros(n_layers, self.n_slots, layout.mla_bytes, dtype=torch.uint8, device=self.device)
        # IndexShare: only the layers that run the indexer keep index K, at consecutive rows.
        self.index_layers = tuple(layer for layer in range(n_layers) if layout.has_index(layer))
        self._index_row = {layer: row for row, layer in enumerate(self.index_layers)}
        n_index = len(self.index_layers)
        self.index = torch.zeros(n_index, n_pages, layout.index_page_bytes, dtype=torch.uint8, device=self.device)
        # Views of each page's two regions, so a token write is one indexed assignment per region.
        split = page_size * layout.index_head_dim
        self._index_values = self.index[:, :, :split].view(n_index, n_pages, page_size, layout.index_head_dim)
        self._index_scales = self.index[:, :, split:].view(n_index, n_pages, page_size, SCALE_BYTES)

    # ---------------------------------------------------------------------------------------
    # Sizes
    # ---------------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        """Token slots per layer: ``n_pages * page_size``."""
        return self.n_pages * self.page_size

    @property
    def mla_bytes_total(self) -> int:
        """Bytes of the MLA storage, all layers."""
        return self.mla.numel()

    @property
    def index_bytes_total(self) -> int:
        """Bytes of the indexer K storage, all layers."""
        return self.index.numel()

    @property
    def bytes_total(self) -> int:
        return self.mla_bytes_total + self.index_bytes_total

    def mla_bytes_for_pages(self, n_pages: int) -> int:
        """MLA bytes that ``n_pages`` pages take over all layers of this pool."""
        return self.n_layers * n_pages * self.layout.mla_page_bytes

    def index_bytes_for_pages(self, n_pages: int) -> int:
        """Indexer K bytes that ``n_pages`` pages take over all layers of this pool (those with index K)."""
        return len(self.index_layers) * n_pages * self.layout.index_page_bytes

    def bytes_for_pages(self, n_pages: int) -> int:
        """MLA + indexer K bytes of ``n_pages`` pages over all layers (``bytes_total`` at ``self.n_pages``)."""
        return self.mla_bytes_for_pages(n_pages) + self.index_bytes_for_pages(n_pages)

    # ---------------------------------------------------------------------------------------
    # MLA
    # ---------------------------------------------------------------------------------------

    def write_mla(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """Store packed rows ``uint8 [N, mla_bytes]`` at slots ``locs [N] int64`` of ``layer``."""
        self._check_locs(layer, locs)
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (locs.shape[0], self.layout.mla_bytes):
            raise ConfigError(
                f"write_mla expects rows uint8 [{locs.shape[0]}, {self.layout.mla_bytes}], "
                f"got {rows.dtype} {tuple(rows.shape)}"
            )
        self.mla[layer].index_copy_(0, locs, rows)

    def read_mla(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """Packed rows at ``locs [N] int64`` of ``layer`` -> ``uint8 [N, mla_bytes]`` (a copy)."""
        self._check_locs(layer, locs)
        return self.mla[layer].index_select(0, locs)

    # ---------------------------------------------------------------------------------------
    # Indexer K
    # ---------------------------------------------------------------------------------------

    def has_index(self, layer: int) -> bool:
        """Whether ``layer`` keeps indexer K here (every layer, or IndexShare's full layers)."""
        return layer in self._index_row

    def index_of(self, layer: int) -> torch.Tensor:
        """``layer``'s index pages ``uint8 [n_pages, index_page_bytes]`` (a view); a layer without
        index K (an IndexShare shared layer) is a :class:`ConfigError`."""
        return self.index[self._index_row_of(layer)]

    def _index_row_of(self, layer: int) -> int:
        row = self._index_row.get(layer)
        if row is None:
            if not 0 <= layer < self.n_layers:
                raise LocOutOfRangeError(f"layer {layer} is outside this pool's {self.n_layers} layers")
            raise ConfigError(f"layer {layer} keeps no indexer K (IndexShare: it reuses a full layer's top-k)")
        return row

    def write_index(self, layer: int, locs: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor) -> None:
        """Store ``k_fp8 [N, 128] float8_e4m3fn`` and ``k_scale [N] float32`` of tokens at ``locs [N]``.

        Token ``loc`` goes to page ``loc // page_size``, slot ``loc % page_size``: its 128 bytes at
        ``slot * 128`` and its scale at ``page_size * 128 + 4 * slot`` of that page.
        """
        self._check_locs(layer, locs)
        row = self._index_row_of(layer)
        n, dim = locs.shape[0], self.layout.index_head_dim
        if k_fp8.dtype != FP8_DTYPE or tuple(k_fp8.shape) != (n, dim):
            raise ConfigError(
                f"write_index expects k_fp8 float8_e4m3fn [{n}, {dim}], got {k_fp8.dtype} {tuple(k_fp8.shape)}"
            )
        if k_scale.dtype != torch.float32 or tuple(k_scale.shape) != (n,):
            raise ConfigError(f"write_index expects k_scale float32 [{n}], got {k_scale.dtype} {tuple(k_scale.shape)}")
        page, in_page = locs // self.page_size, locs % self.page_size
        self._index_values[row][page, in_page] = k_fp8.contiguous().view(torch.uint8)
        self._index_scales[row][page, in_page] = k_scale.contiguous().view(torch.uint8).reshape(n, SCALE_BYTES)

    def read_index(self, layer: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer K of tokens at ``locs [N]`` -> ``(k_fp8 [N, 128] float8_e4m3fn, k_scale [N] float32)``."""
        self._check_locs(layer, locs)
        row = self._index_row_of(layer)
        page, in_page = locs // self.page_size, locs % self.page_size
        values = self._index_values[row][page, in_page]  # advanced indexing: a fresh contiguous copy
        scales = self._index_scales[row][page, in_page]
        return values.view(FP8_DTYPE), scales.view(torch.float32).reshape(-1)

    # ---------------------------------------------------------------------------------------
    # Whole pages (materialization, PD transfer)
    # ---------------------------------------------------------------------------------------

    def read_pages(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw bytes of whole pages ``pages [n] int64`` ->
        ``(mla uint8 [n, P * mla_bytes], index uint8 [n, index_page_bytes])``."""
        mla = self.mla[layer].view(self.n_pages, self.layout.mla_page_bytes).index_select(0, pages)
        return mla, self.index_of(layer).index_select(0, pages)

    def read_mla_pages(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """The MLA half of :meth:`read_pages`: ``uint8 [n, P * mla_bytes]``."""
        return self.mla[layer].view(self.n_pages, self.layout.mla_page_bytes).index_select(0, pages)

    def write_pages(self, layer: int, pages: torch.Tensor, mla: torch.Tensor, index: torch.Tensor) -> None:
        """Store whole pages' raw bytes (the inverse of :meth:`read_pages`)."""
        self.mla[layer].view(self.n_pages, self.layout.mla_page_bytes).index_copy_(0, pages, mla)
        self.index_of(layer).index_copy_(0, pages, index)

    # ---------------------------------------------------------------------------------------
    # Checks
    # ---------------------------------------------------------------------------------------

    def _check_locs(self, layer: int, locs: torch.Tensor) -> None:
        if not 0 <= layer < self.n_layers:
            raise LocOutOfRangeError(f"layer {layer} is outside this pool's {self.n_layers} layers")
        if locs.dtype != torch.int64 or locs.dim() != 1:
            raise ConfigError(f"locs must be a 1-D int64 tensor, got {locs.dtype} {tuple(locs.shape)}")
        if locs.device != self.mla.device:
            raise ConfigError(f"locs are on {locs.device}, the pool is on {self.mla.device}")
        if self.debug:
            with diagnostic():  # a host sync, debug only; not counted by phase 6's audit
                check_in_range("locs", locs, self.n_slots)

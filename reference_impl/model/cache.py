"""A request's dense KV cache in the byte layouts, and one DSA layer's single-device call on it.

:class:`LayerCache` holds exactly the bytes the paged pools hold for one request and one layer
(:mod:`reference_impl.kvcache.layout`), dense and sequence-ordered, so the oracle's cache can be
compared with a CP run's byte for byte. :func:`attention_forward` runs one layer for a request's
new tokens against it (what :meth:`DSAAttention.forward` calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.errors import ConfigError
from reference_impl.kvcache.layout import KVLayout
from reference_impl.model.attention import DSAAttention, Projection


def check_device(device: object, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` of a kind this package runs on (cpu, cuda, meta), CUDA only where
    visible; anything else is a :class:`ConfigError` naming the argument ``name``."""
    if not isinstance(device, (str, torch.device)):
        raise ConfigError(f"{name}={device!r}: need 'cpu', 'cuda' or a torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{name}={device!r}: not a device; use 'cpu' or 'cuda'") from None
    if dev.type not in ("cpu", "cuda", "meta"):
        raise ConfigError(f"{name}={device!r}: use 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{name}={device!r}: no CUDA device is visible; use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{name}={device!r}: {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


@dataclass
class LayerCache:
    """Dense cache of one request for one layer, in the KV byte layouts.

    ``with_index=False`` (an IndexShare shared layer): no indexer K is kept; ``index_fp8`` and
    ``index_scale`` stay empty.
    """

    layout: KVLayout
    mla_rows: torch.Tensor  # uint8 [N, layout.mla_bytes]
    index_fp8: torch.Tensor  # float8_e4m3fn [N, D] ([0, D] without index K)
    index_scale: torch.Tensor  # float32 [N]
    with_index: bool = True

    @classmethod
    def empty(cls, layout: KVLayout, device: torch.device | str, with_index: bool = True) -> LayerCache:
        if not isinstance(layout, KVLayout):
            raise ConfigError(
                f"layout={layout!r:.80}: need a KVLayout (KVLayout.from_config), got {type(layout).__name__}"
            )
        device = check_device(device)
        if not isinstance(with_index, bool):
            raise ConfigError(f"with_index={with_index!r}: need a bool, got {type(with_index).__name__}")
        d = layout.index_head_dim
        return cls(
            layout,
            torch.empty(0, layout.mla_bytes, dtype=torch.uint8, device=device),
            torch.empty(0, d, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(0, dtype=torch.float32, device=device),
            with_index,
        )

    def __len__(self) -> int:
        return int(self.mla_rows.shape[0])

    def append(self, proj: Projection) -> None:
        """Quantize and append the projected tokens' KV and (on a layer that keeps it) index K."""
        if (proj.index_k is not None) != self.with_index:
            raise ValueError(
                f"a cache {'with' if self.with_index else 'without'} index K gets a projection "
                f"{'without' if proj.index_k is None else 'with'} one (IndexShare pattern mismatch)"
            )
        self.mla_rows = torch.cat([self.mla_rows, self.layout.pack_mla(proj.kv)])
        if proj.index_k is not None:
            k_fp8, k_scale = self.layout.quantize_index_k(proj.index_k)
            self.index_fp8 = torch.cat([self.index_fp8, k_fp8])
            self.index_scale = torch.cat([self.index_scale, k_scale])

    def kv_view(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The full view of this request: dequantized ``[N, kv_lora + rope]`` in ``dtype`` (bf16, as the engine's)."""
        return self.layout.dequantize_mla(self.mla_rows).to(dtype)


@torch.no_grad()
def attention_forward(
    attn: DSAAttention,
    x: torch.Tensor,
    start_pos: int,
    cache: LayerCache,
    view_dtype: torch.dtype = torch.bfloat16,
    reuse_topk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Projection]:
    """The single-device call: one request's tokens ``x [T, dim]`` at ``start_pos`` against ``cache``.

    ``cache`` must hold exactly the request's first ``start_pos`` tokens; this call appends the
    ``T`` new ones. Returns ``(out [T, dim], topk [T, K] int32 positions in the request, projection)``.
    ``reuse_topk``: on an IndexShare shared layer, the same tokens' top-k of the full layer before it.
    """
    if len(cache) != start_pos:
        raise ValueError(f"cache holds {len(cache)} tokens but start_pos is {start_pos}")
    positions = torch.arange(start_pos, start_pos + x.shape[0], device=x.device)
    proj = attn.project(x, positions)
    cache.append(proj)
    key_start = torch.zeros_like(positions)
    index_fp8, index_scale = (cache.index_fp8, cache.index_scale) if cache.with_index else (None, None)
    out, topk = attn.attend(
        proj, cache.kv_view(view_dtype), index_fp8, index_scale, key_start, positions + 1, reuse_topk=reuse_topk
    )
    return out, topk, proj

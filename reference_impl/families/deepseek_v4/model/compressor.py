"""The V4 compressor: learned gated softmax pooling of ``m`` consecutive tokens into one entry.

Every token ``p`` projects to a value row ``c_p = wkv(x_p)`` and a score row
``z_p = wgate(x_p) + ape[p % m]`` (float32; ``ape`` is a learned per-slot bias). Entry ``w`` of a
layer with ratio ``m`` is, per feature ``d``::

    entry_w[d] = sum_s softmax_s(z_s[d]) * c_s[d]       over its slots s

* ratio 128 (HCA): the slots are tokens ``[128 w, 128 w + 128)``, all ``D`` features;
* ratio 4 (CSA) **overlaps**: ``wkv``/``wgate`` are ``2 D`` wide; the slots are the *first* half
  (``[:D]``, "Ca") of the previous window's tokens ``[4 w - 4, 4 w)`` and the *second* half
  (``[D:]``, "Cb") of its own tokens ``[4 w, 4 w + 4)``: an 8-token window with stride 4. Entry 0
  has no previous window: those slots carry score ``-inf`` (weight 0).

Then ``norm`` (RMSNorm), RoPE on the last 64 dims at position ``w * m`` (the window's first token),
and for the indexer's compressor a Hadamard rotation. Entry ``w`` is complete once token
``(w + 1) m - 1`` exists: chunked prefill and CP both carry the **pre-pool rows** (``c``, ``z``) of
a window's tokens until it completes (:func:`state_start`).
"""

from __future__ import annotations

import torch
from torch import nn

from reference_impl.model.attention import RMSNorm, RowStableLinear
from reference_impl.model.rope import apply_rope, rope_cos_sin

CSA_RATIO = 4


def overlaps(ratio: int) -> bool:
    """CSA's ratio-4 compressor pools overlapping 8-token windows; HCA's does not."""
    return ratio == CSA_RATIO


def state_start(n_tokens: int, ratio: int) -> int:
    """First position whose pre-pool row a request of ``n_tokens`` tokens must keep for its next
    entries: the incomplete window's start, one window earlier when windows overlap."""
    first = (n_tokens // ratio) * ratio
    return max(0, first - ratio) if overlaps(ratio) else first


def slot_positions(entries: torch.Tensor, ratio: int) -> torch.Tensor:
    """Positions feeding each entry ``[E] -> [E, n_slots]``: ``2m`` slots (Ca of the previous window,
    then Cb of its own) when overlapping, else ``m``. Negative positions mark absent slots."""
    own = entries[:, None] * ratio + torch.arange(ratio, device=entries.device)
    return torch.cat([own - ratio, own], dim=1) if overlaps(ratio) else own


def pool(
    kv_rows: torch.Tensor,  # [N, coff * D] float32 value rows
    score_rows: torch.Tensor,  # [N, coff * D] float32 score rows (ape added)
    slot_rows: torch.Tensor,  # [E, n_slots] int64: the row of each slot, -1 where absent
    ratio: int,
) -> torch.Tensor:
    """Pooled entries ``[E, D]`` float32 (before norm and RoPE); see the module docstring."""
    n_entries = slot_rows.shape[0]
    width = kv_rows.shape[1] // (2 if overlaps(ratio) else 1)
    if n_entries == 0:
        return kv_rows.new_zeros(0, width)
    absent = slot_rows < 0
    rows = slot_rows.clamp(min=0)
    kv, score = kv_rows[rows], score_rows[rows]  # [E, slots, coff * D]
    if overlaps(ratio):  # Ca: first half of the previous window's rows; Cb: second half of its own
        kv = torch.cat([kv[:, :ratio, :width], kv[:, ratio:, width:]], dim=1)
        score = torch.cat([score[:, :ratio, :width], score[:, ratio:, width:]], dim=1)
    score = score.masked_fill(absent[:, :, None], float("-inf"))
    kv = kv.masked_fill(absent[:, :, None], 0.0)
    return (kv * score.softmax(dim=1)).sum(dim=1)


class Compressor(nn.Module):
    """Parameters of one compressor (``inference/model.py`` names: ``wkv``, ``wgate``, ``ape``, ``norm``)."""

    def __init__(self, dim: int, head_dim: int, ratio: int, rope_dim: int, eps: float, rotate: bool) -> None:
        super().__init__()
        coff = 2 if overlaps(ratio) else 1
        self.ratio, self.head_dim, self.rope_dim, self.rotate = ratio, head_dim, rope_dim, rotate
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim, dtype=torch.float32))
        self.wkv = RowStableLinear(dim, coff * head_dim, bias=False, dtype=torch.float32)  # compression runs in fp32
        self.wgate = RowStableLinear(dim, coff * head_dim, bias=False, dtype=torch.float32)
        self.norm = RMSNorm(head_dim, eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-pool rows of tokens ``x [T, dim]`` at ``positions [T]``: ``(kv, score)`` ``[T, coff * D]`` float32."""
        xf = x.float()
        return self.wkv(xf), self.wgate(xf) + self.ape[positions % self.ratio]

    def finish(
        self,
        pooled: torch.Tensor,
        entries: torch.Tensor,
        freqs: torch.Tensor,
        dtype: torch.dtype,
        hadamard: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled ``[E, D]`` -> entries in ``dtype``: ``norm``, RoPE at ``entries * ratio`` on the last
        ``rope_dim`` dims, and the Hadamard rotation for the indexer's compressor."""
        from reference_impl.fp8 import hadamard_rotate

        out = self.norm(pooled.to(dtype))
        cos, sin = rope_cos_sin(freqs, entries * self.ratio)
        out = torch.cat([out[:, : -self.rope_dim], apply_rope(out[:, -self.rope_dim :], cos, sin, True)], dim=1)
        if self.rotate:
            assert hadamard is not None
            out = hadamard_rotate(out, hadamard)
        return out

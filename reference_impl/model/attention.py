"""One DSA attention layer: MLA in absorbed (MQA) form plus the lightning indexer.

Parameter names follow DeepSeek-V3.2's inference code (``wq_a, q_norm, wq_b, wkv_a, kv_norm,
wkv_b, wo, indexer.{wq_b, wk, k_norm, weights_proj}``) so an attention state dict in bf16 loads
with ``strict=True``. The layer is split into the two halves that context parallelism puts a
collective between:

* :meth:`DSAAttention.project` -- per-token work on the rank's own tokens: absorbed queries, the
  576-wide latent KV entry and the 128-wide indexer key (rotated, not yet quantized), indexer
  queries (FP8) and head weights.
* :meth:`DSAAttention.attend` -- indexer top-k and sparse attention of those queries against a
  **full view** (dense, sequence-ordered KV of whole requests), then the output projection.

:meth:`DSAAttention.forward` is the single-device call: one request's new tokens at a start
position, against a dense cache of its earlier tokens (:class:`~reference_impl.model.cache.LayerCache`).

IndexShare (GLM-5.2, :mod:`reference_impl.index_share`): a layer built with ``indexer=False`` has no
indexer parameters, projects no indexer q / k (those :class:`Projection` fields are ``None``) and
attends with the top-k of the full layer before it (``attend(..., reuse_topk=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from reference_impl.fp8 import hadamard_matrix, hadamard_rotate
from reference_impl.model.rope import apply_rope, rope_cos_sin, rope_frequencies
from reference_impl.model.sparse_attention import TORCH_OPS, ComputeOps, HostKeyBounds
from reference_impl.presets import ModelConfig

if TYPE_CHECKING:
    from reference_impl.model.cache import LayerCache


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 with a float32 weight (DeepSeek-V3.2's), through ``ops.rms_norm``
    (:func:`reference_impl.model.norm.rms_norm` unless kernels are plugged in)."""

    def __init__(self, dim: int, eps: float = 1e-6, ops: ComputeOps = TORCH_OPS) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with bias, computed in float32 (the indexer's ``k_norm``)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.float(), (x.shape[-1],), self.weight, self.bias, self.eps).to(x.dtype)


# CPU GEMMs over fewer rows than this take another MKL kernel (on AVX-512 machines, up to about 10
# rows) whose sums round differently, so a row's bits would depend on how many rows were multiplied
# with it. A rank's few local rows must give the oracle's bits (the caches are compared byte for
# byte), so CPU products run on at least this many rows; GPU products are left alone.
MIN_CPU_GEMM_ROWS = 16


def pad_rows(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``x`` with zero rows appended along ``dim`` up to :data:`MIN_CPU_GEMM_ROWS` (CPU only)."""
    short = MIN_CPU_GEMM_ROWS - x.shape[dim]
    if x.device.type != "cpu" or short <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


class RowStableLinear(nn.Linear):
    """``nn.Linear`` whose output rows do not depend on how many rows were multiplied (see
    :data:`MIN_CPU_GEMM_ROWS`); same parameters and state dict as ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(pad_rows(x))[: x.shape[0]]


def _linear(n_in: int, n_out: int, dtype: torch.dtype) -> nn.Linear:
    return RowStableLinear(n_in, n_out, bias=False, dtype=dtype)


class Indexer(nn.Module):
    """The lightning indexer's parameters (DeepSeek-V3.2 names)."""

    hadamard: torch.Tensor  # a buffer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.wq_b = _linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype)
        self.wk = _linear(cfg.dim, cfg.index_head_dim, dtype)
        self.k_norm = LayerNorm(cfg.index_head_dim)
        self.weights_proj = _linear(cfg.dim, cfg.index_n_heads, torch.float32)  # runs in fp32
        # Built with the model (not on first use, which would copy it to the device mid-forward).
        self.register_buffer("hadamard", hadamard_matrix(cfg.index_head_dim), persistent=False)


@dataclass
class Projection:
    """Per-token outputs of :meth:`DSAAttention.project` for ``T`` tokens (the three index fields
    are ``None`` on an IndexShare shared layer)."""

    q: torch.Tensor  # [T, H, kv_lora + rope]: absorbed q_nope then roped q_pe (compute dtype)
    kv: torch.Tensor  # [T, kv_lora + rope]: kv_norm(latent) then roped k_pe (compute dtype)
    index_q_fp8: torch.Tensor | None  # [T, Hi, D] float8_e4m3fn
    index_weights: torch.Tensor | None  # [T, Hi] float32 (head weights * Hi^-0.5 * D^-0.5 * q_scale)
    index_k: torch.Tensor | None  # [T, D] rotated indexer key before quantization (compute dtype)


class DSAAttention(nn.Module):
    """MLA (absorbed) + lightning indexer for one layer; see the module docstring.

    ``indexer=False``: an IndexShare shared layer, without an indexer (``self.indexer is None``).
    """

    rope_freqs: torch.Tensor  # a buffer

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, ops: ComputeOps = TORCH_OPS, indexer: bool = True
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops  # the indexer top-k and sparse attention: torch references unless kernels are plugged in
        h = cfg.n_heads
        self.wq_a = _linear(cfg.dim, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, ops)
        self.wq_b = _linear(cfg.q_lora_rank, h * cfg.qk_head_dim, dtype)
        self.wkv_a = _linear(cfg.dim, cfg.kv_width, dtype)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps, ops)
        self.wkv_b = _linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype)
        self.wo = _linear(h * cfg.v_head_dim, cfg.dim, dtype)
        self.indexer = Indexer(cfg, dtype) if indexer else None
        self.register_buffer("rope_freqs", rope_frequencies(cfg), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int = 0,
        cache: LayerCache | None = None,
        reuse_topk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's new tokens ``x [T, dim]`` at positions ``start_pos ..`` -> ``(out [T, dim], topk [T, K])``.

        ``cache`` holds the request's first ``start_pos`` tokens in the KV byte layouts and gets the
        ``T`` new ones appended; ``None`` starts an empty one (FP8 cache, 64-token pages; then
        ``start_pos`` must be 0). ``topk`` lists the selected key positions per query, ``-1`` padded.
        ``reuse_topk``: on a layer without an indexer (IndexShare), the full layer's top-k to attend with.
        """
        from reference_impl.kvcache.layout import KVLayout
        from reference_impl.model.cache import LayerCache, attention_forward

        if cache is None:
            layout = KVLayout.from_config(self.cfg, "fp8", 64)
            cache = LayerCache.empty(layout, x.device, with_index=self.indexer is not None)
        out, topk, _ = attention_forward(self, x, start_pos, cache, reuse_topk=reuse_topk)
        return out, topk

    # ---- per-token half -----------------------------------------------------------------------

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> Projection:
        """Project ``x [T, dim]`` at absolute ``positions [T]`` into queries and cache entries."""
        cfg = self.cfg
        n_tok, h = x.shape[0], cfg.n_heads
        cos, sin = rope_cos_sin(self.rope_freqs, positions)

        qr = self.q_norm(self.wq_a(x))  # [T, q_lora], shared by MLA and the indexer
        q = self.wq_b(qr).view(n_tok, h, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)  # MLA: [nope, rope]
        w_uk = self.wkv_b.weight.view(h, -1, cfg.kv_lora_rank)[:, : cfg.qk_nope_head_dim]  # [H, nope, c]
        # The absorbed q [T, H, c + rope] is written in place: the per-head product straight into its
        # latent columns (a strided batched GEMM output), the roped part beside it. A torch.cat of
        # the two would copy the [T, H, 576] tensor once more (2.4 GB per layer at 16K tokens).
        q_full = torch.empty(n_tok, h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=q.dtype, device=q.device)
        latent_q = q_full[..., : cfg.kv_lora_rank].transpose(0, 1)  # [H, T, c] view
        padded = pad_rows(q_nope)
        if padded is q_nope:
            torch.bmm(q_nope.transpose(0, 1), w_uk, out=latent_q)
        else:  # a few CPU rows: multiply padded ones (see MIN_CPU_GEMM_ROWS)
            latent_q.copy_(torch.bmm(padded.transpose(0, 1), w_uk)[:, :n_tok])
        self.ops.rope_into(q_full[..., cfg.kv_lora_rank :], q_pe, cos, sin, True)

        latent, k_pe = self.wkv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_pe = apply_rope(k_pe, cos, sin, interleaved=True)
        kv = torch.cat([self.kv_norm(latent), k_pe], dim=-1)

        if self.indexer is None:  # IndexShare: a shared layer projects no indexer q / k
            return Projection(q_full, kv, None, None, None)
        iq, ik, iw = self._index_qkw(x, qr, cos, sin)
        return Projection(q_full, kv, iq, iw, ik)

    def _index_qkw(
        self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's ``(q_fp8 [T, Hi, D], rotated k [T, D], head weights [T, Hi] f32)``."""
        cfg, idx = self.cfg, self.indexer
        assert idx is not None
        n_tok, d, r = x.shape[0], cfg.index_head_dim, cfg.qk_rope_head_dim
        inter = cfg.index_rope_interleaved
        q = idx.wq_b(qr).view(n_tok, cfg.index_n_heads, d)  # per head [rope, nope], rope first
        q_fp8, weights = self.ops.indexer_query(
            q, cos, sin, idx.hadamard, idx.weights_proj(x.float()), r, inter, cfg.index_scale_fmt
        )
        k = idx.k_norm(idx.wk(x))
        k_pe, k_nope = k.split([r, d - r], dim=-1)
        k = torch.cat([apply_rope(k_pe, cos, sin, inter), k_nope], dim=-1)
        return q_fp8, hadamard_rotate(k, idx.hadamard), weights

    # ---- full-view half -----------------------------------------------------------------------

    def attend(
        self,
        proj: Projection,
        kv_view: torch.Tensor,  # [S, kv_lora + rope] bf16 full view (dequantized cache)
        index_k_fp8: torch.Tensor | None,  # [S, D] float8_e4m3fn full view (None on a shared layer)
        index_k_scale: torch.Tensor | None,  # [S] float32
        key_start: torch.Tensor,  # [T] int64: first full-view row of the query's request
        key_end: torch.Tensor,  # [T] int64: exclusive causal end (request start + prefix + j + 1)
        host_bounds: HostKeyBounds | None = None,  # host copies of key_start / key_end (no host sync)
        reuse_topk: torch.Tensor | None = None,  # [T, K] the previous full layer's top-k (IndexShare)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer top-k + sparse MLA for the projected queries -> ``(out [T, dim], topk [T, K] int32)``.

        ``topk`` holds full-view rows (``-1`` for unused slots when fewer than K keys are visible).
        A layer without an indexer (IndexShare) skips the logits and the top-k and attends with
        ``reuse_topk``, the same queries' selection of the full layer before it, which it returns
        as its own; a full layer ignores ``reuse_topk``.
        """
        cfg = self.cfg
        if self.indexer is None:
            if reuse_topk is None:
                raise ValueError(
                    "a shared (IndexShare) layer needs the top-k of a full layer before it: pass reuse_topk"
                )
            topk = reuse_topk
        else:
            if proj.index_q_fp8 is None or proj.index_weights is None or index_k_fp8 is None or index_k_scale is None:
                raise ValueError(
                    "a full layer attends with its indexer: the projection and the view need indexer q / K"
                )
            topk = self.ops.indexer_topk(
                proj.index_q_fp8,
                proj.index_weights,
                index_k_fp8,
                index_k_scale,
                key_start,
                key_end,
                cfg.index_topk,
                host_bounds=host_bounds,
            )
        w_uv = self.wkv_b.weight.view(cfg.n_heads, -1, cfg.kv_lora_rank)[:, cfg.qk_nope_head_dim :]  # [H, v, c]
        o_latent, _ = self.ops.sparse_mla_attention(  # [T, H, c], stored in the weights' dtype (no fp32 buffer)
            proj.q.to(kv_view.dtype), kv_view, topk, cfg.softmax_scale, cfg.kv_lora_rank, out_dtype=w_uv.dtype
        )
        # o [T, H, v] is written in place by the per-head product (a strided batched GEMM output); an
        # einsum returns it as an [H, T, v] product that flatten(1) copies once more (0.5 GB per layer at 16K tokens).
        n_tok = o_latent.shape[0]
        o = torch.empty(n_tok, cfg.n_heads, w_uv.shape[1], dtype=w_uv.dtype, device=o_latent.device)
        padded = pad_rows(o_latent)
        if padded is o_latent:
            torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))
        else:  # a few CPU rows: multiply padded ones (see MIN_CPU_GEMM_ROWS)
            o.transpose(0, 1).copy_(torch.bmm(padded.transpose(0, 1), w_uv.transpose(1, 2))[:, :n_tok])
        return self.wo(o.flatten(1)), topk

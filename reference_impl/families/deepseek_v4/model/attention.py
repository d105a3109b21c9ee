"""One DeepSeek-V4 attention layer (sliding window, CSA or HCA), split where CP needs it.

Parameter names follow DeepSeek-V4's ``inference/model.py`` (``wq_a, q_norm, wq_b, wkv, kv_norm,
wo_a, wo_b, attn_sink, compressor.{wkv, wgate, ape, norm}, indexer.{wq_b, weights_proj,
compressor.*}``); :mod:`.checkpoint` maps them to the Hugging Face names. Per token ``t``:

* ``q = RoPE(rms(wq_b(q_norm(wq_a(x)))))`` per head (an unweighted RMS norm per head, RoPE on the
  last 64 of 512 dims), ``kv = RoPE(kv_norm(wkv(x)))``: the raw entry the window reads;
* CSA / HCA: the compressor's pre-pool rows (:mod:`.compressor`); CSA: the indexer's query
  ``Hadamard(RoPE(indexer.wq_b(qr)))``, its head weights and its own compressor's rows;
* attention over ``[window | entries]`` with sinks (:mod:`.sparse`), scale ``512^-0.5``;
* inverse RoPE (position ``-t``) on the output's last 64 dims, because K = V carried RoPE into it;
* grouped output: heads in ``o_groups`` groups, each ``wo_a``-projected to ``o_lora_rank``, then
  ``wo_b`` mixes the groups to ``dim``.

Sliding layers use plain RoPE (``rope_theta``); CSA / HCA layers, their compressors and the
indexer use YaRN on ``compress_rope_theta``. With the FP8 layout the indexer's query is quantized
to FP4 like its keys (the model's quantization-aware simulation); with BF16 nothing is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from reference_impl.families.deepseek_v4.config import V4ModelConfig
from reference_impl.families.deepseek_v4.model.compressor import CSA_RATIO, Compressor
from reference_impl.families.deepseek_v4.model.ops import V4_TORCH_OPS, V4Ops
from reference_impl.fp8 import hadamard_matrix, hadamard_rotate
from reference_impl.model.attention import RMSNorm, RowStableLinear, pad_rows
from reference_impl.model.rope import rope_cos_sin, yarn_frequencies


def layer_frequencies(cfg: V4ModelConfig, ratio: int) -> torch.Tensor:
    """RoPE frequencies of a layer: plain ``rope_theta`` for sliding layers, YaRN on
    ``compress_rope_theta`` for CSA / HCA layers (and their compressors and indexer)."""
    if ratio == 0:
        return yarn_frequencies(cfg.rope_head_dim, cfg.rope_theta, 1.0, 0, cfg.beta_fast, cfg.beta_slow)
    return yarn_frequencies(
        cfg.rope_head_dim, cfg.compress_rope_theta, cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow
    )


class Indexer(nn.Module):
    """The CSA layer's lightning indexer: its query projection, head weights and ratio-4 compressor."""

    hadamard: torch.Tensor  # a buffer

    def __init__(self, cfg: V4ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.index_head_dim
        self.wq_b = RowStableLinear(cfg.q_lora_rank, cfg.index_n_heads * d, bias=False, dtype=dtype)
        self.weights_proj = RowStableLinear(cfg.dim, cfg.index_n_heads, bias=False, dtype=dtype)
        self.compressor = Compressor(cfg.dim, d, CSA_RATIO, cfg.rope_head_dim, cfg.norm_eps, rotate=True)
        self.register_buffer("hadamard", hadamard_matrix(d), persistent=False)


@dataclass
class V4Projection:
    """Per-token outputs of :meth:`V4Attention.project` for ``T`` tokens (``None`` where the layer type has none)."""

    q: torch.Tensor  # [T, H, D] normed, roped queries (compute dtype)
    kv: torch.Tensor  # [T, D] the raw entry before quantization (compute dtype)
    pool_kv: torch.Tensor | None = None  # [T, coff * D] float32 compressor value rows
    pool_score: torch.Tensor | None = None  # [T, coff * D] float32 compressor score rows (ape added)
    index_q: torch.Tensor | None = None  # [T, Hi, Di] indexer queries (CSA)
    index_weights: torch.Tensor | None = None  # [T, Hi] float32
    index_pool_kv: torch.Tensor | None = None  # [T, 2 * Di] float32 (the indexer's compressor)
    index_pool_score: torch.Tensor | None = None


class V4Attention(nn.Module):
    """One V4 attention layer; ``ratio`` 0, 4 or 128 picks sliding, CSA or HCA (see the module docstring)."""

    freqs: torch.Tensor  # a buffer

    def __init__(
        self,
        cfg: V4ModelConfig,
        ratio: int,
        dtype: torch.dtype = torch.bfloat16,
        ops: V4Ops = V4_TORCH_OPS,
    ) -> None:
        super().__init__()
        self.cfg, self.ratio, self.ops = cfg, ratio, ops
        h, d = cfg.n_heads, cfg.head_dim
        self.wq_a = RowStableLinear(cfg.dim, cfg.q_lora_rank, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = RowStableLinear(cfg.q_lora_rank, h * d, bias=False, dtype=dtype)
        self.wkv = RowStableLinear(cfg.dim, d, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(d, cfg.norm_eps)
        self.wo_a = RowStableLinear(cfg.group_width, cfg.o_groups * cfg.o_lora_rank, bias=False, dtype=dtype)
        self.wo_b = RowStableLinear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, bias=False, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor = (
            Compressor(cfg.dim, d, ratio, cfg.rope_head_dim, cfg.norm_eps, rotate=False) if ratio else None
        )
        self.indexer = Indexer(cfg, dtype) if ratio == CSA_RATIO else None
        self.register_buffer("freqs", layer_frequencies(cfg, ratio), persistent=False)

    @property
    def layer_type(self) -> str:
        return {0: "sliding", CSA_RATIO: "csa"}.get(self.ratio, "hca")

    # ---- per-token half -----------------------------------------------------------------------

    def project(self, x: torch.Tensor, positions: torch.Tensor, quantize_index: bool) -> V4Projection:
        """Project ``x [T, dim]`` at ``positions [T]``; ``quantize_index``: FP4-simulate the indexer query."""
        cfg = self.cfg
        n_tok, rd = x.shape[0], cfg.rope_head_dim
        cos, sin = rope_cos_sin(self.freqs, positions)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(n_tok, cfg.n_heads, cfg.head_dim)
        q = self.ops.rope_tail(q, cos, sin, rd, rms_eps=cfg.norm_eps)  # per-head RMS norm, then RoPE
        kv = self.ops.rope_tail(self.kv_norm(self.wkv(x)), cos, sin, rd)
        proj = V4Projection(q, kv)
        if self.compressor is not None:
            proj.pool_kv, proj.pool_score = self.compressor.project(x, positions)
        if self.indexer is not None:
            idx = self.indexer
            iq = idx.wq_b(qr).view(n_tok, cfg.index_n_heads, cfg.index_head_dim)
            iq = hadamard_rotate(self.ops.rope_tail(iq, cos, sin, rd), idx.hadamard)
            proj.index_q = self.ops.fp4_simulate(iq) if quantize_index else iq
            scale = cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5
            proj.index_weights = idx.weights_proj(x).float() * scale
            proj.index_pool_kv, proj.index_pool_score = idx.compressor.project(x, positions)
        return proj

    # ---- entries ------------------------------------------------------------------------------

    def finish_entries(self, pooled: torch.Tensor, entries: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pooled main entries ``[E, D]`` float32 -> the entries (norm, RoPE at ``w * ratio``)."""
        assert self.compressor is not None
        return self.compressor.finish(pooled, entries, self.freqs, dtype)

    def finish_index_keys(self, pooled: torch.Tensor, entries: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pooled indexer keys ``[E, Di]`` float32 -> the keys (norm, RoPE, Hadamard)."""
        assert self.indexer is not None
        return self.indexer.compressor.finish(pooled, entries, self.freqs, dtype, self.indexer.hadamard)

    # ---- attention and output -----------------------------------------------------------------

    def attend(
        self,
        proj: V4Projection,
        positions: torch.Tensor,  # [T] absolute positions of the queries
        view: torch.Tensor,  # [S, D] dequantized entries (window tokens and compressed entries)
        indices: torch.Tensor,  # [T, K] rows of view, -1 unused
        dense_start: torch.Tensor | None = None,  # [T] first view row of a dense run (HCA entries)
        dense_len: torch.Tensor | None = None,  # [T] its length
        dense_width: int | None = None,  # host bound on dense_len
    ) -> torch.Tensor:
        """Attention with sinks over the given rows, inverse RoPE, grouped output -> ``[T, dim]``."""
        cfg = self.cfg
        o = self.ops.sparse_attention(
            proj.q.to(view.dtype), view, indices, self.attn_sink, cfg.softmax_scale, dense_start, dense_len, dense_width
        )
        cos, sin = rope_cos_sin(self.freqs, positions)
        o = self.ops.rope_tail(o, cos, -sin, cfg.rope_head_dim, out_dtype=proj.q.dtype)  # inverse RoPE
        return self.output(o)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output ``[T, H, D] -> [T, dim]``: per group ``wo_a``, then ``wo_b``."""
        cfg = self.cfg
        n_tok = o.shape[0]
        grouped = pad_rows(o.reshape(n_tok, cfg.o_groups, cfg.group_width))  # a few CPU rows: see MIN_CPU_GEMM_ROWS
        w = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, cfg.group_width)
        mixed = torch.bmm(grouped.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)[:n_tok]  # [T, G, o_lora]
        return self.wo_b(mixed.flatten(1))

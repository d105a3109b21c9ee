"""The single-device oracle for DeepSeek-V4: N layers over a batch of requests on dense caches.

Same shape as the V3.2 oracle (:mod:`reference_impl.model.oracle`): a request's prefix is computed
by an earlier prefill of those tokens, then its extend runs in chunks of ``chunk_size`` (or one);
the model around the layers is ``h + attn(attn_norm(h))`` per layer, a final norm and an LM head
(DeepSeek-V4's hyper-connections and MoE are not part of the CP story). The caches hold exactly
the bytes of :mod:`reference_impl.families.deepseek_v4.cache_layout`, so a CP run's can be compared byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from reference_impl.families.deepseek_v4.config import V4ModelConfig
from reference_impl.families.deepseek_v4.model.attention import V4Attention, V4Projection
from reference_impl.families.deepseek_v4.model.cache import V4LayerCache, v4_layer_forward
from reference_impl.families.deepseek_v4.model.ops import V4_TORCH_OPS, V4Ops
from reference_impl.model.attention import RMSNorm
from reference_impl.model.oracle import chunk_spans, init_weights


class V4Block(nn.Module):
    """``h + attn(attn_norm(h))``; the attention's parameters sit under ``attn.``."""

    def __init__(self, cfg: V4ModelConfig, layer: int, dtype: torch.dtype, ops: V4Ops) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = V4Attention(cfg, cfg.ratio(layer), dtype, ops)


class V4Model(nn.Module):
    """``n_layers`` V4 blocks (their types from ``cfg.compress_ratios``), a final norm and an LM head."""

    def __init__(self, cfg: V4ModelConfig, dtype: torch.dtype = torch.bfloat16, ops: V4Ops = V4_TORCH_OPS) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(V4Block(cfg, i, dtype, ops) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=dtype)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden)).float()


def build_v4_model(
    cfg: V4ModelConfig, dtype: torch.dtype, seed: int, device: torch.device | str, ops: V4Ops = V4_TORCH_OPS
) -> V4Model:
    """Deterministic random weights (:func:`reference_impl.model.oracle.init_weights`'s rules)."""
    with torch.device(device):
        model = V4Model(cfg, dtype, ops)
    return init_weights(model, seed).eval()


@dataclass
class V4OracleResult:
    """Everything a V4 CP run is compared against."""

    hidden: list[torch.Tensor]  # per request: final hidden states of the extend tokens [E, dim]
    topk: list[list[torch.Tensor]]  # [layer][request]: [E, index_topk] int32 CSA entries ([E, 0] elsewhere)
    caches: list[list[V4LayerCache]]  # [layer][request]
    projections: list[list[V4Projection]]  # [layer][request]: the extend part (index scores for tie checks)

    def index_scores(self, layer: int, request: int, row: int, keys: torch.Tensor | None = None) -> torch.Tensor | None:
        """Index scores of extend row ``row`` over the request's CSA entries (``None`` off CSA layers):
        against the oracle's indexer keys, or ``keys [entries, Di]`` when given (a CP run's own)."""
        from reference_impl.families.deepseek_v4.cache_layout import decode_index
        from reference_impl.families.deepseek_v4.model.sparse import index_scores

        proj, cache = self.projections[layer][request], self.caches[layer][request]
        if proj.index_q is None:
            return None
        assert proj.index_weights is not None  # project() sets the indexer's queries and weights together
        if keys is None:
            keys = decode_index(cache.index_keys, cache.codec, cache.index_head_dim)
        q, w = proj.index_q[row : row + 1], proj.index_weights[row : row + 1]
        return index_scores(q, w, keys.to(q.device))[0]


@torch.no_grad()
def run_v4_oracle(
    model: V4Model,
    prefix_lens: list[int],
    inputs: list[torch.Tensor],
    codec: str,
    chunk_size: int | None = None,
    view_dtype: torch.dtype = torch.bfloat16,
) -> V4OracleResult:
    """Run the batch on one device; ``inputs[i]`` is request i's layer-0 input ``[prefix + extend, dim]``."""
    cfg = model.cfg
    device = inputs[0].device
    caches = [
        [V4LayerCache.empty(codec, cfg.ratio(layer), cfg.head_dim, cfg.index_head_dim, device) for _ in inputs]
        for layer in range(cfg.n_layers)
    ]
    hidden: list[torch.Tensor] = []
    topks: list[list[torch.Tensor]] = [[] for _ in model.layers]
    projs: list[list[V4Projection]] = [[] for _ in model.layers]
    for req, (x_all, prefix) in enumerate(zip(inputs, prefix_lens)):
        spans = chunk_spans(prefix, x_all.shape[0], chunk_size)
        outs: list[list[torch.Tensor]] = [[] for _ in model.layers]
        parts: list[list[V4Projection]] = [[] for _ in model.layers]
        hs = []
        for start, stop in spans:
            if stop == start:
                continue
            h = x_all[start:stop]
            for layer, block in enumerate(cast("list[V4Block]", model.layers)):  # ModuleList yields nn.Module
                out, topk, proj = v4_layer_forward(
                    block.attn, block.attn_norm(h), start, caches[layer][req], view_dtype
                )
                h = h + out
                if start >= prefix:
                    outs[layer].append(topk)
                    parts[layer].append(proj)
            if start >= prefix:
                hs.append(h)
        for layer in range(cfg.n_layers):
            topks[layer].append(torch.cat(outs[layer]))
            projs[layer].append(_cat(parts[layer]))
        hidden.append(torch.cat(hs))
    return V4OracleResult(hidden, topks, caches, projs)


def _cat(parts: list[V4Projection]) -> V4Projection:
    if len(parts) == 1:
        return parts[0]
    optional = ("pool_kv", "pool_score", "index_q", "index_weights", "index_pool_kv", "index_pool_score")

    def cat_optional(field: str) -> torch.Tensor | None:
        return None if getattr(parts[0], field) is None else torch.cat([getattr(p, field) for p in parts])

    return V4Projection(
        torch.cat([p.q for p in parts]), torch.cat([p.kv for p in parts]), *(cat_optional(f) for f in optional)
    )

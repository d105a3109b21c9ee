"""The single-device oracle: N DSA layers over a batch of requests on a dense cache.

Every CP configuration is checked against this. A request's **prefix** (tokens already cached)
is produced the way a serving engine produced it, by an earlier prefill of those tokens; then the
**extend** part runs with ``start_pos = prefix``. The cache holds exactly the bytes of the KV
layouts (:mod:`reference_impl.kvcache.layout`), dense and sequence-ordered per request, so a CP
run's cache can be compared with it byte for byte.

The model around the attention layers is the thinnest one that composes: ``h + attn(norm(h))``
per layer (the MoE/MLP half of a DeepSeek block is not part of the CP story), then a final norm
and an LM head for the logits of the output rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch
from torch import nn

from reference_impl.config import KVDtype
from reference_impl.kvcache.layout import KVLayout
from reference_impl.model.attention import DSAAttention, Projection, RMSNorm
from reference_impl.model.cache import LayerCache, attention_forward
from reference_impl.model.prefix_prefill import prefix_spans
from reference_impl.model.sparse_attention import TORCH_OPS, ComputeOps
from reference_impl.presets import ModelConfig

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class DSABlock(nn.Module):
    """``h + attn(attn_norm(h))``; the attention's parameters sit under ``attn.``
    (``indexer=False``: an IndexShare shared layer, with no indexer)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: ComputeOps = TORCH_OPS, indexer: bool = True) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.attn = DSAAttention(cfg, dtype, ops, indexer=indexer)


class DSAModel(nn.Module):
    """``n_layers`` DSA blocks, a final norm and an LM head.

    ``ops`` computes the indexer top-k and the sparse attention: the torch references by default
    (:data:`~reference_impl.model.sparse_attention.TORCH_OPS`), the kernels with
    :data:`~reference_impl.kernels.dispatch.KERNEL_OPS`. The layers that IndexShare marks shared
    (``cfg.index_share``) have no indexer and reuse the top-k of the full layer before them.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, ops: ComputeOps = TORCH_OPS) -> None:
        super().__init__()
        self.cfg = cfg
        share = cfg.index_share
        self.layers = nn.ModuleList(DSABlock(cfg, dtype, ops, share.is_full(i)) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=dtype)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final hidden states ``[N, dim] -> [N, vocab]``."""
        return self.head(self.norm(hidden)).float()


@torch.no_grad()
def init_weights(model: ModuleT, seed: int) -> ModuleT:
    """Deterministic random weights: the same seed gives the same bytes in every process.

    Linear weights ~ N(0, 1/fan_in); norm weights 1 + N(0, 0.1^2); the indexer's k_norm bias N(0, 0.1^2).
    Drawn in a fixed order by a generator on the parameters' device (bytes match across processes
    on the same kind of device, not between CPU and CUDA).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        w = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
        if p.dim() == 2:
            w /= p.shape[1] ** 0.5
        elif name.endswith("bias"):
            w *= 0.1
        else:
            w = 1.0 + 0.1 * w
        p.copy_(w.to(p.dtype))
    return model


@dataclass
class OracleResult:
    """Everything a CP run is compared against."""

    hidden: list[torch.Tensor]  # per request: final hidden states of the extend tokens [E, dim]
    topk: list[list[torch.Tensor]]  # [layer][request]: [E, K] int32 positions within the request
    caches: list[list[LayerCache]]  # [layer][request]: dense cache of prefix + extend tokens
    projections: list[list[Projection]] = field(default_factory=list)  # [layer][request], extend part

    index_source: list[int] = field(default_factory=list)  # [layer]: the full layer whose top-k it uses

    def index_scores(self, layer: int, request: int, row: int) -> torch.Tensor:
        """Index scores of extend row ``row`` of ``request`` at ``layer`` over its visible keys
        (an IndexShare shared layer's are those of the full layer whose top-k it reuses)."""
        from reference_impl.model.sparse_attention import indexer_scores

        layer = self.index_source[layer] if self.index_source else layer
        proj, cache = self.projections[layer][request], self.caches[layer][request]
        assert proj.index_q_fp8 is not None and proj.index_weights is not None
        return indexer_scores(
            proj.index_q_fp8[row : row + 1], proj.index_weights[row : row + 1], cache.index_fp8, cache.index_scale
        )[0]


@torch.no_grad()
def run_oracle(
    model: DSAModel,
    prefix_lens: list[int],
    inputs: list[torch.Tensor],
    kv_dtype: KVDtype,
    page_size: int = 64,
    chunk_size: int | None = None,
    view_dtype: torch.dtype = torch.bfloat16,
) -> OracleResult:
    """Run the batch on one device. ``inputs[i]`` is request i's layer-0 input ``[prefix + extend, dim]``.

    ``view_dtype``: the dtype the dequantized KV is read in for attention. bf16 (the default) is
    what the engine's full view holds; ``torch.float32`` gives a float32 oracle end to end for a
    float32 model (a reference for kernel work, not for comparing with the engine).

    ``chunk_size`` runs each extend in chunks (chunked prefill), the way a CP run with the same
    ``chunk_size`` does; the math is the same causal function either way, and matching chunk
    boundaries also makes the floating-point reductions, hence the cache bytes, match. The prefix
    runs in the chunks a CP run installs it in
    (:func:`~reference_impl.model.prefix_prefill.prefix_spans`).
    """
    cfg = model.cfg
    layout = KVLayout.from_config(cfg, kv_dtype, page_size)
    device = inputs[0].device
    share = cfg.index_share  # IndexShare: shared layers keep no index K and reuse a full layer's top-k
    caches = [
        [LayerCache.empty(layout, device, share.is_full(layer)) for _ in inputs] for layer in range(len(model.layers))
    ]
    hidden: list[torch.Tensor] = []
    topks: list[list[torch.Tensor]] = [[] for _ in model.layers]
    projs: list[list[Projection]] = [[] for _ in model.layers]
    for req, (x_all, prefix) in enumerate(zip(inputs, prefix_lens)):
        total = x_all.shape[0]
        step = chunk_size or max(total - prefix, 1)
        spans = prefix_spans(prefix) + [(s, min(s + step, total)) for s in range(prefix, total, step)]
        outs: list[list[torch.Tensor]] = [[] for _ in model.layers]
        proj_parts: list[list[Projection]] = [[] for _ in model.layers]
        hs = []
        for start, stop in spans:  # the earlier prefill (the prefix), then this run's chunks
            if stop == start:
                continue
            h = x_all[start:stop]
            topk = None
            for layer, block in enumerate(cast("list[DSABlock]", model.layers)):  # ModuleList yields nn.Module
                out, topk, proj = attention_forward(
                    block.attn, block.attn_norm(h), start, caches[layer][req], view_dtype, reuse_topk=topk
                )
                h = h + out
                if start >= prefix:
                    outs[layer].append(topk)
                    proj_parts[layer].append(proj)
            if start >= prefix:
                hs.append(h)
        for layer in range(len(model.layers)):
            topks[layer].append(torch.cat([_pad_topk(t, model.cfg.index_topk) for t in outs[layer]]))
            projs[layer].append(_cat_projections(proj_parts[layer]))
        hidden.append(torch.cat(hs))
    return OracleResult(hidden, topks, caches, projs, [share.source(layer) for layer in range(len(model.layers))])


def chunk_spans(prefix: int, total: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """A request's prefill spans ``[(start, stop)]``: the earlier prefill of its ``prefix`` tokens,
    then this run's chunks of ``chunk_size`` (one chunk when ``None``) up to ``total``."""
    step = chunk_size or max(total - prefix, 1)
    return [(0, prefix)] + [(s, min(s + step, total)) for s in range(prefix, total, step)]


def _pad_topk(topk: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k rows padded with -1 to ``k`` columns (early rows of a short view select fewer)."""
    if topk.shape[1] == k:
        return topk
    return torch.cat([topk, topk.new_full((topk.shape[0], k - topk.shape[1]), -1)], dim=1)


def _cat_projections(parts: list[Projection]) -> Projection:
    if len(parts) == 1:
        return parts[0]

    def cat(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return Projection(*(cat(f) for f in ("q", "kv", "index_q_fp8", "index_weights", "index_k")))  # type: ignore[arg-type]

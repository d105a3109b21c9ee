"""The GLM-5.3 model around its attention layers, each layer's call on one span, and the oracle.

The model is ``h + attn(attn_norm(h))`` per layer, a final norm and an LM head: GLM-5.3's MoE / MLP
half of a block and its hyper-connection streams (``hc_mult`` residual streams mixed by Sinkhorn
routing) are left out, as they are not part of the CP story (they act on each token alone).

:func:`kda_span` and :func:`dsa_span` run one layer over one span of one request (its prefix, or a
chunk), reading and extending that layer's cache of the request (:class:`KDACache`,
:class:`DSACache`). The oracle (:func:`run_glm53_oracle`) runs each request's prefix as an earlier
prefill, then its extend in chunks of ``chunk_size`` (or one), and returns the extend tokens' final
hidden states, every layer's selections and every layer's caches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from reference_impl.families.glm53.cache_layout import LatentRows
from reference_impl.families.glm53.config import Glm53Config
from reference_impl.families.glm53.model.dsa import INDEXER_TORCH_OPS, IndexerOps, MLAttention, RMSNorm, visible_groups
from reference_impl.families.glm53.model.kda import KDA_TORCH_OPS, KDAOps, KDAttention


class Glm53Block(nn.Module):
    """``h + attn(attn_norm(h))``; the attention (KDA or MLA) sits under ``attn.``."""

    def __init__(
        self, cfg: Glm53Config, layer: int, kda_ops: KDAOps = KDA_TORCH_OPS, index_ops: IndexerOps = INDEXER_TORCH_OPS
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.attn: KDAttention | MLAttention = (
            KDAttention(cfg, kda_ops) if cfg.is_kda(layer) else MLAttention(cfg, cfg.shares_selection(layer), index_ops)
        )


class Glm53Model(nn.Module):
    """``n_layers`` blocks (their types from ``cfg.layer_types``), a final norm and an LM head; the KDA
    layers' recurrence through ``kda_ops``, the indexed layers' scoring and selection through ``index_ops``
    (the torch references by default)."""

    def __init__(
        self, cfg: Glm53Config, kda_ops: KDAOps = KDA_TORCH_OPS, index_ops: IndexerOps = INDEXER_TORCH_OPS
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Glm53Block(cfg, i, kda_ops, index_ops) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden.to(self.head.weight))).float()


FP32_PARAMS = ("conv1d.weight", "dt_bias", "A_log")  # float32 in every compute dtype (transformers keeps them so)


@torch.no_grad()
def init_glm53_weights(model: Glm53Model, seed: int) -> Glm53Model:
    """Deterministic random weights from ``seed`` (a generator on the parameters' device, in a fixed order).

    Matrices ~ N(0, 1/fan_in); norm weights and biases 1 + N(0, 0.1^2) and N(0, 0.1^2); the convolution
    ~ N(0, 1/width); the indexer's position bias N(0, 1) and pooling gate N(0, 1/dim). The forget gate's
    ``dt_bias`` ~ N(-5, 0.5^2) and ``A_log`` 0 give decays of a few percent per token (a state that
    remembers tens of tokens, as trained models' do), so that a lost state hand-off shows.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        w = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("dt_bias"):
            w = -5.0 + 0.5 * w
        elif name.endswith("A_log"):
            w = torch.zeros_like(w)
        elif name.endswith("conv1d.weight"):
            w /= math.sqrt(p.shape[-1])
        elif name.endswith("index_kpool_compress_ape"):
            pass
        elif p.dim() == 2:
            w /= p.shape[1] ** 0.5
        elif name.endswith("bias"):
            w *= 0.1
        else:
            w = 1.0 + 0.1 * w
        p.copy_(w.to(p.dtype))
    return model


def build_glm53_model(
    cfg: Glm53Config,
    dtype: torch.dtype,
    seed: int,
    device: torch.device | str,
    kda_ops: KDAOps = KDA_TORCH_OPS,
    index_ops: IndexerOps = INDEXER_TORCH_OPS,
) -> Glm53Model:
    """The model in ``dtype`` (the parameters ``transformers`` keeps in float32 stay so), weights from ``seed``,
    its KDA layers' recurrence through ``kda_ops``, its indexers' scoring and selection through ``index_ops``."""
    with torch.device(device):
        model = Glm53Model(cfg, kda_ops, index_ops)
    init_glm53_weights(model, seed)
    model.to(dtype)
    for name, p in model.named_parameters():
        if name.endswith(FP32_PARAMS):
            p.data = p.data.float()
    return model.eval()


# ---- caches and the per-span layer calls -----------------------------------------------------------


@dataclass
class KDACache:
    """One request's cache of one KDA layer: the state and the convolution's input tail."""

    state: torch.Tensor  # [heads, head_dim, head_dim] float32
    conv: torch.Tensor  # [conv - 1, conv_dim]: the last rows of ``mixed`` (zeros before the sequence)

    @classmethod
    def empty(cls, cfg: Glm53Config, dtype: torch.dtype, device: torch.device | str) -> KDACache:
        h, d = cfg.linear_num_heads, cfg.linear_head_dim
        return cls(
            torch.zeros(h, d, d, dtype=torch.float32, device=device),
            torch.zeros(cfg.linear_conv_kernel_dim - 1, cfg.conv_dim, dtype=dtype, device=device),
        )


@dataclass
class DSACache:
    """One request's cache of one indexed layer: every token's latent row, the raw indexer rows of its
    incomplete last group, and every complete group's pooled key (none on a layer sharing its selection)."""

    rows: LatentRows  # how ``latent`` is stored: FP8 rows or plain rows (:mod:`..cache_layout`)
    latent: torch.Tensor  # [S, rows.width]: the stored latent rows
    pending_k: torch.Tensor | None = None  # [S % kpool, Di]: raw keys of the incomplete group
    pending_gate: torch.Tensor | None = None  # [S % kpool, Di]: their pooling logits
    group_keys: torch.Tensor | None = None  # [S // kpool, Di] float32

    @classmethod
    def empty(
        cls,
        cfg: Glm53Config,
        layer: int,
        dtype: torch.dtype,
        cache_dtype: torch.dtype | LatentRows,
        device: torch.device | str,
    ) -> DSACache:
        """``cache_dtype``: the rows' format, or a dtype for plain rows of that dtype."""
        rows = cache_dtype if isinstance(cache_dtype, LatentRows) else LatentRows(cfg.kv_lora_rank, dtype=cache_dtype)
        latent = rows.empty(0, device)
        if cfg.shares_selection(layer):
            return cls(rows, latent)
        di = cfg.index_head_dim
        return cls(
            rows,
            latent,
            torch.zeros(0, di, dtype=dtype, device=device),
            torch.zeros(0, di, dtype=dtype, device=device),
            torch.zeros(0, di, dtype=torch.float32, device=device),
        )


def kda_span(attn: KDAttention, x: torch.Tensor, cache: KDACache) -> torch.Tensor:
    """One span ``x [T, dim]`` (after the layer's norm) of a request through a KDA layer; updates ``cache``."""
    mixed = attn.mixed(x)
    q, k, v = attn.qkv(attn.conv(mixed, cache.conv))
    g, beta = attn.gates(x)
    core, cache.state = attn.ops.chunked(q, k, v, g, beta, cache.state)
    cache.conv = torch.cat([cache.conv, mixed.to(cache.conv.dtype)])[-attn.halo :]
    return attn.finish(x, core)


def pool_pending(attn: MLAttention, cache: DSACache, index_k: torch.Tensor, index_gate: torch.Tensor) -> torch.Tensor:
    """Append a span's raw indexer rows to the incomplete group, pool every group they complete (appended
    to ``cache.group_keys``; also returned) and keep the new incomplete remainder."""
    assert cache.pending_k is not None and cache.pending_gate is not None and cache.group_keys is not None
    P = attn.cfg.index_kpool
    keys = torch.cat([cache.pending_k, index_k.to(cache.pending_k.dtype)])
    gates = torch.cat([cache.pending_gate, index_gate.to(cache.pending_gate.dtype)])
    full = len(keys) // P * P
    new = attn.pool(keys[:full].view(-1, P, keys.shape[1]), gates[:full].view(-1, P, gates.shape[1])).float()
    cache.group_keys = torch.cat([cache.group_keys, new])
    cache.pending_k, cache.pending_gate = keys[full:], gates[full:]
    return new


def dsa_span(
    attn: MLAttention, x: torch.Tensor, start: int, cache: DSACache, shared: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One span ``x [T, dim]`` at positions ``start ..`` through an indexed layer; updates ``cache``.
    ``shared``: the previous layer's selection, on a layer sharing it. Returns ``(output, selection)``."""
    proj = attn.project(x)
    cache.latent = torch.cat([cache.latent, cache.rows.encode(proj.latent)])
    positions = torch.arange(start, start + len(x), device=x.device)
    if attn.indexer is None:
        assert shared is not None, "a layer sharing its selection needs the previous layer's"
        selection = shared
    else:
        assert proj.index_k is not None and proj.index_gate is not None and proj.index_q is not None
        pool_pending(attn, cache, proj.index_k, proj.index_gate)
        assert cache.group_keys is not None and proj.index_w is not None
        cfg, keys = attn.cfg, cache.group_keys
        visible = visible_groups(positions, cfg.index_kpool, len(keys))
        scores = attn.ops.scores(proj.index_q, proj.index_w, keys, cfg.index_head_dim, visible)
        selection = attn.ops.select(cfg, scores, positions)
    return attn.attend(proj.q, cache.rows.decode(cache.latent), selection), selection


# ---- the oracle ---------------------------------------------------------------------------------------


@dataclass
class Glm53OracleResult:
    """Everything a GLM-5.3 CP run is compared against."""

    hidden: list[torch.Tensor]  # per request: the extend tokens' final hidden states [E, dim]
    selections: list[list[torch.Tensor]]  # [layer][request]: [E, width] int32 ([E, 0] on KDA layers)
    caches: list[list[KDACache | DSACache]]  # [layer][request]
    index_scores: list[list[torch.Tensor | None]] = field(default_factory=list)  # [layer][request]: [E, G] (ties)


def chunk_spans(prefix: int, total: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """The earlier prefill of the prefix, then this run's chunks of ``chunk_size`` (one when ``None``)."""
    step = chunk_size or max(total - prefix, 1)
    return [(0, prefix)] + [(s, min(s + step, total)) for s in range(prefix, total, step)]


def empty_caches(
    cfg: Glm53Config, dtype: torch.dtype, cache_dtype: torch.dtype | LatentRows, device: torch.device | str
) -> list[KDACache | DSACache]:
    return [
        KDACache.empty(cfg, dtype, device) if cfg.is_kda(i) else DSACache.empty(cfg, i, dtype, cache_dtype, device)
        for i in range(cfg.n_layers)
    ]


def run_layers(
    model: Glm53Model, h: torch.Tensor, start: int, caches: list[KDACache | DSACache]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One span of one request through every layer: ``(final hidden, per layer its selection)``."""
    selections: list[torch.Tensor] = []
    shared: torch.Tensor | None = None
    for block, cache in zip(cast("list[Glm53Block]", model.layers), caches):  # ModuleList yields nn.Module
        x = block.attn_norm(h)
        attn = block.attn
        if isinstance(cache, KDACache):
            assert isinstance(attn, KDAttention)  # empty_caches: a KDA cache exactly on the KDA layers
            h = h + kda_span(attn, x, cache)
            selections.append(torch.zeros(len(h), 0, dtype=torch.int32, device=h.device))
        else:
            assert isinstance(attn, MLAttention)
            out, shared = dsa_span(attn, x, start, cache, shared)
            h = h + out
            selections.append(shared)
    return h, selections


@torch.no_grad()
def run_glm53_oracle(
    model: Glm53Model,
    prefix_lens: list[int],
    inputs: list[torch.Tensor],
    cache_dtype: torch.dtype | LatentRows,
    chunk_size: int | None = None,
) -> Glm53OracleResult:
    """Run the batch on one device; ``inputs[i]`` is request i's layer-0 input ``[prefix + extend, dim]``.
    ``cache_dtype``: how the latent rows are stored (a run's :class:`LatentRows`, or a dtype for plain rows);
    attention reads them back decoded, as a CP rank does."""
    cfg = model.cfg
    hidden: list[torch.Tensor] = []
    selections: list[list[torch.Tensor]] = [[] for _ in range(cfg.n_layers)]
    caches: list[list[KDACache | DSACache]] = [[] for _ in range(cfg.n_layers)]
    for x_all, prefix in zip(inputs, prefix_lens):
        request_caches = empty_caches(cfg, x_all.dtype, cache_dtype, x_all.device)
        outs: list[list[torch.Tensor]] = [[] for _ in range(cfg.n_layers)]
        hs = []
        for start, stop in chunk_spans(prefix, len(x_all), chunk_size):
            if stop == start:
                continue
            h, sel = run_layers(model, x_all[start:stop], start, request_caches)
            if start >= prefix:
                hs.append(h.float())
                for layer in range(cfg.n_layers):
                    outs[layer].append(sel[layer])
        hidden.append(torch.cat(hs))
        for layer in range(cfg.n_layers):
            selections[layer].append(torch.cat(outs[layer]))
            caches[layer].append(request_caches[layer])
    return Glm53OracleResult(hidden, selections, caches)

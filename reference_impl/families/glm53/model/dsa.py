"""GLM-5.3's indexed layer: MLA without RoPE under DSA with pooled indexer keys, pure torch.

The math is ``transformers``' ``Glm5NextTextAttention`` and ``Glm5NextTextIndexer`` (eager path), for
one sequence at a time:

* **MLA without RoPE.** ``q = q_b(rmsnorm(q_a(x)))`` per head (``qk_nope_head_dim`` wide, no RoPE
  part); the cache row is ``latent = rmsnorm(kv_a(x))`` (``kv_lora_rank`` wide, nothing else); keys
  and values are ``kv_b(latent)`` per head; scale ``qk_head_dim^-0.5``; softmax in float32 over the
  selected keys.
* **Pooled indexer keys.** Per token ``k = layernorm(wk(x))`` and ``gate = x @ compress_gate^T``; a
  *group* is ``index_kpool`` consecutive tokens from position 0; a complete group's key is
  ``sum_j softmax_j(gate_j + ape_j) * k_j`` (per channel, over the group's tokens ``j``). An
  incomplete group has no key.
* **Selection.** A query at position ``t`` scores every complete group whose last token is ``<= t``:
  ``sum_h w_h relu(q_h . key * head_dim^-0.5)`` (``w = weights_proj(x) * n_heads^-0.5``), keeps the best
  ``index_topk / index_kpool`` groups (all when fewer) and adds its own incomplete group's tokens
  ``[t + 1 - (t + 1) % kpool, t]`` (the tail). A selection row lists token positions, ascending,
  ``-1`` padded to ``index_topk + index_kpool - 1``.

A layer scores and selects through its :class:`IndexerOps` table (these torch functions by default; the
DSA family's logits and top-k kernels in :mod:`reference_impl.families.glm53.kernels.dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from reference_impl.families.glm53.config import Glm53Config


class RMSNorm(nn.Module):
    """``transformers``' ``Glm5NextTextRMSNorm``: float32 statistics, the weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Indexer(nn.Module):
    """The pooled-key indexer's parameters (``transformers``' names, under ``indexer.``)."""

    def __init__(self, cfg: Glm53Config) -> None:
        super().__init__()
        di = cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * di, bias=False)
        self.wk = nn.Linear(cfg.dim, di, bias=False)
        self.k_norm = nn.LayerNorm(di, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.dim, cfg.index_n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(cfg.index_kpool, di))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(di, cfg.dim))


@dataclass
class DSAProjection:
    """One span's projections of an indexed layer (index fields ``None`` on a layer sharing its selection)."""

    q: torch.Tensor  # [T, heads, qk_nope_head_dim]
    latent: torch.Tensor  # [T, kv_lora_rank]: the cache row
    index_q: torch.Tensor | None  # [T, index_heads, index_head_dim] float32
    index_w: torch.Tensor | None  # [T, index_heads] float32, n_heads^-0.5 applied
    index_k: torch.Tensor | None  # [T, index_head_dim]: the token's raw indexer key
    index_gate: torch.Tensor | None  # [T, index_head_dim]: its pooling logits (before the position bias)


class MLAttention(nn.Module):
    """One indexed layer's parameters (``transformers``' names) and its pieces. ``ops``: the indexer's
    scoring and selection (:class:`IndexerOps`; the torch references, :data:`INDEXER_TORCH_OPS`, by default)."""

    def __init__(self, cfg: Glm53Config, shares_selection: bool, ops: IndexerOps | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops or INDEXER_TORCH_OPS
        h, dn, dv = cfg.n_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        self.q_a_proj = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * dn, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, cfg.kv_lora_rank, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (dn + dv), bias=False)
        self.o_proj = nn.Linear(h * dv, cfg.dim, bias=False)
        self.indexer = None if shares_selection else Indexer(cfg)

    def project(self, x: torch.Tensor) -> DSAProjection:
        cfg, T = self.cfg, len(x)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(T, cfg.n_heads, cfg.qk_nope_head_dim)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        if self.indexer is None:
            return DSAProjection(q, latent, None, None, None, None)
        ix = self.indexer
        index_q = ix.wq_b(q_resid).view(T, cfg.index_n_heads, cfg.index_head_dim).float()
        index_w = ix.weights_proj(x).float() * cfg.index_n_heads**-0.5
        index_k = ix.k_norm(ix.wk(x))
        index_gate = torch.nn.functional.linear(x, ix.index_kpool_compress_gate)
        return DSAProjection(q, latent, index_q, index_w, index_k, index_gate)

    def pool(self, keys: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Complete groups' keys: ``keys, gates [G, kpool, Di]`` -> ``[G, Di]`` (see the module docstring)."""
        assert self.indexer is not None
        logits = gates.float() + self.indexer.index_kpool_compress_ape.float()
        return (logits.softmax(dim=1).to(keys.dtype) * keys).sum(dim=1)

    def attend(self, q: torch.Tensor, latent: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
        """``q [T, heads, Dn]`` against ``latent [S, R]`` (the request's rows from position 0), query ``i``
        seeing the positions of ``selection[i]`` (``-1``: none) -> ``[T, dim]``."""
        cfg, T = self.cfg, len(q)
        kv = self.kv_b_proj(latent.to(q.dtype)).view(len(latent), cfg.n_heads, -1)
        k, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        visible = torch.zeros(T, len(latent) + 1, dtype=torch.bool, device=q.device)
        visible.scatter_(1, torch.where(selection >= 0, selection, len(latent)).long(), True)
        scores = torch.einsum("thd,shd->hts", q, k) * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        scores = scores.masked_fill(~visible[None, :, :-1], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.einsum("hts,shd->thd", probs, v).reshape(T, -1)
        return self.o_proj(out)


def visible_groups(positions: torch.Tensor, kpool: int, n_groups: int) -> torch.Tensor:
    """``[T]`` int64: how many of groups ``0 .. n_groups - 1`` each query at ``positions [T]`` sees (a group
    once its last token is visible): ``min((t + 1) // kpool, n_groups)``, a prefix of the group list."""
    return torch.div(positions.long() + 1, kpool, rounding_mode="floor").clamp(0, n_groups)


def group_scores(
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    group_keys: torch.Tensor,
    head_dim: int,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T, G]`` float32: every query's score of every group key ``group_keys [G, Di]`` (``index_q [T, H, Di]``,
    ``index_w [T, H]``). ``visible [T]`` (optional, :func:`visible_groups`): query ``t`` scores groups
    ``< visible[t]`` only, the others ``-inf``; without it every group is scored."""
    check_indexer_inputs(index_q, index_w, group_keys, visible)
    scores = torch.relu(torch.einsum("thd,gd->thg", index_q, group_keys.float()) * head_dim**-0.5)
    scores = torch.einsum("th,thg->tg", index_w, scores)
    if visible is not None:
        cols = torch.arange(scores.shape[1], device=scores.device)
        scores = scores.masked_fill(cols[None, :] >= visible.to(scores.device)[:, None], float("-inf"))
    return scores


def check_indexer_inputs(
    index_q: torch.Tensor, index_w: torch.Tensor, group_keys: torch.Tensor, visible: torch.Tensor | None = None
) -> None:
    """Refuse, by argument name, what :func:`group_scores` (or a kernel with its contract) cannot take:
    ``index_q [T, H, Di]``, ``index_w [T, H]``, ``group_keys [G, Di]`` floating point, ``visible [T]`` integer,
    one device. Shapes only: nothing is read from the device."""
    named = {"index_q": (index_q, 3), "index_w": (index_w, 2), "group_keys": (group_keys, 2)}
    for name, (t, dims) in named.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: a floating-point tensor is needed, got {kind}")
        if t.dim() != dims:
            raise ValueError(f"{name}: {dims} dims expected, got shape {tuple(t.shape)}")
        if t.device != index_q.device:
            raise ValueError(f"{name} is on {t.device}, index_q on {index_q.device}: one device needed")
    T, H, Di = index_q.shape
    if tuple(index_w.shape) != (T, H):
        raise ValueError(f"index_w: shape {tuple(index_w.shape)}, expected {(T, H)} (index_q {tuple(index_q.shape)})")
    if group_keys.shape[1] != Di:
        raise ValueError(f"group_keys: shape {tuple(group_keys.shape)}, expected [G, {Di}] (index_q's head dim)")
    if visible is not None and (
        visible.dtype.is_floating_point or visible.dtype == torch.bool or tuple(visible.shape) != (T,)
    ):
        raise ValueError(f"visible: an integer [{T}] tensor is needed, got {visible.dtype} {tuple(visible.shape)}")


def select(
    cfg: Glm53Config, scores: torch.Tensor, positions: torch.Tensor, group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Selection rows ``[T, index_topk + kpool - 1]`` (token positions, ascending, ``-1`` padded) from the
    scores ``[T, G]`` of complete groups ``group_ids [G]`` (default ``0..G-1``) and the queries' ``positions [T]``."""
    P, T = cfg.index_kpool, len(positions)
    G = scores.shape[1]
    group_ids = torch.arange(G, device=scores.device) if group_ids is None else group_ids
    # A group is a candidate once its last token is visible to the query.
    candidate = (group_ids[None, :] * P + P - 1) <= positions[:, None]
    masked = scores.float().masked_fill(~candidate, float("-inf"))
    k = min(cfg.groups_selected, G)
    # Ties are common (the ReLU zeroes many scores): the lower group id wins (a stable sort), so a query picks
    # the same groups however many later, invisible groups the scores span (a chunk's, a whole request's).
    order = masked.sort(dim=1, descending=True, stable=True).indices
    chosen = order[:, :k] if k else scores.new_zeros((T, 0), dtype=torch.long)
    chosen_ok = candidate.gather(1, chosen)
    return expand_groups(cfg, torch.where(chosen_ok, group_ids[chosen], -1), positions)


def expand_groups(cfg: Glm53Config, groups: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Selection rows (as :func:`select` returns them) from each query's chosen groups ``groups [T, k]``
    (group ids, ``-1`` unused, any order) and its own incomplete group's tokens up to ``positions [T]``."""
    P, T = cfg.index_kpool, len(positions)
    offsets = torch.arange(P, device=positions.device)
    starts = torch.where(groups >= 0, groups.long() * P, -1)  # [T, k]
    tokens = torch.where(starts[..., None] >= 0, starts[..., None] + offsets, -1).reshape(T, groups.shape[1] * P)
    tail_start = (positions + 1) // P * P
    tail = tail_start[:, None] + offsets[: P - 1]
    tail = torch.where(tail <= positions[:, None], tail, -1)
    rows = torch.cat([tokens, tail], dim=1)
    rows = torch.where(rows >= 0, rows, torch.iinfo(torch.int64).max).sort(dim=1).values
    rows = torch.where(rows == torch.iinfo(torch.int64).max, -1, rows)
    width = cfg.selection_width
    if rows.shape[1] < width:
        rows = torch.cat([rows, rows.new_full((T, width - rows.shape[1]), -1)], dim=1)
    return rows[:, :width].to(torch.int32)


@dataclass(frozen=True)
class IndexerOps:
    """What an indexed layer hands to kernels (the torch references by default, :data:`INDEXER_TORCH_OPS`):

    * ``scores(index_q, index_w, group_keys, head_dim, visible=None)`` -> ``[T, G]`` float32
      (:func:`group_scores`; groups at or past ``visible[t]`` ``-inf``);
    * ``select(cfg, scores, positions, group_ids=None)`` -> selection rows ``[T, selection_width]`` int32
      (:func:`select`: ties to the lower group id).

    The kernel table is :data:`reference_impl.families.glm53.kernels.dispatch.INDEXER_KERNEL_OPS`.
    """

    name: str
    scores: Callable[..., torch.Tensor]
    select: Callable[..., torch.Tensor]


INDEXER_TORCH_OPS = IndexerOps("torch", group_scores, select)

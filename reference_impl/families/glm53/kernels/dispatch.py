"""GLM-5.3's kernel tables, one fallback rule: the KDA cores (:data:`KDA_KERNEL_OPS`) and the pooled
indexer's scoring and selection (:data:`INDEXER_KERNEL_OPS`).

* ``chunked``: :func:`~reference_impl.families.glm53.kernels.kda_triton.kda_chunked_triton` where
  :func:`~reference_impl.kernels.fallback.use_kernels` says so (CUDA, Triton, not forced to torch), the
  torch reference (:func:`~reference_impl.families.glm53.model.kda.kda_chunked`) otherwise or when the
  kernel raises (one warning per process);
* ``span_map``: :func:`~reference_impl.families.glm53.kernels.kda_triton.span_map_triton` by the same
  rule, the torch :func:`~reference_impl.families.glm53.model.kda.span_map` otherwise;
* ``scores`` (:func:`group_scores`): the DSA family's indexer logits kernel
  (:func:`~reference_impl.kernels.indexer_triton.indexer_logits_triton`) by the same rule, the pooled group
  keys as its key rows, each query's visible groups (a prefix of the group list) as its key range, and
  ``head_dim^-0.5`` as every key's scale (``relu(x s) = s relu(x)`` for ``s > 0``). The keys stay float32
  and the products are IEEE float32 (``dot_dtype="fp32"``): FP8 keys, bf16 keys or the GPU's default TF32
  products round each operand by up to ``2^-4``, ``2^-9`` or ``2^-11`` of its size, enough to swap two
  close groups, and the family's check holds every selection equal to the oracle's;
* ``select`` (:func:`select`): the DSA family's top-k selection kernel
  (:func:`~reference_impl.kernels.topk_select.topk_select_triton`) over each query's visible groups, then
  the torch expansion to token positions (:func:`~reference_impl.families.glm53.model.dsa.expand_groups`).
  Its tie rule is the reference's: among scores equal at the k-th, the lowest columns (group ids) are kept,
  ``-0.0`` equal to ``+0.0``, and the selection is a set (the rows come back sorted), so the result is
  the stable sort's, bit for bit. With explicit ``group_ids`` the torch reference runs (the kernel takes a
  row's candidates as one column range; only the default ids make visibility a prefix).

Inputs are checked by name (:func:`~reference_impl.families.glm53.model.kda.check_kda_inputs`,
:func:`~reference_impl.families.glm53.model.dsa.check_indexer_inputs`) before a path is picked, so bad
shapes are refused alike on both paths rather than sent to the fallback."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

import torch

from reference_impl.families.glm53.config import Glm53Config
from reference_impl.families.glm53.model import dsa as dsa_reference
from reference_impl.families.glm53.model import kda as reference
from reference_impl.families.glm53.model.dsa import IndexerOps, check_indexer_inputs, expand_groups, visible_groups
from reference_impl.families.glm53.model.kda import KDAOps, check_kda_inputs
from reference_impl.kernels import fallback

Pair = tuple[torch.Tensor, torch.Tensor]
R = TypeVar("R")


def _kernel(name: str) -> Callable[..., Pair]:
    """``<name>`` of :mod:`.kda_triton`, looked up when called: Triton is imported only where kernels
    run, and a test may stand a function in for it."""
    return getattr(importlib.import_module(f"{__package__}.kda_triton"), name)


def _dispatch(
    what: str, device: torch.device, force_torch: bool, kernel: Callable[[], R], torch_path: Callable[[], R]
) -> R:
    if not fallback.use_kernels(device, force_torch=force_torch):
        return torch_path()
    return fallback.run_with_fallback(what, kernel, torch_path)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    force_torch: bool = False,
) -> Pair:
    """:func:`~reference_impl.families.glm53.model.kda.kda_chunked`, by the Triton kernel where it runs."""
    check_kda_inputs(q, k, v, g, beta, state)
    args = (q, k, v, g, beta, state)
    return _dispatch(
        "Triton GLM-5.3 KDA",
        q.device,
        force_torch,
        lambda: _kernel("kda_chunked_triton")(*args),
        lambda: reference.kda_chunked(*args),
    )


def span_map(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, force_torch: bool = False
) -> Pair:
    """:func:`~reference_impl.families.glm53.model.kda.span_map`, by the Triton kernel where it runs."""
    if k.dim() == 3 and v.dim() == 3:  # else check_kda_inputs names the argument with the wrong rank
        state = k.new_zeros((k.shape[1], k.shape[2], v.shape[2]), dtype=torch.float32)
    else:
        state = k.new_zeros((0, 0, 0), dtype=torch.float32)
    check_kda_inputs(k, k, v, g, beta, state)
    args = (k, v, g, beta)
    return _dispatch(
        "Triton GLM-5.3 KDA span map",
        k.device,
        force_torch,
        lambda: _kernel("span_map_triton")(*args),
        lambda: reference.span_map(*args),
    )


def kda_kernel_name(device: torch.device | str, *, force_torch: bool = False) -> str:
    """What :func:`kda_chunked` and :func:`span_map` run for tensors on ``device``: ``"triton"`` or ``"torch"``."""
    return "triton" if fallback.use_kernels(device, force_torch=force_torch) else "torch"


KDA_KERNEL_OPS = KDAOps("kernels", kda_chunked, span_map)


# ---- the pooled indexer ------------------------------------------------------------------------------


def _dsa_kernel(module: str, name: str) -> Callable[..., torch.Tensor]:
    """``<name>`` of the DSA family's ``reference_impl.kernels.<module>``, looked up when called (Triton is
    imported only where kernels run, and a test may stand a function in for it)."""
    return getattr(importlib.import_module(f"reference_impl.kernels.{module}"), name)


def _scores_kernel(
    index_q: torch.Tensor, index_w: torch.Tensor, group_keys: torch.Tensor, head_dim: int, visible: torch.Tensor
) -> torch.Tensor:
    """The logits kernel over the group keys: float32 operands, IEEE float32 products (module docstring)."""
    T, G = len(index_q), len(group_keys)
    scale = torch.full((G,), head_dim**-0.5, dtype=torch.float32, device=index_q.device)
    first = torch.zeros(T, dtype=torch.int64, device=index_q.device)
    logits = _dsa_kernel("indexer_triton", "indexer_logits_triton")
    return logits(index_q.float(), index_w.float(), group_keys.float(), scale, first, visible, 0, G, dot_dtype="fp32")


def group_scores(
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    group_keys: torch.Tensor,
    head_dim: int,
    visible: torch.Tensor | None = None,
    *,
    force_torch: bool = False,
) -> torch.Tensor:
    """:func:`~reference_impl.families.glm53.model.dsa.group_scores`, by the DSA logits kernel where it runs
    (``[T, G]`` float32; groups at or past ``visible[t]`` ``-inf``, every group scored without ``visible``)."""
    check_indexer_inputs(index_q, index_w, group_keys, visible)
    T, G = len(index_q), len(group_keys)
    bound = visible.to(device=index_q.device, dtype=torch.int64) if visible is not None else None
    in_range = bound if bound is not None else torch.full((T,), G, dtype=torch.int64, device=index_q.device)
    return _dispatch(
        "Triton GLM-5.3 indexer scores",
        index_q.device,
        force_torch,
        lambda: _scores_kernel(index_q, index_w, group_keys, head_dim, in_range),
        lambda: dsa_reference.group_scores(index_q, index_w, group_keys, head_dim, bound),
    )


def _select_kernel(cfg: Glm53Config, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The top-k kernel over each query's visible groups ``[0, visible)``, then the expansion to tokens."""
    T, G = scores.shape
    k = min(cfg.groups_selected, G)
    if k == 0 or T == 0:
        groups = torch.full((T, 0), -1, dtype=torch.int32, device=scores.device)
    else:
        visible = visible_groups(positions, cfg.index_kpool, G)
        first = torch.zeros(T, dtype=torch.int64, device=scores.device)
        groups = _dsa_kernel("topk_select", "topk_select_triton")(scores.float().contiguous(), first, visible, k)
    return expand_groups(cfg, groups, positions)


def select(
    cfg: Glm53Config,
    scores: torch.Tensor,
    positions: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    force_torch: bool = False,
) -> torch.Tensor:
    """:func:`~reference_impl.families.glm53.model.dsa.select`, by the DSA top-k kernel where it runs and the
    group ids are the default ``0 .. G - 1`` (the module docstring says why the results are the same)."""
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores: a floating-point [T, G] tensor is needed, got {scores.dtype} {tuple(scores.shape)}")
    if positions.dim() != 1 or positions.is_floating_point() or len(positions) != len(scores):
        raise ValueError(
            f"positions: an integer [{len(scores)}] tensor is needed (scores {tuple(scores.shape)}), "
            f"got {positions.dtype} {tuple(positions.shape)}"
        )
    return _dispatch(
        "Triton GLM-5.3 group selection",
        scores.device,
        force_torch or group_ids is not None,
        lambda: _select_kernel(cfg, scores, positions),
        lambda: dsa_reference.select(cfg, scores, positions, group_ids),
    )


def indexer_kernel_name(device: torch.device | str, *, force_torch: bool = False) -> str:
    """What :func:`group_scores` and :func:`select` run for tensors on ``device``: ``"triton"`` or ``"torch"``."""
    return "triton" if fallback.use_kernels(device, force_torch=force_torch) else "torch"


INDEXER_KERNEL_OPS = IndexerOps("kernels", group_scores, select)

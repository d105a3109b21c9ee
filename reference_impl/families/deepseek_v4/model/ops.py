"""What a V4 layer hands to kernels: :class:`V4Ops`, and the torch references (:data:`V4_TORCH_OPS`).

The layer (:mod:`reference_impl.families.deepseek_v4.model.attention`) and the single-device cache
(:mod:`reference_impl.families.deepseek_v4.model.cache`) call their compute cores through these; the kernel dispatch
(:data:`reference_impl.families.deepseek_v4.kernels.dispatch.V4_KERNEL_OPS`) plugs kernels in with the same contracts.

What the oracle shares: on CUDA the oracle's model is built with the same table as the ranks', so
a CP run's agreement with it proves the split, not the kernels; each kernel is checked against its
torch reference on its own (``tests/test_v4_kernels.py``, ``tests/gpu/test_gpu_v4.py``). One
exception by design: the single-device cache hands the selection float32 keys (as
:func:`~reference_impl.families.deepseek_v4.cache_layout.decode_index` returns them), which the kernel does not take,
so the oracle's CSA top-k is always the torch reference's and the check compares the ranks' kernel
selection with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from reference_impl.families.deepseek_v4.cache_layout import fp4_simulate
from reference_impl.families.deepseek_v4.model.compressor import pool
from reference_impl.families.deepseek_v4.model.rope_tail import rope_tail
from reference_impl.families.deepseek_v4.model.sparse import select_entries, sparse_attention_sinks


@dataclass(frozen=True)
class V4Ops:
    """What a V4 layer hands to kernels (the torch references by default, :data:`V4_TORCH_OPS`):

    * ``select_entries(q, weights, keys, key_start, n_visible, topk, *, host_bounds=None)`` -> ``[T, topk]``
      int32 (:func:`~reference_impl.families.deepseek_v4.model.sparse.select_entries`; the rows of the set in
      any order);
    * ``sparse_attention(q, view, indices, sinks, softmax_scale, dense_start=None, dense_len=None, dense_width=None)``
      -> ``[T, H, D]`` float32 (:func:`~reference_impl.families.deepseek_v4.model.sparse.sparse_attention_sinks`);
    * ``pool(kv_rows, score_rows, slot_rows, ratio)`` -> ``[E, D]`` float32: the compressors' gated
      softmax pooling (:func:`~reference_impl.families.deepseek_v4.model.compressor.pool`);
    * ``rope_tail(x, cos, sin, rope_dim, rms_eps=None, out_dtype=None)``: the per-head norm and
      RoPE on the last dims (:func:`~reference_impl.families.deepseek_v4.model.rope_tail.rope_tail`);
    * ``fp4_simulate(x)``: the FP4 round trip of the indexer query
      (:func:`~reference_impl.families.deepseek_v4.cache_layout.fp4_simulate`; a kernel must be bit-exact).
    """

    name: str
    select_entries: Callable[..., torch.Tensor]
    sparse_attention: Callable[..., torch.Tensor]
    pool: Callable[..., torch.Tensor]
    rope_tail: Callable[..., torch.Tensor]
    fp4_simulate: Callable[..., torch.Tensor]


V4_TORCH_OPS = V4Ops("torch", select_entries, sparse_attention_sinks, pool, rope_tail, fp4_simulate)

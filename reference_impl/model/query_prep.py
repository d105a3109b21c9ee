"""Torch references for the per-token query preparation of a DSA layer: the glue between the projections.

Two steps of :meth:`~reference_impl.model.attention.DSAAttention.project` touch every head of every
local token and do little arithmetic per byte. Written as torch ops, each one is a chain of
elementwise kernels with a float32 copy of the tensor between them; on the GPU the kernels of
:mod:`reference_impl.kernels.query_prep_triton` do each in one pass. These functions are the
contract those kernels match.

* :func:`indexer_query`: the lightning indexer's query, ``[T, Hi, D]`` straight out of ``wq_b``:
  RoPE on its first ``rope_dim`` values, the Hadamard rotation, FP8 quantization with one scale
  per head (``act_quant``), and the per-head weights the scores use,
  ``head_weights * Hi^-0.5 * q_scale * D^-0.5`` (DeepSeek-V3.2's ``Indexer.forward``).
* :func:`rope_into`: RoPE of the MLA query's rope part, written into its columns of the absorbed
  query (``q_full[..., kv_lora:]``), so no rotated copy is concatenated afterwards.

Every intermediate is rounded where DeepSeek's code rounds it: RoPE and the rotation return the
compute dtype, quantization reads that.
"""

from __future__ import annotations

import torch

from reference_impl.fp8 import act_quant, hadamard_rotate
from reference_impl.model.rope import apply_rope


def indexer_query(
    q: torch.Tensor,  # [T, Hi, D] compute dtype: indexer.wq_b(qr), per head [rope, nope]
    cos: torch.Tensor,  # [T, rope_dim / 2] float32
    sin: torch.Tensor,  # [T, rope_dim / 2] float32
    hadamard: torch.Tensor,  # [D, D] float32 Sylvester matrix (+-1)
    head_weights: torch.Tensor,  # [T, Hi] float32: indexer.weights_proj(x)
    rope_dim: int,
    interleaved: bool,
    scale_fmt: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer query, ready for the scores -> ``(q_fp8 [T, Hi, D] float8_e4m3fn, weights [T, Hi] float32)``.

    ``weights = head_weights * Hi^-0.5 * q_scale * D^-0.5``, multiplied in that order, where
    ``q_scale`` is the FP8 scale of the head's first 128 values (the whole head at ``D = 128``).
    """
    n_heads, d = q.shape[1], q.shape[2]
    q_pe, q_nope = q.split([rope_dim, d - rope_dim], dim=-1)  # the indexer's heads are [rope, nope]
    q = torch.cat([apply_rope(q_pe, cos, sin, interleaved), q_nope], dim=-1)
    q_fp8, q_scale = act_quant(hadamard_rotate(q, hadamard), 128, scale_fmt)  # scale [T, Hi, D / 128]
    weights = head_weights * n_heads**-0.5
    return q_fp8, weights * q_scale[..., 0] * d**-0.5


def rope_into(
    out: torch.Tensor,  # [T, H, R] view (e.g. q_full[..., kv_lora:]), written
    x: torch.Tensor,  # [T, H, R] the rope part of the query (a view of wq_b's output)
    cos: torch.Tensor,  # [T, R / 2] float32
    sin: torch.Tensor,  # [T, R / 2] float32
    interleaved: bool,
) -> None:
    """``out[...] = apply_rope(x, cos, sin, interleaved)``, rounded to ``out``'s dtype."""
    out.copy_(apply_rope(x, cos, sin, interleaved))

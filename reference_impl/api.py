"""The public API: what a port that uses this project as its baseline calls.

Everything here is also exported from the package (``import reference_impl as ri``). The
``use it as a baseline`` page (``docs/baseline.md``) shows each call; its examples run in the
test command.

* models: :func:`make_model` (a preset or a :class:`~reference_impl.presets.ModelConfig`, seeded or
  Hugging Face weights), :func:`make_inputs`;
* the single-device oracle: :func:`oracle` (outputs, per-layer top-k, caches in the byte layouts);
* one DSA layer: ``model.layers[i].attn(x, start_pos, cache)``
  (:meth:`~reference_impl.model.attention.DSAAttention.forward`);
* the split: :func:`~reference_impl.cp.split.build_split` (in-seq, round-robin, page-aligned);
* a CP prefill: :func:`~reference_impl.runner.run_prefill` (the report; the tensors on request);
* the planner: :func:`~reference_impl.planner.plan_capacity`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from reference_impl.config import ConfigError, Request
from reference_impl.kernels.dispatch import KERNEL_OPS
from reference_impl.kernels.v4_dispatch import V4_KERNEL_OPS
from reference_impl.model.checkpoint import load_hf_weights
from reference_impl.model.oracle import DSAModel, OracleResult, init_weights, run_oracle
from reference_impl.model.sparse_attention import TORCH_OPS
from reference_impl.model.v4.checkpoint import load_v4_hf_weights
from reference_impl.model.v4.oracle import build_v4_model, run_v4_oracle
from reference_impl.model.v4.sparse import V4_TORCH_OPS
from reference_impl.presets import ModelConfig, get_preset
from reference_impl.presets_v4 import is_v4


def make_model(
    preset: str | ModelConfig = "deepseek-v3.2",
    *,
    n_layers: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    checkpoint: str | Path | Mapping[str, torch.Tensor] | None = None,
    first_layer: int = 0,
    head: bool = False,
    kernels: bool = True,
) -> DSAModel:
    """A :class:`~reference_impl.model.oracle.DSAModel` of ``n_layers`` DSA layers (default: the
    preset's count) on ``device`` in ``dtype``.

    Weights: seeded random (``seed``, the bytes every rank of a CP run builds) or, with
    ``checkpoint``, the attention weights of checkpoint layers ``first_layer ..`` by their Hugging
    Face names (:func:`~reference_impl.model.checkpoint.load_hf_weights`; with ``head=True`` the
    final norm and the LM head too). ``kernels=False`` keeps the torch references for the indexer
    top-k and the sparse attention (the kernels run only on CUDA anyway).
    """
    cfg = get_preset(preset) if isinstance(preset, str) else preset
    if n_layers is not None:
        if n_layers < 1:
            raise ConfigError(f"n_layers={n_layers}: need at least one layer")
        cfg = cfg.with_layers(n_layers)
    if is_v4(cfg):  # DeepSeek-V4: a V4Model (reference_impl.model.v4), its weights by Hugging Face names
        v4 = build_v4_model(cfg, dtype, seed, device, V4_KERNEL_OPS if kernels else V4_TORCH_OPS)  # type: ignore[arg-type]
        if checkpoint is not None:
            load_v4_hf_weights(v4, checkpoint, first_layer=first_layer, head=head)
        return v4  # type: ignore[return-value]
    with torch.device(device):
        model = DSAModel(cfg, dtype, ops=KERNEL_OPS if kernels else TORCH_OPS)
    init_weights(model, seed)
    if checkpoint is not None:
        load_hf_weights(model, checkpoint, first_layer=first_layer, head=head)
    return model.eval()


def make_inputs(
    cfg: ModelConfig, requests: Sequence[Request], *, seed: int = 0, device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """Layer-0 hidden states per request, ``[prefix + extend, dim]`` ~ N(0, 1): the inputs a
    ``RunConfig`` with this ``seed`` builds (``seed + 1`` seeds the generator)."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    return [torch.randn(r.total, cfg.dim, generator=gen, device=device).to(dtype) for r in requests]


def oracle(
    model: DSAModel,
    requests: Sequence[Request],
    inputs: Sequence[torch.Tensor],
    *,
    kv_dtype: str = "fp8",
    page_size: int = 64,
    chunk_size: int | None = None,
    fp32: bool = False,
) -> OracleResult:
    """The single-device oracle for a batch: per request the extend tokens' final hidden states,
    per layer and request the top-k key positions, and the dense caches in the KV byte layouts.

    ``inputs[i]`` is request ``i``'s ``[prefix + extend, dim]`` layer-0 input (its prefix is
    computed first, as an earlier prefill would have). ``fp32=True`` reads the KV in float32 for
    attention (with a float32 model: float32 end to end; the engine's full view is bf16).
    """
    if len(inputs) != len(requests):
        raise ConfigError(f"{len(inputs)} inputs for {len(requests)} requests")
    for i, (x, r) in enumerate(zip(inputs, requests)):
        if tuple(x.shape) != (r.total, model.cfg.dim):
            raise ConfigError(f"inputs[{i}] is {tuple(x.shape)}, request {i} needs ({r.total}, {model.cfg.dim})")
    view = torch.float32 if fp32 else torch.bfloat16
    if is_v4(model.cfg):  # DeepSeek-V4's oracle: caches in reference_impl.kvcache.v4_layout (no pages)
        return run_v4_oracle(model, [r.prefix for r in requests], list(inputs), kv_dtype, chunk_size, view)  # type: ignore[arg-type,return-value]
    return run_oracle(model, [r.prefix for r in requests], list(inputs), kv_dtype, page_size, chunk_size, view)  # type: ignore[arg-type]

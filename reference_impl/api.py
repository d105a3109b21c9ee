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
from typing import Any

import torch

from reference_impl.config import (
    KV_DTYPES,
    MAX_LAYERS,
    MAX_SEED,
    ConfigError,
    Request,
    check_choice,
    validate_page_size,
)
from reference_impl.families import family_of, get_preset, is_model_config, preset_names
from reference_impl.footprint import GIB, SAFETY, free_bytes, weight_bytes
from reference_impl.model.cache import check_device
from reference_impl.model.checkpoint import check_checkpoint

ModelConfigLike = Any
"""A model family's config: the DSA family's :class:`~reference_impl.presets.ModelConfig`, DeepSeek-V4's
:class:`~reference_impl.families.deepseek_v4.config.V4ModelConfig`, or a registered family's."""


def make_model(
    preset: str | ModelConfigLike = "deepseek-v3.2",
    *,
    n_layers: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    checkpoint: str | Path | Mapping[str, torch.Tensor] | None = None,
    first_layer: int = 0,
    head: bool = False,
    kernels: bool = True,
) -> torch.nn.Module:
    """The preset's model, built by its family: a :class:`~reference_impl.model.oracle.DSAModel` of
    ``n_layers`` DSA layers (default: the preset's count) for the DSA family, a
    :class:`~reference_impl.families.deepseek_v4.model.oracle.V4Model` for DeepSeek-V4; on ``device`` in ``dtype``.

    Weights: seeded random (``seed``, the bytes every rank of a CP run builds) or, with
    ``checkpoint``, the attention weights of checkpoint layers ``first_layer ..`` by their Hugging
    Face names (:func:`~reference_impl.model.checkpoint.load_hf_weights`; with ``head=True`` the
    final norm and the LM head too). ``kernels=False`` keeps the torch references for the indexer
    top-k and the sparse attention, and on V4 presets for the compressors' pooling, the per-head
    norm and RoPE and the FP4 round trip too (the kernels run only on CUDA anyway).
    """
    cfg = _model_config(preset)
    if n_layers is not None:
        _check_int("n_layers", n_layers, 1, MAX_LAYERS)  # a config is built per layer: refused before it
        cfg = cfg.with_layers(n_layers)
    device = _check_device(device)
    dtype = _check_dtype(dtype)
    _check_int("seed", seed, 0, MAX_SEED)
    _check_int("first_layer", first_layer, 0)
    for name, flag in (("head", head), ("kernels", kernels)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name}={flag!r}: need a bool, got {type(flag).__name__}")
    if checkpoint is not None and not isinstance(checkpoint, (str, Path, Mapping)):
        raise ConfigError(
            f"checkpoint={checkpoint!r}: need a path or a mapping of tensors, got {type(checkpoint).__name__}"
        )
    if checkpoint is not None:
        check_checkpoint(checkpoint)  # a missing or foreign file, before the model is built
    params, draw = weight_bytes(cfg, dtype.itemsize)
    _check_fits(
        f"make_model({cfg.name!r}, n_layers={cfg.n_layers}, dtype={dtype})", int(SAFETY * (params + draw)), device
    )
    family = family_of(cfg)  # the DSA family's DSAModel, DeepSeek-V4's V4Model, ...
    model = family.build_model(cfg, dtype, seed, device, kernels)
    if checkpoint is not None:
        family.load_weights(model, checkpoint, first_layer, head)
    return model.eval()  # type: ignore[return-value]


def make_inputs(
    cfg: ModelConfigLike,
    requests: Sequence[Request],
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """Layer-0 hidden states per request, ``[prefix + extend, dim]`` ~ N(0, 1): the inputs a
    ``RunConfig`` with this ``seed`` builds (``seed + 1`` seeds the generator)."""
    if not is_model_config(cfg):
        raise ConfigError(
            f"cfg={cfg!r}: need a ModelConfig (e.g. get_preset('tiny') or model.cfg), got {type(cfg).__name__}"
        )
    requests = _check_requests(requests)
    _check_int("seed", seed, 0, MAX_SEED)
    device = _check_device(device)
    dtype = _check_dtype(dtype)
    tokens = sum(r.total for r in requests)
    _check_fits(
        f"make_inputs of {tokens:,} tokens",
        int(SAFETY * (tokens * cfg.dim * dtype.itemsize + max(r.total for r in requests) * cfg.dim * 4)),
        device,
    )
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    return [torch.randn(r.total, cfg.dim, generator=gen, device=device).to(dtype) for r in requests]


def oracle(
    model: torch.nn.Module,
    requests: Sequence[Request],
    inputs: Sequence[torch.Tensor],
    *,
    kv_dtype: str = "fp8",
    page_size: int = 64,
    chunk_size: int | None = None,
    fp32: bool = False,
) -> Any:
    """The single-device oracle for a batch: per request the extend tokens' final hidden states,
    per layer and request the top-k key positions, and the dense caches in the KV byte layouts.

    ``inputs[i]`` is request ``i``'s ``[prefix + extend, dim]`` layer-0 input (its prefix is
    computed first, as an earlier prefill would have). ``fp32=True`` reads the KV in float32 for
    attention (with a float32 model: float32 end to end; the engine's full view is bf16).
    """
    if not (isinstance(model, torch.nn.Module) and is_model_config(getattr(model, "cfg", None))):
        raise ConfigError(f"model={model!r}: need a model from make_model, got {type(model).__name__}")
    requests = _check_requests(requests)
    if (
        isinstance(inputs, torch.Tensor)
        or not isinstance(inputs, Sequence)
        or not all(isinstance(x, torch.Tensor) for x in inputs)
    ):
        raise ConfigError("inputs: need a list of tensors, one [prefix + extend, dim] per request (make_inputs)")
    check_choice("kv_dtype", kv_dtype, KV_DTYPES)
    _check_int("page_size", page_size, 1)
    validate_page_size(page_size)
    if chunk_size is not None:
        _check_int("chunk_size", chunk_size, 1)
    if len(inputs) != len(requests):
        raise ConfigError(f"{len(inputs)} inputs for {len(requests)} requests")
    for i, (x, r) in enumerate(zip(inputs, requests)):
        if tuple(x.shape) != (r.total, model.cfg.dim):
            raise ConfigError(f"inputs[{i}] is {tuple(x.shape)}, request {i} needs ({r.total}, {model.cfg.dim})")
    view = torch.float32 if fp32 else torch.bfloat16
    return family_of(model.cfg).oracle(
        model, [r.prefix for r in requests], list(inputs), kv_dtype, page_size, chunk_size, view
    )


# ---- argument checks: a wrong type or size is a ConfigError naming the argument ----------------


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: need an int, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"{minimum} <= {name} <= {maximum}" if maximum is not None else f"{name} >= {minimum}"
        raise ConfigError(f"{name}={value}: need {bound}")
    return value


def _model_config(preset: object) -> ModelConfigLike:
    if is_model_config(preset):
        return preset  # type: ignore[return-value]
    if isinstance(preset, str):
        return get_preset(preset)
    raise ConfigError(
        f"preset={preset!r}: need a preset name ({', '.join(preset_names())}) or a ModelConfig, "
        f"got {type(preset).__name__}"
    )


_check_device = check_device  # cpu, cuda (where visible) or meta, else a ConfigError naming ``device``


def _check_dtype(dtype: object) -> torch.dtype:
    floating = (torch.float32, torch.bfloat16, torch.float16)
    if not isinstance(dtype, torch.dtype) or dtype not in floating:
        hint = f" (torch.{dtype} rather than the string)" if isinstance(dtype, str) else ""
        raise ConfigError(f"dtype={dtype!r}: need torch.float32, torch.bfloat16 or torch.float16{hint}")
    return dtype


def _check_requests(requests: object) -> list[Request]:
    if isinstance(requests, str):
        raise ConfigError(
            f"requests={requests!r}: need a list of Request (from a spec string: parse_requests({requests!r}))"
        )
    if not isinstance(requests, Sequence) or not requests or not all(isinstance(r, Request) for r in requests):
        raise ConfigError(f"requests={requests!r}: need a non-empty list of Request")
    return list(requests)


def _check_fits(what: str, need: int, device: torch.device) -> None:
    """Refuse ``what`` before allocating when its ``need`` bytes exceed the device's free memory."""
    if device.type == "meta":
        return
    free = free_bytes(device.type)
    if free is not None and need > free:
        raise ConfigError(
            f"{what} needs about {need / GIB:,.1f} GiB on {device.type}, which has {free / GIB:,.1f} GiB "
            "free: use fewer layers, tokens or a smaller dtype"
        )

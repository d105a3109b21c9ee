"""Launch configurations of the phase-7 fused kernels: one fixed config per kernel and device kind.

No autotuning at run time. A config is the keyword arguments that the kernel's public function
accepts, so a benchmark can pass any candidate unchanged
(``store_mla_triton(..., **config)``):

* the stores, the materialize and the current-rows fill: ``block_m`` (rows per program), ``num_warps`` and, for the FP8
  MLA store and the FP8 materialize, ``one_pass`` (``True``: every load of a program is issued
  before its first store, all ``L / 128`` quantization blocks of a row as one ``[BLOCK_M, L/128,
  128]`` tile and the row's scales as one vector; ``False``: one 128-value block at a time, load
  then store), and for the FP8 MLA store and the index store ``fast_div`` (the division by the
  block scale as reciprocal + one FMA correction, same quotients, for bf16 input on the GPU only;
  the current-rows fill too:
  :func:`reference_impl.kernels.fused_store._negated_quotient`);
* the rerange: ``block_t`` (rows per program), ``block_c`` (32-bit words per column step, capped at
  the row's word count), ``num_warps`` and ``one_pass`` (``True``: the row as a power-of-two head
  and a tail, 288 words = 256 + 32, both loaded before either is stored; ``block_c`` unused).

The rerange is one kernel for every row width; it takes ``rerange_index``'s config for rows of at
most :data:`RERANGE_NARROW_ROW_BYTES` bytes (indexer K: 256 B) and ``rerange_kv``'s otherwise (the
MLA latent: 1152 B).

The GPU defaults (:data:`GPU_CONFIGS`) were chosen on an H200 from ``python -m
reference_impl.bench.kernels --sweep``, which checks and times candidate configs per kernel and
records the fastest byte-exact one under ``"sweep"`` (``best``), the values to put here (measured:
``docs/benchmarks.md#fused-kernels-and-the-remap-phases-6-and-7``). The CPU defaults are what the
interpreter runs: one config per kernel, small tiles, one warp.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from reference_impl.config import ConfigError

LaunchConfig = dict[str, int | bool]

GPU_CONFIGS: dict[str, LaunchConfig] = {
    "store_mla_fp8": {"block_m": 8, "num_warps": 2, "one_pass": True, "fast_div": True},
    "store_mla_bf16": {"block_m": 64, "num_warps": 8},
    "store_index": {"block_m": 8, "num_warps": 1, "fast_div": True},
    "rerange_kv": {"block_t": 8, "block_c": 0, "num_warps": 2, "one_pass": True},
    "rerange_index": {"block_t": 16, "block_c": 64, "num_warps": 2, "one_pass": False},
    "materialize_fp8": {"block_m": 8, "num_warps": 4, "one_pass": True},
    "materialize_bf16": {"block_m": 32, "num_warps": 4},
    "fill_current": {"block_m": 8, "num_warps": 2, "fast_div": True},
}
_CPU_STORE: LaunchConfig = {"block_m": 16, "num_warps": 1}
_CPU_RERANGE: LaunchConfig = {"block_t": 16, "block_c": 64, "num_warps": 1, "one_pass": False}
CPU_CONFIGS: dict[str, LaunchConfig] = {
    "store_mla_fp8": {**_CPU_STORE, "one_pass": False, "fast_div": False},
    "store_mla_bf16": dict(_CPU_STORE),
    "store_index": {**_CPU_STORE, "fast_div": False},
    "rerange_kv": dict(_CPU_RERANGE),
    "rerange_index": dict(_CPU_RERANGE),
    "materialize_fp8": {**_CPU_STORE, "one_pass": False},
    "materialize_bf16": dict(_CPU_STORE),
    "fill_current": {**_CPU_STORE, "fast_div": False},
}
KERNELS: tuple[str, ...] = tuple(GPU_CONFIGS)

RERANGE_NARROW_ROW_BYTES = 512


def default_config(kernel: str, device: torch.device) -> LaunchConfig:
    """``kernel``'s default config on ``device``'s kind (CUDA: :data:`GPU_CONFIGS`, else
    :data:`CPU_CONFIGS`), a copy."""
    table = GPU_CONFIGS if device.type == "cuda" else CPU_CONFIGS
    if kernel not in table:
        raise ConfigError(f"no launch config for {kernel!r}; known: {', '.join(KERNELS)}")
    return dict(table[kernel])


def launch_config(kernel: str, device: torch.device, overrides: Mapping[str, int | bool | None]) -> LaunchConfig:
    """The default config of ``kernel`` on ``device`` with every override that is not ``None`` applied.

    A set override must name a key of the default (a typo would otherwise be silently ignored).
    """
    config = default_config(kernel, device)
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in config:
            raise ConfigError(f"{kernel}: unknown launch parameter {key!r} (takes {', '.join(config)})")
        config[key] = value
    return config


def rerange_kernel_name(row_bytes: int) -> str:
    """The config a rerange of ``row_bytes``-byte rows takes: ``rerange_index`` (narrow) or ``rerange_kv``."""
    return "rerange_index" if row_bytes <= RERANGE_NARROW_ROW_BYTES else "rerange_kv"

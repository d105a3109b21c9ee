"""Load DeepSeek-V3.2 / GLM-5 attention weights by their Hugging Face checkpoint names.

The model's parameters carry DeepSeek's inference-code names (``wq_a``, ``wkv_a``, ...); the Hugging
Face checkpoints of both models use the transformers names below, under ``model.layers.{i}.``.
:func:`load_hf_weights` maps one onto the other, reads only the tensors it needs (one
``.safetensors`` file, a sharded checkpoint directory with ``model.safetensors.index.json``, or a
name -> tensor mapping), dequantizes FP8 weights and copies them into the model. The MoE / MLP half
of a block is not part of this model and is ignored.

FP8 weights. The shipped FP8 checkpoints store an e4m3 weight ``<name>.weight`` with its inverse
block scales ``<name>.weight_scale_inv`` (one float32 per 128 x 128 block): DeepSeek-V3.2
(``inference/convert.py`` and ``model.py``'s ``Linear.scale``), GLM-5-FP8 and GLM-5.2-FP8
(``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}``,
the format transformers' fine-grained FP8 loader reads as ``weight_scale_inv``). An FP8 tensor
without that companion is refused by name, never taken unscaled; so is a scale beside a tensor that
is not FP8.

IndexShare: a shared layer has no indexer (:mod:`reference_impl.index_share`), so neither the model
nor the checkpoint holds its ``indexer.*`` tensors; only the parameters the model has are read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from reference_impl.errors import ConfigError

# Ours, under ``layers.{i}.`` -> Hugging Face's, under ``model.layers.{i}.``.
HF_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.indexer.wq_b.weight": "self_attn.indexer.wq_b.weight",
    "attn.indexer.wk.weight": "self_attn.indexer.wk.weight",
    "attn.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "attn.indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "attn.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
}
# The final norm and the LM head, loaded with ``head=True``.
HF_HEAD_NAMES: dict[str, str] = {"norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"}
FP8_BLOCK = 128  # DeepSeek's FP8 weights: one float32 inverse scale per 128 x 128 block
SCALE_SUFFIX = "_scale_inv"  # ``<name>.weight`` -> ``<name>.weight_scale_inv``
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def hf_names(n_layers: int, first_layer: int = 0, head: bool = False) -> dict[str, str]:
    """Our parameter name -> the Hugging Face checkpoint name, for ``n_layers`` layers starting at
    checkpoint layer ``first_layer`` (e.g. a DSA layer deep in the model)."""
    names = {
        f"layers.{i}.{ours}": f"model.layers.{first_layer + i}.{theirs}"
        for i in range(n_layers)
        for ours, theirs in HF_LAYER_NAMES.items()
    }
    if head:
        names.update(HF_HEAD_NAMES)
    return names


def dequantize_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """An FP8 weight ``[R, C]`` and its block scales ``[ceil(R/128), ceil(C/128)]`` -> float32 ``[R, C]``."""
    rows, cols = weight.shape
    blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(scale_inv.shape) != blocks:
        raise ConfigError(f"FP8 weight {tuple(weight.shape)} needs block scales {blocks}, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]
    return weight.float() * scale


def _reader(source: str | Path | Mapping[str, torch.Tensor]) -> tuple[Callable[[str], torch.Tensor | None], str]:
    """``(get(name) -> tensor or None, description)`` over a mapping, a file or a sharded directory.

    Every file is checked here, before a tensor is read: it exists and is a safetensors file (its header
    parses), and a directory's ``model.safetensors.index.json`` is a JSON weight map of existing shards.
    """
    if isinstance(source, Mapping):
        return source.get, "the given tensors"
    path = Path(source)
    from safetensors import safe_open

    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if not index.exists():
            files = sorted(path.glob("*.safetensors"))
            if len(files) != 1:
                raise ConfigError(f"{path}: no model.safetensors.index.json and {len(files)} .safetensors files")
            path = files[0]
        else:
            weight_map = _weight_map(index)
            for shard in sorted(set(weight_map.values())):
                _check_safetensors(path / shard)

            def get_sharded(name: str) -> torch.Tensor | None:
                shard = weight_map.get(name)
                if shard is None:
                    return None
                with safe_open(str(path / shard), framework="pt") as f:
                    return f.get_tensor(name)

            return get_sharded, str(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist")
    _check_safetensors(path)

    def get_file(name: str) -> torch.Tensor | None:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name) if name in f.keys() else None

    return get_file, str(path)


def check_checkpoint(source: str | Path | Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`ConfigError` unless ``source`` can be read as a checkpoint (see :func:`_reader`);
    cheap (file headers only), so a caller checks it before building a model."""
    _reader(source)


def _check_safetensors(path: Path) -> None:
    """A :class:`ConfigError` naming ``path`` unless it is a readable safetensors file (its header is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {path} does not exist") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint {path}: not a safetensors file ({exc})") from None


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file) of a sharded checkpoint's index, or a ConfigError naming it."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"checkpoint index {index}: not a JSON object ({exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"checkpoint index {index}: no weight_map of tensor name -> shard file")
    return weight_map


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module,
    source: str | Path | Mapping[str, torch.Tensor],
    *,
    first_layer: int = 0,
    head: bool = False,
    names: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Copy the attention weights of checkpoint layers ``first_layer ..`` into ``model`` (a
    :class:`~reference_impl.model.oracle.DSAModel`; ``head=True`` also loads ``model.norm`` and
    ``lm_head``). Returns our name -> the checkpoint name each parameter was loaded from.
    ``names`` replaces the DSA name map (another model's: :mod:`reference_impl.families.deepseek_v4.model.checkpoint`).

    Raises :class:`~reference_impl.errors.ConfigError` naming the first missing tensor, the first
    FP8 tensor without its ``weight_scale_inv`` (or scale without an FP8 tensor), or the first shape
    that does not fit, before any parameter is changed.
    """
    get, where = _reader(source)
    params = dict(model.named_parameters())
    n_layers = len(model.layers)
    # IndexShare's shared layers have no indexer parameters (and their checkpoints no such tensors).
    names = (
        dict(names)
        if names is not None
        else {ours: theirs for ours, theirs in hf_names(n_layers, first_layer, head).items() if ours in params}
    )
    loaded: dict[str, torch.Tensor] = {}
    for ours, theirs in names.items():
        tensor = get(theirs)
        if tensor is None:
            raise ConfigError(f"{where} has no tensor {theirs!r} (for {ours})")
        scale = get(theirs + SCALE_SUFFIX) if theirs.endswith(".weight") else None  # e.g. q_a_proj.weight_scale_inv
        if tensor.dtype in FP8_DTYPES and scale is None:
            raise ConfigError(
                f"{where}: {theirs} is {str(tensor.dtype).removeprefix('torch.')} but has no scale "
                f"{theirs + SCALE_SUFFIX!r}: an FP8 weight is not loaded unscaled"
            )
        if scale is not None and tensor.dtype not in FP8_DTYPES:
            raise ConfigError(
                f"{where}: {theirs} is {str(tensor.dtype).removeprefix('torch.')}, not FP8, yet has a scale "
                f"{theirs + SCALE_SUFFIX!r}: which one is meant?"
            )
        if scale is not None:
            tensor = dequantize_fp8_weight(tensor, scale)
        if tuple(tensor.shape) != tuple(params[ours].shape):
            raise ConfigError(
                f"{theirs} has shape {tuple(tensor.shape)} but {ours} needs {tuple(params[ours].shape)}: "
                "is the preset the checkpoint's model?"
            )
        loaded[ours] = tensor
    for ours, tensor in loaded.items():
        params[ours].copy_(tensor.to(params[ours].dtype))
    return names

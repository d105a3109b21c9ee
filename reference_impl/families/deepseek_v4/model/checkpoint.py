"""Load DeepSeek-V4 attention weights by their Hugging Face names.

The V4 layer's parameters carry DeepSeek's inference-code names; ``transformers``' ``deepseek_v4``
model (and checkpoints saved from it) name them as below, under ``model.layers.{i}.``. The
indexer sits under the CSA compressor there. :func:`load_v4_hf_weights` maps one onto the other
with :func:`reference_impl.model.checkpoint.load_hf_weights` (FP8 weights with block scales are
dequantized on the way).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from reference_impl.families.deepseek_v4.config import V4ModelConfig
from reference_impl.model.checkpoint import HF_HEAD_NAMES, load_hf_weights

if TYPE_CHECKING:  # the model module imports the weights' names from here
    from reference_impl.families.deepseek_v4.model.oracle import V4Model

# Every layer: ours under ``layers.{i}.attn.`` -> Hugging Face's under ``model.layers.{i}.self_attn.``.
HF_V4_ATTENTION_NAMES: dict[str, str] = {
    "wq_a.weight": "q_a_proj.weight",
    "q_norm.weight": "q_a_norm.weight",
    "wq_b.weight": "q_b_proj.weight",
    "wkv.weight": "kv_proj.weight",
    "kv_norm.weight": "kv_norm.weight",
    "wo_a.weight": "o_a_proj.weight",
    "wo_b.weight": "o_b_proj.weight",
    "attn_sink": "sinks",
}
# CSA and HCA layers: the compressor.
HF_V4_COMPRESSOR_NAMES: dict[str, str] = {
    "compressor.wkv.weight": "compressor.kv_proj.weight",
    "compressor.wgate.weight": "compressor.gate_proj.weight",
    "compressor.ape": "compressor.position_bias",
    "compressor.norm.weight": "compressor.kv_norm.weight",
}
# CSA layers: the indexer (under the compressor in Hugging Face's model).
HF_V4_INDEXER_NAMES: dict[str, str] = {
    "indexer.wq_b.weight": "compressor.indexer.q_b_proj.weight",
    "indexer.weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight",
    "indexer.compressor.wkv.weight": "compressor.indexer.kv_proj.weight",
    "indexer.compressor.wgate.weight": "compressor.indexer.gate_proj.weight",
    "indexer.compressor.ape": "compressor.indexer.position_bias",
    "indexer.compressor.norm.weight": "compressor.indexer.kv_norm.weight",
}


def v4_attention_names(ratio: int) -> dict[str, str]:
    """Ours -> Hugging Face's, relative to the attention module, for a layer of compress ``ratio``."""
    names = dict(HF_V4_ATTENTION_NAMES)
    if ratio:
        names.update(HF_V4_COMPRESSOR_NAMES)
    if ratio == 4:
        names.update(HF_V4_INDEXER_NAMES)
    return names


def v4_hf_names(cfg: V4ModelConfig, first_layer: int = 0, head: bool = False) -> dict[str, str]:
    """Our parameter name -> the checkpoint name for ``cfg.n_layers`` layers from checkpoint layer
    ``first_layer``; our layer ``i`` has ``cfg``'s type ``i``, which checkpoint layer ``first_layer + i`` must share."""
    names = {}
    for i in range(cfg.n_layers):
        prefix, theirs = f"layers.{i}.", f"model.layers.{first_layer + i}."
        names[prefix + "attn_norm.weight"] = theirs + "input_layernorm.weight"
        for ours, hf in v4_attention_names(cfg.ratio(i)).items():
            names[prefix + "attn." + ours] = theirs + "self_attn." + hf
    if head:
        names.update(HF_HEAD_NAMES)
    return names


@torch.no_grad()
def load_v4_hf_weights(
    model: V4Model, source: str | Path | Mapping[str, torch.Tensor], *, first_layer: int = 0, head: bool = False
) -> dict[str, str]:
    """Copy the attention weights of checkpoint layers ``first_layer ..`` into a
    :class:`~reference_impl.families.deepseek_v4.model.oracle.V4Model`; see
    :func:`reference_impl.model.checkpoint.load_hf_weights`."""
    return load_hf_weights(model, source, names=v4_hf_names(model.cfg, first_layer, head))

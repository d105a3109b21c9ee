"""Load GLM-5.3 attention weights by the checkpoint's tensor names.

Our layers carry ``transformers``' ``glm5_next`` parameter names under ``layers.{i}.attn.`` (the
checkpoint's ``model.layers.{i}.self_attn.``), and the layer norm as ``layers.{i}.attn_norm`` (the
checkpoint's ``input_layernorm``): the map is one prefix for another, taken over the parameters the
model has (a KDA layer's, an indexed layer's, a layer sharing its selection has no ``indexer.*``).
:func:`reference_impl.model.checkpoint.load_hf_weights` reads them (FP8 weights with block scales are
dequantized on the way). MoE / MLP tensors and the hyper-connections' are not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from reference_impl.model.checkpoint import HF_HEAD_NAMES, load_hf_weights


def glm53_hf_names(model: torch.nn.Module, first_layer: int = 0, head: bool = False) -> dict[str, str]:
    """Our parameter name -> the checkpoint's, our layer ``i`` being checkpoint layer ``first_layer + i``
    (which must be of the same type)."""
    names = {}
    for ours, _ in model.named_parameters():
        parts = ours.split(".")
        if parts[0] != "layers":
            continue
        theirs = f"model.layers.{first_layer + int(parts[1])}."
        if parts[2] == "attn_norm":
            names[ours] = theirs + "input_layernorm." + ".".join(parts[3:])
        else:
            names[ours] = theirs + "self_attn." + ".".join(parts[3:])
    if head:
        names.update(HF_HEAD_NAMES)
    return names


@torch.no_grad()
def load_glm53_hf_weights(
    model: torch.nn.Module, source: str | Path | Mapping[str, torch.Tensor], *, first_layer: int = 0, head: bool = False
) -> dict[str, str]:
    """Copy the attention weights of checkpoint layers ``first_layer ..`` into a
    :class:`~reference_impl.families.glm53.model.oracle.Glm53Model`; see
    :func:`reference_impl.model.checkpoint.load_hf_weights` (its refusals, by name)."""
    return load_hf_weights(model, source, names=glm53_hf_names(model, first_layer, head))

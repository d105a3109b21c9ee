"""Strict FP8 checkpoint loading: an FP8 tensor loads only with its ``weight_scale_inv``, the name
DeepSeek-V3.2, GLM-5-FP8 and GLM-5.2-FP8 ship; IndexShare checkpoints lack the shared layers' indexer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reference_impl as ri
from reference_impl.model.checkpoint import FP8_BLOCK, hf_names, load_hf_weights
from reference_impl.model.oracle import DSAModel, init_weights
from reference_impl.presets import get_preset


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    ours = dict(model.named_parameters())
    return {theirs: ours[name].detach().clone() for name, theirs in hf_names(len(model.layers)).items() if name in ours}


def _fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block format: e4m3 weight and one inverse scale per 128 x 128 block."""
    blocks = (-(-weight.shape[0] // FP8_BLOCK), -(-weight.shape[1] // FP8_BLOCK))
    scale = torch.full(blocks, 0.01)
    return (weight / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def test_an_fp8_tensor_without_its_scale_is_refused_by_name() -> None:
    donor = ri.make_model("tiny", dtype=torch.float32, seed=1)
    model = ri.make_model("tiny", dtype=torch.float32, seed=2)
    before = model.layers[0].attn.wq_a.weight.clone()
    name = "model.layers.1.self_attn.indexer.wk.weight"
    tensors = _tensors(donor)
    tensors[name], scale = _fp8(tensors[name])
    with pytest.raises(ri.ConfigError, match=f"{name} is float8_e4m3fn but has no scale '{name}_scale_inv'"):
        load_hf_weights(model, tensors)
    assert torch.equal(model.layers[0].attn.wq_a.weight, before)  # nothing changed
    tensors[name + "_scale_inv"] = scale  # with its companion it loads, dequantized
    load_hf_weights(model, tensors)
    assert torch.allclose(
        model.layers[1].attn.indexer.wk.weight, donor.layers[1].attn.indexer.wk.weight, rtol=0.07, atol=3e-3
    )


def test_a_scale_beside_a_tensor_that_is_not_fp8_is_refused() -> None:
    donor = ri.make_model("tiny", dtype=torch.float32, seed=1)
    tensors = _tensors(donor)
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name + "_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(ri.ConfigError, match=f"{name} is float32, not FP8, yet has a scale"):
        load_hf_weights(ri.make_model("tiny", dtype=torch.float32), tensors)


def test_an_index_share_checkpoint_loads_without_the_shared_layers_indexer() -> None:
    cfg = dataclasses.replace(get_preset("tiny"), n_layers=3, index_topk_pattern="FSF")
    donor = init_weights(DSAModel(cfg, torch.float32), 4)
    tensors = _tensors(donor)
    assert not any("layers.1.self_attn.indexer" in name for name in tensors)  # as GLM-5.2 ships it
    model = DSAModel(cfg, torch.float32)
    names = load_hf_weights(model, tensors)
    assert "layers.1.attn.indexer.wk.weight" not in names and "layers.2.attn.indexer.wk.weight" in names
    assert all(
        torch.equal(a, b) for (_, a), (_, b) in zip(model.layers.named_parameters(), donor.layers.named_parameters())
    )
    # A model that expects an indexer on every layer names the one the checkpoint lacks.
    with pytest.raises(ri.ConfigError, match="no tensor 'model.layers.1.self_attn.indexer.wq_b.weight'"):
        load_hf_weights(DSAModel(dataclasses.replace(cfg, index_topk_pattern=None), torch.float32), tensors)

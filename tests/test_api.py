"""The public API: the package's exports resolve, checkpoints load by Hugging Face names, the oracle's
float32 mode, and run_prefill's tensors."""

from __future__ import annotations

import json

import pytest
import torch

import reference_impl as ri
from reference_impl.model.checkpoint import FP8_BLOCK, dequantize_fp8_weight, hf_names, load_hf_weights


def test_every_export_resolves() -> None:
    for name in ri.__all__:
        assert getattr(ri, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ri.nope  # noqa: B018


def _hf_tensors(model: ri.DSAModel, first_layer: int = 0) -> dict[str, torch.Tensor]:
    ours = dict(model.named_parameters())
    return {theirs: ours[name].detach().clone() for name, theirs in hf_names(len(model.layers), first_layer).items()}


def test_hf_names_load_into_the_model_fp8_blocks_dequantized() -> None:
    donor = ri.make_model("tiny", dtype=torch.float32, seed=3)
    tensors = _hf_tensors(donor, first_layer=5)  # a model's layers 5.. (DSA layers deep in a checkpoint)
    name = "model.layers.6.self_attn.kv_b_proj.weight"  # [H * (nope + v), kv_lora] = [256, 128]
    weight = tensors[name]
    blocks = (-(-weight.shape[0] // FP8_BLOCK), -(-weight.shape[1] // FP8_BLOCK))
    scale = torch.rand(blocks, generator=torch.Generator().manual_seed(0)) + 0.5
    fp8 = (
        weight
        / scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[: weight.shape[0], : weight.shape[1]]
    )
    tensors[name] = fp8.clamp(-448, 448).to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = scale
    model = ri.make_model("tiny", dtype=torch.float32, seed=9)
    names = load_hf_weights(model, tensors, first_layer=5)
    assert names["layers.0.attn.wq_a.weight"] == "model.layers.5.self_attn.q_a_proj.weight"
    assert torch.equal(model.layers[0].attn.wq_a.weight, donor.layers[0].attn.wq_a.weight)
    assert torch.equal(model.layers[1].attn.indexer.k_norm.bias, donor.layers[1].attn.indexer.k_norm.bias)
    assert torch.equal(model.layers[1].attn.wkv_b.weight, dequantize_fp8_weight(tensors[name], scale))
    assert torch.allclose(
        model.layers[1].attn.wkv_b.weight, donor.layers[1].attn.wkv_b.weight, rtol=0.07, atol=3e-3
    )  # e4m3 steps


def test_a_sharded_checkpoint_directory_loads(tmp_path) -> None:
    from safetensors.torch import save_file

    donor = ri.make_model("tiny", dtype=torch.float32, seed=4)
    tensors = _hf_tensors(donor)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = ri.make_model("tiny", dtype=torch.float32, checkpoint=tmp_path)
    assert all(
        torch.equal(a, b) for (_, a), (_, b) in zip(model.layers.named_parameters(), donor.layers.named_parameters())
    )


def test_a_missing_or_misshapen_tensor_is_refused_before_anything_changes() -> None:
    donor = ri.make_model("tiny", dtype=torch.float32, seed=5)
    model = ri.make_model("tiny", dtype=torch.float32, seed=6)
    before = model.layers[0].attn.wq_a.weight.clone()
    tensors = _hf_tensors(donor)
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    with pytest.raises(
        ri.ConfigError, match="no tensor 'model.layers.1.self_attn.o_proj.weight' \\(for layers.1.attn.wo.weight\\)"
    ):
        load_hf_weights(model, tensors)
    tensors = _hf_tensors(donor)
    tensors["model.layers.0.self_attn.q_b_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ri.ConfigError, match="has shape \\(3, 3\\) but layers.0.attn.wq_b.weight needs"):
        load_hf_weights(model, tensors)
    assert torch.equal(model.layers[0].attn.wq_a.weight, before)
    with pytest.raises(ri.ConfigError, match="does not exist"):
        ri.make_model("tiny", checkpoint="/nonexistent/model.safetensors")


def test_the_oracle_refuses_inputs_that_do_not_fit_the_requests() -> None:
    model = ri.make_model("tiny", dtype=torch.float32)
    requests = [ri.Request(0, 10)]
    with pytest.raises(ri.ConfigError, match=r"inputs\[0\] is \(9, 256\)"):
        ri.oracle(model, requests, [torch.zeros(9, 256)])


def test_run_prefill_returns_tensors_on_request() -> None:
    run = ri.RunConfig(cp_size=2, requests=(ri.Request(0, 40),), device="cpu")
    full = ri.run_prefill(run, tensors=True)
    assert full.report["matches_oracle"] is True and len(full.ranks) == 2
    assert sorted(g for r in full.ranks for g in r.token_ids) == list(range(40))
    for rank in full.ranks:  # each rank's final hidden states are the oracle's rows of its tokens
        want = full.oracle.hidden[0].float()[list(rank.token_ids)]
        assert torch.allclose(rank.local_hidden, want, atol=2e-3 * max(1.0, float(want.abs().max())))

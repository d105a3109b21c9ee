"""An independent reading of the layer: Hugging Face ``transformers``' ``deepseek_v32`` and ``glm_moe_dsa``.

Small random models of both are built in ``transformers``, their attention weights saved under the
Hugging Face names (safetensors), loaded here with :func:`load_hf_weights`, and one layer's output
and top-k compared with the oracle's (for GLM, a full layer and an IndexShare shared layer).

Tolerances, and why:

* **Top-k.** ``transformers`` scores the indexer in exact fp32; this package quantizes the indexer
  q and k to e4m3 (3 mantissa bits, ue8m0 scales), as DeepSeek's inference code does. That moves
  an index score by a few percent, so keys whose exact score is near the k-th may trade places,
  and no others. The rule: every key the oracle selects ranks among the first ``k + k/4`` of the
  exact order (:data:`RANK_BAND`), and at least 95% of the selections agree. Seen: the worst key
  at rank ``k + 5`` of ``k = 32``, 98.7% agreement, for both models. An indexer RoPE with the wrong
  pairing scatters the selection over the whole sequence (dozens of rows fail).
* **Output.** ``transformers`` runs with the oracle's top-k (its indexer returns it), so the
  indexer's quantization does not enter. What remains is the cache: the oracle runs with the bf16
  KV layout, whose 576 cached values are rounded to bf16 (relative ``2^-9``); the output agrees
  within ``1e-2 x max(1, max |ref|)`` (seen below ``2e-3``). A wrong RoPE in MLA moves it by O(1).

The injected bugs below show that each comparison fails when the layer is wrong.
``transformers`` is in ``requirements-dev.txt``; where the installed one lacks a model, its tests
are skipped, naming it.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the cross-check needs transformers (requirements-dev.txt)")

from reference_impl.model import attention as attention_module  # noqa: E402
from reference_impl.model.checkpoint import hf_names, load_hf_weights  # noqa: E402
from reference_impl.model.oracle import DSAModel, init_weights, run_oracle  # noqa: E402
from reference_impl.presets import ModelConfig, at_cpu_widths, get_preset  # noqa: E402

T = 96  # tokens: three times the CPU top-k, so the selection is a strict subset for most queries
RANK_BAND = 0.25  # a selected key must rank below k (1 + RANK_BAND) in the exact order
MIN_AGREEMENT = 0.95
OUTPUT_TOLERANCE = 1e-2


def _hf_module(model_type: str) -> object:
    try:
        return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        pytest.skip(
            f"transformers {transformers.__version__} has no {model_type} model (requirements-dev.txt pins 5.25)"
        )


# ---- building the two sides ------------------------------------------------------------------


def _hf_model(model_type: str, cfg: ModelConfig, indexer_types: list[str] | None = None) -> torch.nn.Module:
    """A ``transformers`` model of ``cfg``'s attention layer (the MoE half is the smallest that builds)."""
    module = _hf_module(model_type)
    if cfg.rope_factor > 1.0:
        rope = {
            "rope_type": "yarn",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.original_seq_len,
            "beta_fast": cfg.beta_fast,
            "beta_slow": cfg.beta_slow,
            "mscale": cfg.mscale,
            "mscale_all_dim": cfg.mscale,
        }
    else:
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    fields = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=cfg.n_layers,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        attn_implementation="eager",
    )
    if model_type == "glm_moe_dsa":
        config = transformers.GlmMoeDsaConfig(**fields, indexer_types=indexer_types)
        model = module.GlmMoeDsaModel(config)
    else:
        config = transformers.DeepseekV32Config(**fields)
        model = module.DeepseekV32Model(config)
    for layer in model.layers:  # transformers leaves these two at 1e-6; SGLang / vLLM / the presets use rms_norm_eps
        layer.self_attn.q_a_layernorm.variance_epsilon = cfg.norm_eps
        layer.self_attn.kv_a_layernorm.variance_epsilon = cfg.norm_eps
    return model.float().eval()


@torch.no_grad()
def _checkpoint(cfg: ModelConfig, hf: torch.nn.Module, tmp_path, seed: int = 3) -> str:
    """Random weights (this package's init, norms and biases included) in ``hf``, saved under their
    Hugging Face names: ``model.layers.{i}.self_attn...`` and ``input_layernorm``."""
    from safetensors.torch import save_file

    donor = dict(init_weights(DSAModel(cfg, torch.float32), seed).named_parameters())
    theirs = dict(hf.named_parameters())
    tensors = {}
    for ours, name in hf_names(cfg.n_layers).items():
        if ours in donor:  # a shared layer has no indexer on either side
            theirs[name.removeprefix("model.")].copy_(donor[ours])
            tensors[name] = donor[ours].detach().clone()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return str(path)


def _oracle(cfg: ModelConfig, checkpoint: str, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The oracle's final hidden states ``[T, dim]`` and per-layer top-k ``[T, K]`` (bf16 cache, fp32 compute)."""
    model = DSAModel(cfg, torch.float32)
    load_hf_weights(model, checkpoint)
    result = run_oracle(model, [0], [x], "bf16", 64, view_dtype=torch.float32)
    return result.hidden[0], [result.topk[layer][0] for layer in range(cfg.n_layers)]


@torch.no_grad()
def _hf_forward(
    hf: torch.nn.Module, x: torch.Tensor, topk: list[torch.Tensor] | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``h + attn(input_layernorm(h))`` per layer (no MLP), as the oracle composes layers.

    ``topk``: per layer, the top-k the layer's indexer returns instead of its own (the oracle's,
    ``-1`` slots pointing at the query itself); ``None``: each indexer returns its **whole order**
    over the sequence (top-k of all ``T``). Returns the final hidden states and what each layer
    selected (a shared layer: its full layer's)."""
    glm = hasattr(hf.layers[0].self_attn, "skip_topk")
    h = x[None]
    positions = torch.arange(T)[None]
    embeddings = hf.rotary_emb(h, positions)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    selected, previous = [], None
    for i, layer in enumerate(hf.layers):
        attn = layer.self_attn
        if attn.indexer is not None:
            if topk is not None:
                rows = torch.arange(T)[:, None].expand_as(topk[i])
                chosen = torch.where(topk[i] >= 0, topk[i], rows).to(torch.int32)[None]
                attn.indexer.forward = lambda *args, _chosen=chosen, **kwargs: _chosen
            else:
                attn.indexer.index_topk = T
        kwargs = {"prev_topk_indices": previous} if glm else {}
        result = attn(
            hidden_states=layer.input_layernorm(h),
            position_embeddings=embeddings,
            attention_mask=mask,
            position_ids=positions,
            **kwargs,
        )
        if glm:
            out, _, previous = result
        else:
            out, _ = result
        h = h + out
        selected.append(previous[0] if glm else None)
    return h[0], selected


def _exact_order(hf: torch.nn.Module, x: torch.Tensor, layer: int) -> torch.Tensor:
    """``transformers``' indexer order of every key for each query of ``layer`` (its exact fp32 scores)."""
    captured: list[torch.Tensor] = []
    handle = hf.layers[layer].self_attn.indexer.register_forward_hook(lambda m, a, out: captured.append(out[0]))
    try:
        _hf_forward(hf, x, None)
    finally:
        handle.remove()
    return captured[0]


def topk_problems(ours: torch.Tensor, order: torch.Tensor, k: int) -> list[str]:
    """Rows where the oracle's selection is not the exact one up to FP8 boundary swaps (module docstring)."""
    problems, agree, total = [], 0, 0
    limit = int(k * (1 + RANK_BAND))
    for j in range(ours.shape[0]):
        mine = [v for v in ours[j].tolist() if v >= 0]
        visible = min(k, j + 1)
        rank = {int(v): i for i, v in enumerate(order[j].tolist())}
        exact = set(order[j][:visible].tolist())
        agree, total = agree + len(exact & set(mine)), total + visible
        if len(mine) != visible or max(rank[v] for v in mine) >= limit:
            problems.append(f"query {j}: selects a key at exact rank {max(rank[v] for v in mine)} (limit {limit})")
    if agree < MIN_AGREEMENT * total:
        problems.append(f"only {agree / total:.1%} of the selections agree")
    return problems


def output_problems(ours: torch.Tensor, theirs: torch.Tensor) -> list[str]:
    err, scale = float((ours - theirs).abs().max()), max(1.0, float(theirs.abs().max()))
    return [] if err <= OUTPUT_TOLERANCE * scale else [f"hidden states differ by {err:.3g} (scale {scale:.3g})"]


# ---- the cross-checks -----------------------------------------------------------------------


def _v32() -> ModelConfig:
    """DeepSeek-V3.2's layer at CPU widths: 512-wide latent, YaRN factor 40, non-interleaved indexer RoPE."""
    return at_cpu_widths(get_preset("deepseek-v3.2").with_layers(1))


def _glm52() -> ModelConfig:
    """GLM-5.2's layer at CPU widths, a full layer then a shared one."""
    return dataclasses.replace(at_cpu_widths(get_preset("glm-5.2").with_layers(2)), index_topk_pattern="FS")


def _input(cfg: ModelConfig) -> torch.Tensor:
    return torch.randn(T, cfg.dim, generator=torch.Generator().manual_seed(1))


def test_deepseek_v32_layer_matches_transformers(tmp_path) -> None:
    cfg = _v32()
    hf = _hf_model("deepseek_v32", cfg)
    assert abs(hf.layers[0].self_attn.scaling - cfg.softmax_scale) < 1e-7  # YaRN mscale^2 on both sides
    checkpoint, x = _checkpoint(cfg, hf, tmp_path), _input(cfg)
    hidden, topk = _oracle(cfg, checkpoint, x)
    assert topk_problems(topk[0], _exact_order(hf, x, 0), cfg.index_topk) == []
    assert output_problems(hidden, _hf_forward(hf, x, topk)[0]) == []


def test_glm_moe_dsa_full_and_shared_layers_match_transformers(tmp_path) -> None:
    cfg = _glm52()
    hf = _hf_model("glm_moe_dsa", cfg, indexer_types=["full", "shared"])
    assert hf.layers[1].self_attn.indexer is None and cfg.index_share.pattern == "FS"
    checkpoint, x = _checkpoint(cfg, hf, tmp_path), _input(cfg)
    hidden, topk = _oracle(cfg, checkpoint, x)
    assert torch.equal(topk[1], topk[0])  # the shared layer reuses the full layer's selection
    assert topk_problems(topk[0], _exact_order(hf, x, 0), cfg.index_topk) == []
    theirs, selected = _hf_forward(hf, x, topk)
    assert torch.equal(selected[1], selected[0])  # transformers passes the full layer's top-k on the same way
    assert output_problems(hidden, theirs) == []


def test_the_comparisons_catch_injected_bugs(tmp_path, monkeypatch) -> None:
    """An indexer RoPE with the wrong pairing fails the top-k check; an MLA RoPE with the wrong
    pairing (every ``apply_rope`` flipped) fails the output check."""
    cfg = _v32()
    hf = _hf_model("deepseek_v32", cfg)
    checkpoint, x = _checkpoint(cfg, hf, tmp_path), _input(cfg)
    order = _exact_order(hf, x, 0)
    flipped = dataclasses.replace(cfg, index_rope_interleaved=not cfg.index_rope_interleaved)
    assert len(topk_problems(_oracle(flipped, checkpoint, x)[1][0], order, cfg.index_topk)) > 10

    real = attention_module.apply_rope
    monkeypatch.setattr(
        attention_module, "apply_rope", lambda x_, cos, sin, interleaved: real(x_, cos, sin, not interleaved)
    )
    hidden, topk = _oracle(cfg, checkpoint, x)
    assert output_problems(hidden, _hf_forward(hf, x, topk)[0]) != []


def test_presets_agree_with_the_transformers_configs() -> None:
    """The preset dims, norm epsilons and GLM-5.2's layer pattern against the config classes."""
    _hf_module("glm_moe_dsa")
    _hf_module("deepseek_v32")
    fields = {
        "dim": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "q_lora_rank": "q_lora_rank",
        "kv_lora_rank": "kv_lora_rank",
        "qk_nope_head_dim": "qk_nope_head_dim",
        "qk_rope_head_dim": "qk_rope_head_dim",
        "v_head_dim": "v_head_dim",
        "index_n_heads": "index_n_heads",
        "index_head_dim": "index_head_dim",
        "index_topk": "index_topk",
        "vocab_size": "vocab_size",
        "norm_eps": "rms_norm_eps",
    }
    for preset, config in (
        ("deepseek-v3.2", transformers.DeepseekV32Config()),
        ("glm-5", transformers.GlmMoeDsaConfig()),
    ):
        cfg = get_preset(preset)
        assert {ours: getattr(cfg, ours) for ours in fields} == {
            ours: getattr(config, theirs) for ours, theirs in fields.items()
        }
    glm52 = transformers.GlmMoeDsaConfig(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=3)
    assert (
        "".join("F" if t == "full" else "S" for t in glm52.indexer_types) == get_preset("glm-5.2").index_share.pattern
    )

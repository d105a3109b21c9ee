"""DeepSeek-V4's attention layer and oracle against ``transformers``' ``DeepseekV4Attention``, and its byte layouts.

Tolerances: with the ``fp32`` codec (nothing quantized) every layer type agrees with
transformers to float32 rounding (relative 1e-5 of the largest output). The engines' layout
(``fp8``: 448 e4m3 dims with power-of-two scales per 64, FP4 indexer) moves outputs by a few
percent on sliding and HCA layers (e4m3 keeps 3 mantissa bits, a relative step of up to 1/8 per
value, averaged over the softmax) and more on CSA layers, where FP4 index scores change which
entries are selected: bounded here at 6% and 20% of the largest output.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reference_impl.families.deepseek_v4 import cache_layout as L
from reference_impl.families.deepseek_v4.model.cache import V4LayerCache, v4_layer_forward
from reference_impl.families.deepseek_v4.model.checkpoint import load_v4_hf_weights, v4_attention_names
from reference_impl.families.deepseek_v4.model.oracle import build_v4_model, run_v4_oracle
from reference_impl.presets import get_preset

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

CFG = get_preset("tiny-v4")
HF_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def hf_config() -> DeepseekV4Config:
    cfg = DeepseekV4Config(
        hidden_size=CFG.dim,
        num_hidden_layers=CFG.n_layers,
        num_attention_heads=CFG.n_heads,
        head_dim=CFG.head_dim,
        q_lora_rank=CFG.q_lora_rank,
        o_groups=CFG.o_groups,
        o_lora_rank=CFG.o_lora_rank,
        index_n_heads=CFG.index_n_heads,
        index_head_dim=CFG.index_head_dim,
        index_topk=CFG.index_topk,
        sliding_window=CFG.window_size,
        layer_types=[HF_TYPES[CFG.ratio(i)] for i in range(CFG.n_layers)],
        rope_theta=CFG.rope_theta,
        compress_rope_theta=CFG.compress_rope_theta,
        max_position_embeddings=CFG.max_seq_len,
        rope_parameters={
            "rope_type": "yarn",
            "factor": CFG.rope_factor,
            "beta_fast": CFG.beta_fast,
            "beta_slow": CFG.beta_slow,
            "original_max_position_embeddings": CFG.original_seq_len,
        },
        vocab_size=CFG.vocab_size,
        rms_norm_eps=CFG.norm_eps,
    )
    cfg._attn_implementation = "eager"
    return cfg


#: The transformers release this reading was checked against; earlier ones ship a deepseek_v4 with
#: another masking and cache API (5.17, on the GPU box, has no ``cache`` argument in its masks).
HF_VERSION = "5.25"


@pytest.fixture(scope="module")
def setup():
    from packaging.version import Version

    if Version(transformers.__version__) < Version(HF_VERSION):
        pytest.skip(
            f"transformers {transformers.__version__}: the cross-check reads {HF_VERSION}'s deepseek_v4 "
            "(requirements-dev.txt pins it)"
        )
    model = build_v4_model(CFG, torch.float32, 0, "cpu")
    hf = hf_config()
    layers = []
    for i in range(CFG.n_layers):
        theirs = hf_v4.DeepseekV4Attention(hf, i).float()
        names = v4_attention_names(CFG.ratio(i))
        theirs.load_state_dict({names[k]: v for k, v in model.layers[i].attn.state_dict().items()}, strict=True)
        layers.append(theirs)
    return model, hf, layers, hf_v4.DeepseekV4RotaryEmbedding(hf)


def hf_forward(hf, layer, rot, x, positions, cache=None):
    from transformers.masking_utils import create_sliding_window_causal_mask

    with torch.no_grad():
        mask = create_sliding_window_causal_mask(
            config=hf, inputs_embeds=x[None], attention_mask=None, cache=cache, position_ids=positions[None]
        )
        pe = {k: rot(x[None], positions[None], layer_type=k) for k in ("main", "compress")}
        return layer(x[None], pe, positions[None], mask, cache=cache)[0][0]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


T = 200  # one HCA entry (tokens 0..127) and 50 CSA entries


@pytest.mark.parametrize("layer", range(CFG.n_layers), ids=lambda i: HF_TYPES[CFG.ratio(i)])
def test_one_shot_prefill_matches_transformers(setup, layer):
    model, hf, layers, rot = setup
    x = torch.randn(T, CFG.dim, generator=torch.Generator().manual_seed(3))
    ref = hf_forward(hf, layers[layer], rot, x, torch.arange(T))
    exact, _, _ = v4_layer_forward(
        model.layers[layer].attn, x, 0, V4LayerCache.empty("fp32", CFG.ratio(layer), 512, 128, "cpu"), torch.float32
    )
    assert rel_err(exact, ref) < 1e-5
    quant, _, _ = v4_layer_forward(
        model.layers[layer].attn, x, 0, V4LayerCache.empty("fp8", CFG.ratio(layer), 512, 128, "cpu"), torch.float32
    )
    assert rel_err(quant, ref) < (0.2 if CFG.ratio(layer) == 4 else 0.06)


def test_chunked_prefill_carries_compressor_state_like_transformers(setup):
    """Chunks of 37, 93, 1 and 69 tokens (crossing window and entry boundaries) against transformers' cache."""
    from transformers.cache_utils import DynamicCache

    model, hf, layers, rot = setup
    x = torch.randn(T, CFG.dim, generator=torch.Generator().manual_seed(4))
    hf_cache = DynamicCache(config=hf)
    ours = [V4LayerCache.empty("fp32", CFG.ratio(i), 512, 128, "cpu") for i in range(CFG.n_layers)]
    bounds = [0, 37, 130, 131, T]
    for a, b in zip(bounds, bounds[1:]):
        from transformers.masking_utils import create_sliding_window_causal_mask

        positions = torch.arange(a, b)
        with torch.no_grad():
            mask = create_sliding_window_causal_mask(
                config=hf, inputs_embeds=x[None, a:b], attention_mask=None, cache=hf_cache, position_ids=positions[None]
            )
            pe = {k: rot(x[None, a:b], positions[None], layer_type=k) for k in ("main", "compress")}
            for i in range(CFG.n_layers):
                ref = layers[i](x[None, a:b], pe, positions[None], mask, cache=hf_cache)[0][0]
                out, _, _ = v4_layer_forward(model.layers[i].attn, x[a:b], a, ours[i], torch.float32)
                assert rel_err(out, ref) < 1e-5, (a, b, i)


def test_cross_check_catches_a_compressor_without_overlap(setup, monkeypatch):
    """An injected bug: CSA entries pooled from their own 4 tokens only (the overlap's first half
    dropped). The transformers comparison fails on the CSA layer, beyond any tolerance above."""
    model, hf, layers, rot = setup
    x = torch.randn(T, CFG.dim, generator=torch.Generator().manual_seed(3))
    attn = model.layers[1].attn
    true_pool = attn.ops.pool

    def no_overlap(kv_rows, score_rows, slot_rows, ratio):
        if ratio == 4:
            slot_rows = torch.cat([torch.full_like(slot_rows[:, :4], -1), slot_rows[:, 4:]], dim=1)
        return true_pool(kv_rows, score_rows, slot_rows, ratio)

    monkeypatch.setattr(attn, "ops", dataclasses.replace(attn.ops, pool=no_overlap))
    ref = hf_forward(hf, layers[1], rot, x, torch.arange(T))
    out, _, _ = v4_layer_forward(attn, x, 0, V4LayerCache.empty("fp32", 4, 512, 128, "cpu"), torch.float32)
    assert rel_err(out, ref) > 0.2


def test_weights_load_by_hugging_face_names(setup):
    model, hf, _, rot = setup
    gen = torch.Generator().manual_seed(7)
    theirs = hf_v4.DeepseekV4Attention(hf, 1).float()  # a CSA layer: every parameter kind
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5
                if p.dim() == 2
                else 1 + 0.1 * torch.randn(p.shape, generator=gen)
            )
    state = {f"model.layers.1.self_attn.{k}": v for k, v in theirs.state_dict().items()}
    state["model.layers.1.input_layernorm.weight"] = torch.ones(CFG.dim)
    csa_only = dataclasses.replace(CFG, n_layers=1, compress_ratios=(4,))  # its layer 0 is the checkpoint's layer 1
    one = build_v4_model(csa_only, torch.float32, 1, "cpu")
    names = load_v4_hf_weights(one, state, first_layer=1)
    assert "layers.0.attn.indexer.compressor.ape" in names
    x = torch.randn(150, CFG.dim, generator=gen)
    ref = hf_forward(hf, theirs, rot, x, torch.arange(150))
    out, _, _ = v4_layer_forward(
        one.layers[0].attn, x, 0, V4LayerCache.empty("fp32", 4, 512, 128, "cpu"), torch.float32
    )
    assert rel_err(out, ref) < 1e-5


def test_oracle_chunked_equals_one_shot_byte_for_byte():
    model = build_v4_model(CFG, torch.float32, 0, "cpu")
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(263, CFG.dim, generator=gen), torch.randn(150, CFG.dim, generator=gen)]
    one = run_v4_oracle(model, [0, 41], xs, "fp8")
    chunked = run_v4_oracle(model, [0, 41], xs, "fp8", chunk_size=57)
    for a, b in zip(one.hidden, chunked.hidden):
        assert torch.equal(a, b)
    for layer in range(CFG.n_layers):
        for c1, c2 in zip(one.caches[layer], chunked.caches[layer]):
            for f in ("raw", "entries", "index_keys", "pool_kv", "pool_score", "index_pool_kv", "index_pool_score"):
                assert torch.equal(getattr(c1, f), getattr(c2, f)), (layer, f)
    assert one.caches[1][0].entries.shape[0] == 263 // 4 and one.caches[2][0].entries.shape[0] == 2
    topk = one.topk[1][0]
    assert (topk[:3] == -1).all() and topk[3, 0] == 0  # token 3 completes entry 0: the causal rule
    assert ((topk >= 0).sum(1) == torch.clamp(torch.arange(1, 264) // 4, max=CFG.index_topk)).all()


# ---- byte layouts ---------------------------------------------------------------------------


def test_entry_sizes():
    assert L.main_entry_bytes("fp8") == 584 and L.main_entry_bytes("bf16") == 1024
    assert L.index_entry_bytes("fp8") == 68 and L.index_entry_bytes("bf16") == 256
    assert L.main_page_bytes(64) == 64 * 584 + 576 - (64 * 584) % 576


def test_fp8_entry_byte_by_byte():
    x = torch.zeros(1, 512)
    x[0, :64] = 3.0  # tile 0: amax 3 -> scale 2^ceil(log2(3/448)) = 2^-7
    x[0, 64] = -1.0  # tile 1: amax 1 -> 2^-8
    x[0, 448:] = torch.arange(64) / 8  # RoPE dims, bf16-exact
    row = L.encode_main(x, "fp8")[0]
    assert row.shape == (584,)
    codes = row[:448].view(torch.float8_e4m3fn).float()
    assert codes[0] == 3.0 * 2**7 and codes[64] == -(2.0**8) and codes[128:].abs().sum() == 0
    assert torch.equal(row[448:576].view(torch.bfloat16).float(), x[0, 448:])
    assert row[576].item() == 127 - 7 and row[577].item() == 127 - 8
    assert row[578].item() == L.ue8m0_bytes(torch.tensor([2.0**-22]))[0].item()  # amax floor 1e-4 / 448
    assert row[583].item() == 0
    assert torch.equal(L.decode_main(row[None], "fp8"), x)


def test_fp8_page_is_flashmla_layout():
    rows = L.encode_main(torch.randn(64, 512, generator=torch.Generator().manual_seed(0)), "fp8")
    page = L.rows_to_page(rows)
    assert page.shape == (L.main_page_bytes(64),)
    assert torch.equal(page[576:1152], rows[1, :576]) and torch.equal(page[64 * 576 : 64 * 576 + 8], rows[0, 576:])
    assert torch.equal(L.page_to_rows(page, 64), rows)


def test_fp4_index_key_byte_by_byte():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0])  # ties go to the even code
    assert L.e2m1_values(L.e2m1_codes(y)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -6.0]
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1], x[0, 32] = 6.0, -3.0, 0.75  # block 0 scale 1; block 1 amax 0.75 -> 2^-3
    row = L.encode_index(x, "fp8")[0]
    assert row.shape == (68,)
    assert row[0].item() == 0x7 | (0x8 | 0x5) << 4  # 6.0 in the low nibble, -3.0 in the high one
    assert row[64].item() == 127 and row[65].item() == 127 - 3
    assert torch.equal(L.decode_index(row[None], "fp8"), x)


@pytest.mark.parametrize("codec", ["fp8", "bf16", "fp32"])
def test_round_trips_within_the_codec(codec):
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(2))
    back = L.decode_main(L.encode_main(x, codec), codec)
    bound = {"fp8": 2.0**-3, "bf16": 2.0**-8, "fp32": 0.0}[codec]
    nope_scale = x[:, :448].unflatten(1, (7, 64)).abs().amax(-1, keepdim=True).expand(-1, -1, 64).flatten(1)
    assert ((back[:, :448] - x[:, :448]).abs() <= bound * nope_scale + 1e-30).all()
    k = torch.randn(5, 128)
    assert torch.allclose(
        L.decode_index(L.encode_index(k, codec), codec),
        k,
        rtol={"fp8": 0.5, "bf16": 1e-2, "fp32": 0}[codec],
        atol={"fp8": 0.5, "bf16": 0, "fp32": 0}[codec],
    )

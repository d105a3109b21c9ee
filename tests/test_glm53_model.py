"""GLM-5.3's layers against ``transformers``' ``glm5_next`` modules on random weights, in float32.

The ``transformers`` text model is built from a small ``Glm5NextTextConfig`` (every layer type: KDA, an
indexed layer with its own indexer, one sharing it), its parameters drawn at random, and loaded into ours
by the checkpoint's tensor names (:func:`load_glm53_hf_weights`). Each layer is then run on unaligned
lengths (not multiples of the 16-token group or the 64-token KDA chunk), whole and as a cached prefix
followed by its extend (``transformers``' ``DynamicCache`` on its side, our per-request caches on ours).

Tolerance: outputs within ``TOL`` = 1e-4 of max(1, max |reference|) (float32; the two sides sum in other
orders: the chunked KDA with its state entered at another token, einsum against matmul); selections as
sets, exactly (random float32 scores do not tie).
"""

from __future__ import annotations

import pytest
import torch

M = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next", reason="transformers has no glm5_next")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig  # noqa: E402

from reference_impl.errors import ConfigError  # noqa: E402
from reference_impl.families.glm53.config import DSA, KDA, PRESETS, from_hf_config  # noqa: E402
from reference_impl.families.glm53.model.checkpoint import glm53_hf_names, load_glm53_hf_weights  # noqa: E402
from reference_impl.families.glm53.model.dsa import select  # noqa: E402
from reference_impl.families.glm53.model.kda import kda_chunked, span_map  # noqa: E402
from reference_impl.families.glm53.model.oracle import (  # noqa: E402
    DSACache,
    Glm53Model,
    KDACache,
    dsa_span,
    kda_span,
    run_glm53_oracle,
)

TOL = 1e-4
LAYER_TYPES = [KDA, DSA, DSA, KDA]
INDEXER_TYPES = ["full", "full", "shared", "full"]


def _hf_config() -> Glm5NextTextConfig:
    cfg = Glm5NextTextConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=32,
        index_head_dim=16,
        index_n_heads=4,
        linear_head_dim=16,
        linear_num_heads=2,
        num_hidden_layers=4,
        layer_types=list(LAYER_TYPES),
        indexer_types=list(INDEXER_TYPES),
        vocab_size=128,
        pad_token_id=0,
        intermediate_size=32,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        hc_mult=2,
    )
    cfg._attn_implementation = "eager"
    return cfg


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, Glm53Model]:
    """``transformers``' text model with random weights, and ours loaded from its state dict by name."""
    torch.manual_seed(0)
    hf_cfg = _hf_config()
    hf = M.Glm5NextTextModel(hf_cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            w = torch.randn(p.shape, generator=gen)
            if name.endswith("dt_bias"):
                w = -5.0 + 0.5 * w  # decays of a few percent per token: the state carries far
            elif name.endswith("A_log"):
                w = 0.1 * w
            elif p.dim() >= 2:
                w = w / p.shape[-1] ** 0.5 if not name.endswith("conv1d.weight") else w / 2
            else:
                w = 1.0 + 0.1 * w if not name.endswith("bias") else 0.1 * w
            p.copy_(w)
    ours = Glm53Model(from_hf_config(hf_cfg, "hf-small")).eval()
    checkpoint = {f"model.{k}": v for k, v in hf.state_dict().items()}
    loaded = load_glm53_hf_weights(ours, checkpoint)
    assert set(loaded) == {n for n, _ in ours.named_parameters() if n.startswith("layers.")}
    return hf, ours


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = float((got.float() - want.float()).abs().max())
    assert err <= TOL * max(1.0, float(want.abs().max())), err


def _x(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("length", [37, 83, 130])
def test_kda_layer_matches_transformers(pair, length: int) -> None:
    hf, ours = pair
    x = _x(length)
    with torch.no_grad():
        want = hf.layers[0].self_attn(x[None])[0]
        got = kda_span(ours.layers[0].attn, x, KDACache.empty(ours.cfg, torch.float32, "cpu"))
    _close(got, want)


@pytest.mark.parametrize(("prefix", "extend"), [(21, 30), (67, 45), (3, 2)])
def test_kda_layer_with_a_cached_prefix(pair, prefix: int, extend: int) -> None:
    """Prefix, then extend on its state and convolution tail: ``transformers`` with its cache, ours with
    ours, and both equal to the whole sequence at once."""
    hf, ours = pair
    x = _x(prefix + extend)
    attn = ours.layers[0].attn
    with torch.no_grad():
        whole = hf.layers[0].self_attn(x[None])[0]
        cache = DynamicCache(config=hf.config)
        hf.layers[0].self_attn(x[None, :prefix], cache=cache)
        want = hf.layers[0].self_attn(x[None, prefix:], cache=cache)[0]
        ours_cache = KDACache.empty(ours.cfg, torch.float32, "cpu")
        kda_span(attn, x[:prefix], ours_cache)
        got = kda_span(attn, x[prefix:], ours_cache)
        hf_state = cache.get_recurrent_state(0)  # [batch, heads, head_dim, head_dim]
    _close(want, whole[prefix:])
    _close(got, want)
    assert ours_cache.state.dtype == torch.float32
    _close(ours_cache.state, hf_state[0])


def test_the_state_map_composes_spans(pair) -> None:
    """A span's map ``S -> A S + B`` gives the state the recurrence reaches from any entering state."""
    _, ours = pair
    attn = ours.layers[0].attn
    x = _x(53)
    with torch.no_grad():
        q, k, v = attn.qkv(attn.conv(attn.mixed(x), torch.zeros(3, ours.cfg.conv_dim)))
        g, beta = attn.gates(x)
        entering = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(5))
        _, want = kda_chunked(q, k, v, g, beta, entering)
        A, B = span_map(k, v, g, beta)
    _close(A @ entering + B, want)
    assert float((B - want).abs().max()) > 1e-2  # the entering state matters (the test can fail)


def _stable_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: ANN202
    """``Tensor.topk`` with our tie rule: among equal scores the lower index first."""
    order = self.sort(dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((self.gather(dim, order), order))


@pytest.mark.parametrize("length", [29, 61, 100])
def test_indexed_layers_match_transformers(pair, monkeypatch: pytest.MonkeyPatch, length: int) -> None:
    """The layer with its own indexer (selection and output), then the one sharing its selection.
    ``transformers`` selects with ``topk``, whose order among tied scores (the ReLU zeroes many) is unspecified
    and changes with the number of groups; ours takes the lower group id (:func:`select`): the comparison runs
    ``transformers`` with that rule."""
    hf, ours = pair
    monkeypatch.setattr(torch.Tensor, "topk", _stable_topk)
    x = _x(length, seed=7)
    mask = torch.ones(1, length, dtype=torch.bool)
    with torch.no_grad():
        hf_attn = hf.layers[1].self_attn
        q_resid = hf_attn.q_a_layernorm(hf_attn.q_a_proj(x[None]))
        hf_topk = hf_attn.indexer(x[None], q_resid, mask, None)[0]
        want, _, passed = hf_attn(x[None], mask)
        cache = DSACache.empty(ours.cfg, 1, torch.float32, torch.float32, "cpu")
        got, selection = dsa_span(ours.layers[1].attn, x, 0, cache, None)
        want_shared = hf.layers[2].self_attn(x[None], mask, prev_topk_indices=passed)[0]
        got_shared, _ = dsa_span(
            ours.layers[2].attn, x, 0, DSACache.empty(ours.cfg, 2, torch.float32, torch.float32, "cpu"), selection
        )
    for t in range(length):
        assert set(selection[t][selection[t] >= 0].tolist()) == set(hf_topk[t][hf_topk[t] >= 0].tolist()), t
    if length > 48:  # more complete groups than the 2 selected: a strict subset somewhere
        assert (selection >= 0).sum(1).max() < length
    _close(got, want[0])
    _close(got_shared, want_shared[0])


@pytest.mark.parametrize(("prefix", "extend"), [(21, 40), (48, 19), (5, 70)])
def test_indexed_layer_with_a_cached_prefix(pair, prefix: int, extend: int) -> None:
    """Groups straddling the prefix boundary: the prefix's incomplete group pools once the extend completes it."""
    hf, ours = pair
    x = _x(prefix + extend, seed=11)
    with torch.no_grad():
        hf_attn = hf.layers[1].self_attn
        cache = DynamicCache(config=hf.config)
        hf_attn(x[None, :prefix], torch.ones(1, prefix, dtype=torch.bool), cache=cache)
        want = hf_attn(x[None, prefix:], torch.ones(1, extend, dtype=torch.bool), cache=cache)[0][0]
        whole = hf_attn(x[None], torch.ones(1, prefix + extend, dtype=torch.bool))[0][0]
        ours_cache = DSACache.empty(ours.cfg, 1, torch.float32, torch.float32, "cpu")
        dsa_span(ours.layers[1].attn, x[:prefix], 0, ours_cache, None)
        got, _ = dsa_span(ours.layers[1].attn, x[prefix:], prefix, ours_cache, None)
    _close(want, whole[prefix:])
    _close(got, want)
    assert ours_cache.group_keys is not None and len(ours_cache.group_keys) == (prefix + extend) // 16
    assert ours_cache.pending_k is not None and len(ours_cache.pending_k) == (prefix + extend) % 16


def test_a_selection_does_not_depend_on_later_groups() -> None:
    """Tied scores (zeros): a query selects the same groups whether the scores span 4 groups or 12, the later
    ones invisible to it (a chunk's scores, or a whole request's): what a prefix hit needs of the selection."""
    cfg = PRESETS["tiny-glm53"]
    positions = torch.tensor([63, 47])
    narrow, wide = torch.zeros(2, 4), torch.zeros(2, 12)
    narrow[1, 1] = wide[1, 1] = 0.5  # the second query: group 1, then a tie between groups 0 and 2
    got_narrow, got_wide = select(cfg, narrow, positions), select(cfg, wide, positions)
    assert torch.equal(got_narrow, got_wide)
    assert got_narrow[0, :32].tolist() == list(range(32))  # the lower ids win the tie
    assert got_narrow[1, :32].tolist() == list(range(32))


def test_the_oracle_runs_chunks_as_one(pair) -> None:
    _, ours = pair
    inputs = [_x(77, seed=1), _x(40, seed=2)]
    whole = run_glm53_oracle(ours, [29, 0], inputs, torch.float32, None)
    chunked = run_glm53_oracle(ours, [29, 0], inputs, torch.float32, 13)
    for a, b in zip(whole.hidden, chunked.hidden):
        _close(b, a)
    for layer in range(4):
        for a, b in zip(whole.selections[layer], chunked.selections[layer]):
            assert torch.equal(a, b)


def test_checkpoint_names_and_refusals(pair) -> None:
    _, ours = pair
    names = glm53_hf_names(ours, first_layer=4, head=True)
    assert names["layers.0.attn.conv1d.weight"] == "model.layers.4.self_attn.conv1d.weight"
    assert names["layers.1.attn_norm.weight"] == "model.layers.5.input_layernorm.weight"
    assert names["head.weight"] == "lm_head.weight" and "layers.2.attn.indexer.wk.weight" not in names
    with pytest.raises(ConfigError, match="has no tensor"):
        load_glm53_hf_weights(ours, {})


def test_presets() -> None:
    flash, tiny = PRESETS["glm-5.3-flash"], PRESETS["tiny-glm53"]
    hf = Glm5NextTextConfig()
    assert from_hf_config(hf, "glm-5.3-flash") == flash
    assert flash.count(KDA) == 34 and flash.count(DSA) == 11 and flash.kda_state_bytes == 64 * 128 * 128 * 4
    assert {tiny.layer_type(i) for i in range(tiny.n_layers)} == {KDA, DSA} and tiny.shares_selection(2)
    assert tiny.index_kpool == 16 and tiny.with_layers(2).n_layers == 2
    with pytest.raises(ConfigError, match="layer 1 shares"):
        type(tiny)(**{**tiny.__dict__, "indexer_types": ("full", "shared", "full", "full")})

"""GLM-5.3's attention-layer dimensions: :class:`Glm53Config` and the GLM-5.3 presets.

Field names follow ``transformers``' ``Glm5NextTextConfig`` (``models/glm5_next``), with ``dim`` for
``hidden_size``, ``n_layers`` for ``num_hidden_layers`` and ``n_heads`` for ``num_attention_heads``.
Only the attention layers' fields are kept: the MoE / MLP half of a block and the hyper-connection
streams (``hc_mult``) are not part of the CP story and not modelled here.

Each layer is one of two types (``layer_types``):

* ``"linear_attention"``: Kimi Delta Attention (KDA): q / k / v projections through a short causal
  depthwise convolution (width ``linear_conv_kernel_dim``, SiLU), L2-normalised q and k, a per-channel
  forget gate bounded below by ``linear_lower_bound``, a per-head input gate ``beta``, and the gated
  delta rule over a ``linear_head_dim x linear_head_dim`` float32 state per head; a gated RMSNorm and
  an output projection. Its cache is that state and the convolution's last ``conv - 1`` input rows.
* ``"indexed_attention"``: MLA without RoPE (``qk_rope_head_dim = 0``: one ``kv_lora_rank``-wide latent
  row per token is the whole KV cache) under DSA. The indexer's keys are pooled per group of
  ``index_kpool`` tokens (a softmax over the group's tokens, per channel, of a gate projection plus a
  learned position bias, weighting the tokens' keys); a query scores the complete groups whose last
  token it sees, takes the best ``index_topk / index_kpool`` of them, and (``index_kpool_always_select_tail``)
  every token of its own incomplete group. ``indexer_types`` per layer: ``"full"`` runs the indexer,
  ``"shared"`` reuses the previous layer's selection (IndexShare; as in ``transformers`` the previous
  layer must be an indexed layer, with its own indexer or sharing one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from reference_impl.errors import ConfigError

LayerType = Literal["linear_attention", "indexed_attention"]
KDA, DSA = "linear_attention", "indexed_attention"
CHECKPOINT = "zai-org/GLM-5.3-Flash"


def default_layer_types(n_layers: int) -> tuple[str, ...]:
    """``Glm5NextTextConfig``'s default: three KDA layers, then one indexed layer, repeating."""
    return tuple(DSA if i % 4 == 3 else KDA for i in range(n_layers))


@dataclass(frozen=True)
class Glm53Config:
    """Dimensions and semantics of GLM-5.3's attention layers (see the module docstring)."""

    name: str
    n_layers: int
    dim: int  # hidden_size
    vocab_size: int
    n_heads: int  # num_attention_heads (MLA)
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    index_kpool: int
    linear_head_dim: int
    linear_num_heads: int
    layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    qk_rope_head_dim: int = 0
    index_kpool_always_select_tail: bool = True
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1 << 20
    mla_scale_fmt: str = "ue8m0"  # the FP8 latent row's tile scales (a run's --mla-scale-fmt; cache_layout.py)

    def __post_init__(self) -> None:
        if len(self.layer_types) < self.n_layers or len(self.indexer_types) < self.n_layers:
            raise ConfigError(
                f"{self.name}: {len(self.layer_types)} layer types and {len(self.indexer_types)} indexer types "
                f"for {self.n_layers} layers"
            )
        bad = sorted({t for t in self.layer_types if t not in (KDA, DSA)})
        if bad:
            raise ConfigError(f"{self.name}: layer types {bad} are not {KDA!r} or {DSA!r}")
        if sorted({t for t in self.indexer_types if t not in ("full", "shared")}):
            raise ConfigError(f"{self.name}: indexer types must be 'full' or 'shared'")
        if self.qk_rope_head_dim != 0:
            raise ConfigError(f"{self.name}: qk_rope_head_dim={self.qk_rope_head_dim}: GLM-5.3's MLA has no RoPE part")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise ConfigError(
                f"{self.name}: index_topk={self.index_topk} must be a positive multiple of "
                f"index_kpool={self.index_kpool}"
            )
        if not self.index_kpool_always_select_tail:
            raise ConfigError(
                f"{self.name}: index_kpool_always_select_tail=False leaves a query without keys before its first "
                "complete group; only True (the checkpoint's) is modelled"
            )
        for i in range(self.n_layers):
            if self.shares_selection(i) and (i == 0 or self.layer_types[i - 1] != DSA):
                raise ConfigError(
                    f"{self.name}: layer {i} shares the previous layer's selection, but layer {i - 1} is no indexed "
                    "layer (transformers passes a selection to the next layer only)"
                )

    # ---- layer types --------------------------------------------------------------------------

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer]

    def is_kda(self, layer: int) -> bool:
        return self.layer_types[layer] == KDA

    def shares_selection(self, layer: int) -> bool:
        """An indexed layer that reuses the previous layer's selection (IndexShare ``"shared"``)."""
        return self.layer_types[layer] == DSA and self.indexer_types[layer] == "shared"

    def count(self, kind: str) -> int:
        return sum(t == kind for t in self.layer_types[: self.n_layers])

    # ---- derived dimensions -------------------------------------------------------------------

    @property
    def qkv_dim(self) -> int:
        """Width of each of KDA's q, k and v: ``linear_num_heads * linear_head_dim``."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of KDA's convolution: q, k and v side by side."""
        return 3 * self.qkv_dim

    @property
    def groups_selected(self) -> int:
        """Complete groups a query selects at most: ``index_topk / index_kpool``."""
        return self.index_topk // self.index_kpool

    @property
    def selection_width(self) -> int:
        """Columns of a selection row: the selected groups' tokens and the tail's (at most ``kpool - 1``)."""
        return self.index_topk + self.index_kpool - 1

    @property
    def kda_state_bytes(self) -> int:
        """One request's KDA state of one layer (float32 ``[heads, head_dim, head_dim]``)."""
        return self.linear_num_heads * self.linear_head_dim * self.linear_head_dim * 4

    def with_layers(self, n_layers: int) -> Glm53Config:
        """The first ``n_layers`` layers (their types as in the full model)."""
        if not 1 <= n_layers <= len(self.layer_types):
            raise ConfigError(f"{self.name} has {len(self.layer_types)} layers, asked for {n_layers}")
        return dataclasses.replace(self, n_layers=n_layers)


GLM53_PRESETS: dict[str, Glm53Config] = {
    # Glm5NextTextConfig's defaults (the GLM-5.3-Flash checkpoint): 45 layers, three KDA layers then one
    # indexed layer; every indexed layer runs its own indexer (index_topk_freq 1).
    "glm-5.3-flash": Glm53Config(
        name="glm-5.3-flash",
        n_layers=45,
        dim=4096,
        vocab_size=154880,
        n_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=256,
        v_head_dim=256,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=32,
        index_kpool=16,
        linear_head_dim=128,
        linear_num_heads=64,
        layer_types=default_layer_types(45),
        indexer_types=("full",) * 45,
    ),
    # CPU-sized: every layer type (KDA, indexed with its own indexer, indexed sharing it), the real
    # group of 16 tokens and convolution of 4; top-k 32 selects 2 groups, a strict subset past 48 tokens.
    "tiny-glm53": Glm53Config(
        name="tiny-glm53",
        n_layers=4,
        dim=64,
        vocab_size=128,
        n_heads=2,
        q_lora_rank=32,
        kv_lora_rank=256,  # two 128-value tiles of the FP8 latent row
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=32,
        index_head_dim=16,
        index_n_heads=4,
        index_kpool=16,
        linear_head_dim=16,
        linear_num_heads=2,
        layer_types=(KDA, DSA, DSA, KDA),
        indexer_types=("full", "full", "shared", "full"),
        max_position_embeddings=1 << 16,
    ),
}

CONFIG_TYPE = Glm53Config  # the registry's entries (reference_impl.families)
PRESETS = GLM53_PRESETS


def from_hf_config(hf: object, name: str) -> Glm53Config:
    """Our config from a ``transformers`` ``Glm5NextTextConfig`` (any object with its field names)."""
    n_layers = int(hf.num_hidden_layers)  # type: ignore[attr-defined]
    return Glm53Config(
        name=name,
        n_layers=n_layers,
        dim=hf.hidden_size,  # type: ignore[attr-defined]
        vocab_size=hf.vocab_size,  # type: ignore[attr-defined]
        n_heads=hf.num_attention_heads,  # type: ignore[attr-defined]
        q_lora_rank=hf.q_lora_rank,  # type: ignore[attr-defined]
        kv_lora_rank=hf.kv_lora_rank,  # type: ignore[attr-defined]
        qk_nope_head_dim=hf.qk_nope_head_dim,  # type: ignore[attr-defined]
        v_head_dim=hf.v_head_dim,  # type: ignore[attr-defined]
        index_topk=hf.index_topk,  # type: ignore[attr-defined]
        index_head_dim=hf.index_head_dim,  # type: ignore[attr-defined]
        index_n_heads=hf.index_n_heads,  # type: ignore[attr-defined]
        index_kpool=hf.index_kpool,  # type: ignore[attr-defined]
        linear_head_dim=hf.linear_head_dim,  # type: ignore[attr-defined]
        linear_num_heads=hf.linear_num_heads,  # type: ignore[attr-defined]
        layer_types=tuple(hf.layer_types),  # type: ignore[attr-defined]
        indexer_types=tuple(hf.indexer_types),  # type: ignore[attr-defined]
        qk_rope_head_dim=hf.qk_rope_head_dim,  # type: ignore[attr-defined]
        index_kpool_always_select_tail=hf.index_kpool_always_select_tail,  # type: ignore[attr-defined]
        linear_conv_kernel_dim=hf.linear_conv_kernel_dim,  # type: ignore[attr-defined]
        linear_lower_bound=hf.linear_lower_bound,  # type: ignore[attr-defined]
        rms_norm_eps=hf.rms_norm_eps,  # type: ignore[attr-defined]
        max_position_embeddings=hf.max_position_embeddings,  # type: ignore[attr-defined]
    )

"""Model presets: the dimensions and semantics of one DSA attention layer per model.

:class:`ModelConfig` field names follow DeepSeek-V3.2's ``ModelArgs`` where one exists;
:data:`PRESETS` holds DeepSeek-V3.2, GLM-5, GLM-5.2 and ``tiny`` (small enough for CPU tests).

Where the values were read: DeepSeek-V3.2 from its ``inference/config_671B_v3.2.json`` (dims,
``scale_fmt: ue8m0``) and ``inference/model.py`` (every norm at the ``RMSNorm`` default 1e-6);
GLM-5 from ``GlmMoeDsaConfig`` in Hugging Face ``transformers`` 5.25 (its defaults are GLM-5's
checkpoint, ``zai-org/GLM-5``: dims, ``rms_norm_eps = 1e-5``); GLM-5.2 from copies of its
``config.json`` (``zai-org/GLM-5.2``) quoted in public repositories, the hub file itself not being
in our sources: GLM-5's dims, ``index_topk_freq = 4``, ``index_skip_topk_offset = 3``,
``max_position_embeddings = 1048576``, ``rope_theta = 8e6`` with default (non-YaRN) RoPE,
``rms_norm_eps = 1e-5``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from reference_impl.errors import ConfigError
from reference_impl.fp8 import SCALE_FMTS
from reference_impl.index_share import IndexShare, check_pattern, pattern_from_freq

ScaleFmt = Literal["ue8m0", "fp32"]


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and semantics of one DSA attention layer (MLA + lightning indexer).

    Field names follow DeepSeek-V3.2's ``ModelArgs`` where one exists.
    """

    name: str
    n_layers: int
    dim: int  # hidden size
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_rope_interleaved: bool  # False for DeepSeek-V3.2 (fixed 2025-11), True for GLM-5
    index_scale_fmt: ScaleFmt = "ue8m0"  # FP8 scales of indexer q/k
    # FP8 scales of the MLA cache's latent blocks: "ue8m0" (powers of two, DeepSeek's act_quant with
    # scale_fmt "ue8m0") or "fp32" (amax / 448, SGLang's quantizer). Same 656-byte row either way.
    mla_scale_fmt: ScaleFmt = "ue8m0"
    vocab_size: int = 129280  # only the logits of collected output rows use it
    rope_theta: float = 10000.0
    rope_factor: float = 40.0  # YaRN factor; 1.0 disables YaRN
    original_seq_len: int = 4096
    max_seq_len: int = 163840
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0
    # RMSNorm epsilon of attn_norm, q_norm, kv_norm and the final norm (the indexer's k_norm
    # LayerNorm keeps 1e-6 in every implementation read).
    norm_eps: float = 1e-6
    # IndexShare (GLM-5.2): which layers run the indexer. ``index_topk_pattern`` (one letter per
    # layer, F full / S shared) wins; else the rule of ``index_topk_freq`` and ``index_skip_topk_offset``
    # (reference_impl.index_share.pattern_from_freq; GlmMoeDsaConfig's defaults 1 and 2); freq 1:
    # every layer full.
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    index_topk_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.kv_lora_rank % 128:
            raise ConfigError(
                f"kv_lora_rank={self.kv_lora_rank} is not a multiple of 128: the packed FP8 layout "
                "keeps one scale per 128 latent values"
            )
        if self.index_head_dim % 128 or self.index_head_dim & (self.index_head_dim - 1):
            raise ConfigError(
                f"index_head_dim={self.index_head_dim} must be a power of two and a multiple of 128 "
                "(Hadamard rotation, FP8 block 128)"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and fit the indexer head")
        for name in ("index_scale_fmt", "mla_scale_fmt"):
            if getattr(self, name) not in SCALE_FMTS:
                raise ConfigError(f"{name}={getattr(self, name)!r}: use 'ue8m0' or 'fp32'")
        if self.index_topk_freq < 1:
            raise ConfigError(f"index_topk_freq={self.index_topk_freq} must be >= 1")
        if self.index_topk_pattern is not None:
            object.__setattr__(self, "index_topk_pattern", check_pattern(self.index_topk_pattern, self.n_layers))
        _ = self.index_share  # the derived pattern is valid too (a first shared layer is refused)

    @property
    def index_share(self) -> IndexShare:
        """Which layers run the indexer (:class:`~reference_impl.index_share.IndexShare`)."""
        pattern = self.index_topk_pattern or pattern_from_freq(
            self.n_layers, self.index_topk_freq, self.index_skip_topk_offset
        )
        return IndexShare(pattern)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_width(self) -> int:
        """Width of one token's MLA cache entry before quantization: latent + rope (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def yarn_mscale(self) -> float:
        if self.max_seq_len <= self.original_seq_len or self.rope_factor <= 1.0:
            return 1.0
        return 0.1 * self.mscale * math.log(self.rope_factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale ``qk_head_dim^-0.5 * mscale^2`` (192^-0.5 * mscale^2 for V3.2)."""
        return self.qk_head_dim**-0.5 * self.yarn_mscale**2

    def with_layers(self, n_layers: int) -> ModelConfig:
        """The same model with ``n_layers`` layers: the first ones of an explicit indexer pattern,
        or the freq / offset rule over the new count."""
        pattern = self.index_topk_pattern
        if pattern is not None:
            if n_layers > len(pattern):
                raise ConfigError(
                    f"n_layers={n_layers}: index_topk_pattern {pattern!r} names only {len(pattern)} layers"
                )
            pattern = pattern[:n_layers]
        return dataclasses.replace(self, n_layers=n_layers, index_topk_pattern=pattern)


# GLM-5 shares the DSA layer; RoPE settings below are placeholders that only move positions
# (override them from the checkpoint's config): no layout or CP logic depends on them.
# rms_norm_eps 1e-5 (GlmMoeDsaConfig); SGLang and vLLM apply it to q_a/kv_a_layernorm too,
# transformers' glm_moe_dsa only to the block norms (its q_a/kv_a keep the class default 1e-6).
_GLM5 = ModelConfig(
    name="glm-5",
    n_layers=78,
    dim=6144,
    n_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    index_rope_interleaved=True,
    vocab_size=154880,
    rope_theta=1_000_000.0,
    rope_factor=1.0,
    max_seq_len=202752,
    norm_eps=1e-5,
)


PRESETS: dict[str, ModelConfig] = {
    "deepseek-v3.2": ModelConfig(
        name="deepseek-v3.2",
        n_layers=61,
        dim=7168,
        n_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
        index_rope_interleaved=False,
    ),
    "glm-5": _GLM5,
    # GLM-5.2: GLM-5's layer with IndexShare (full layers 0, 1, 2, 6, 10, ..., 74: 21 of 78) and a
    # 1M-token window. Values from copies of its config.json (see the module docstring).
    "glm-5.2": dataclasses.replace(
        _GLM5,
        name="glm-5.2",
        rope_theta=8_000_000.0,
        max_seq_len=1_048_576,
        index_topk_freq=4,
        index_skip_topk_offset=3,
    ),
    # Small enough for CPU tests, big enough that top-k (32) selects a strict subset.
    "tiny": ModelConfig(
        name="tiny",
        n_layers=2,
        dim=256,
        n_heads=4,
        q_lora_rank=96,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        index_n_heads=16,  # enough heads that ReLU-zero index scores (exact ties) are rare
        index_head_dim=128,
        index_topk=32,
        index_rope_interleaved=False,
        vocab_size=512,
        rope_factor=4.0,
        original_seq_len=64,
        max_seq_len=8192,
    ),
}


# The widths that CPU runs of a real preset take from ``tiny`` (``RunConfig.cpu_widths``): the rest of
# the preset stays, its layer semantics, head dims and so the KV byte layouts included.
CPU_WIDTH_FIELDS = ("dim", "n_heads", "q_lora_rank", "index_n_heads", "index_topk", "vocab_size")


def at_cpu_widths(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with ``tiny``'s widths (:data:`CPU_WIDTH_FIELDS`: hidden 256, 4 heads, q_lora 96, 16
    indexer heads, top-k 32, vocab 512) and everything else its own: GLM-5's 192 / 64 / 256 head
    dims, 512-wide latent (656-byte FP8 rows), interleaved indexer RoPE, norm epsilon, RoPE and
    IndexShare rule. A layer of GLM-5 then weighs about 2 MB instead of 700 MB in float32."""
    tiny = PRESETS["tiny"]
    return dataclasses.replace(cfg, **{name: getattr(tiny, name) for name in CPU_WIDTH_FIELDS})


def preset_names() -> tuple[str, ...]:
    """Every preset's name, every family's (:func:`reference_impl.families.preset_names`)."""
    from reference_impl.families import preset_names as names

    return names()


def get_preset(name: str) -> Any:
    """Look a preset up by name in every family (:func:`reference_impl.families.get_preset`): the DSA
    family's :data:`PRESETS` answer with a :class:`ModelConfig`, DeepSeek-V4's with its own config."""
    from reference_impl.families import get_preset as lookup

    return lookup(name)

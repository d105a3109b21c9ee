"""Model presets: the dimensions and semantics of one DSA attention layer per model.

:class:`ModelConfig` field names follow DeepSeek-V3.2's ``ModelArgs`` where one exists;
:data:`PRESETS` holds DeepSeek-V3.2, GLM-5 and ``tiny`` (small enough for CPU tests).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from reference_impl.errors import ConfigError


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
    index_scale_fmt: Literal["ue8m0", "fp32"] = "ue8m0"  # FP8 scales of indexer q/k
    vocab_size: int = 129280  # only the logits of collected output rows use it
    rope_theta: float = 10000.0
    rope_factor: float = 40.0  # YaRN factor; 1.0 disables YaRN
    original_seq_len: int = 4096
    max_seq_len: int = 163840
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0
    norm_eps: float = 1e-6

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

    def with_layers(self, n_layers: int) -> "ModelConfig":
        return dataclasses.replace(self, n_layers=n_layers)


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
    # GLM-5 shares the DSA layer; RoPE settings below are placeholders that only move positions
    # (override them from the checkpoint's config): no layout or CP logic depends on them.
    "glm-5": ModelConfig(
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


def preset_names() -> tuple[str, ...]:
    """Every preset's name: :data:`PRESETS`, then DeepSeek-V4's (:data:`reference_impl.presets_v4.V4_PRESETS`)."""
    from reference_impl.presets_v4 import V4_PRESETS

    return (*PRESETS, *V4_PRESETS)


def get_preset(name: str) -> ModelConfig:
    """Look a preset up by name; an unknown name is a :class:`ConfigError` listing the known ones.

    DeepSeek-V4's presets (:data:`reference_impl.presets_v4.V4_PRESETS`) answer too, with a
    :class:`~reference_impl.presets_v4.V4ModelConfig` (``is_v4`` tells them apart).
    """
    from reference_impl.presets_v4 import V4_PRESETS

    if name in V4_PRESETS:
        return V4_PRESETS[name]  # type: ignore[return-value]
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted([*PRESETS, *V4_PRESETS]))
        raise ConfigError(f"unknown preset {name!r}; known presets: {known}") from None

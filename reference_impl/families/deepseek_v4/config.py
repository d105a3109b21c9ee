"""DeepSeek-V4's attention layer dimensions: :class:`V4ModelConfig` and the V4 presets.

A DeepSeek-V4 layer is one of three types, fixed per layer by its **compress ratio** ``m``
(``compress_ratios[layer]``, the field of DeepSeek's ``ModelArgs``):

* ``m = 0``, **sliding window** (SWA): each query attends to the last ``window_size`` (128) raw
  tokens, itself included;
* ``m = 4``, **CSA** (compressed sparse attention): every 4 tokens pool into one compressed entry
  (gated softmax over overlapping 8-token windows); a lightning indexer with its own ratio-4
  compressor picks ``index_topk`` entries per query; plus the window;
* ``m = 128``, **HCA** (heavily compressed attention): every 128 tokens pool into one entry
  (non-overlapping), attended densely; plus the window.

One 512-wide KV head is both key and value (RoPE on its last 64 dims, inverse RoPE on the
output), each query head has a learned attention sink, and a grouped low-rank projection
(``o_groups`` groups of ``o_lora_rank``) produces the output. Field names follow
``inference/model.py`` of the DeepSeek-V4-Flash release; the published dimensions come from the
Flash and Pro ``config.json`` files (the list of ratios there has one more entry, the MTP layer's,
which is not part of the main stack).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from reference_impl.errors import ConfigError

LayerType = Literal["sliding", "csa", "hca"]
CSA_RATIO, HCA_RATIO = 4, 128
V4_HEAD_DIM, V4_ROPE_DIM = 512, 64  # FlashMLA's V4 entry: 448 FP8 + 64 BF16 dims
LAYER_TYPES: dict[int, LayerType] = {0: "sliding", CSA_RATIO: "csa", HCA_RATIO: "hca"}


@dataclass(frozen=True)
class V4ModelConfig:
    """Dimensions and semantics of DeepSeek-V4's attention layers (see the module docstring)."""

    name: str
    n_layers: int
    dim: int  # hidden size
    n_heads: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    compress_ratios: tuple[int, ...]  # per layer: 0 (sliding), 4 (CSA) or 128 (HCA)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    head_dim: int = V4_HEAD_DIM
    rope_head_dim: int = V4_ROPE_DIM
    window_size: int = 128
    vocab_size: int = 129280
    rope_theta: float = 10000.0  # sliding layers: plain RoPE
    compress_rope_theta: float = 160000.0  # CSA / HCA layers and their compressors: YaRN on this base
    rope_factor: float = 16.0
    original_seq_len: int = 65536  # YaRN's original length (0 disables YaRN)
    beta_fast: int = 32
    beta_slow: int = 1
    max_seq_len: int = 1 << 20
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if len(self.compress_ratios) < self.n_layers:
            raise ConfigError(f"{self.name}: {len(self.compress_ratios)} compress ratios for {self.n_layers} layers")
        unknown = sorted({r for r in self.compress_ratios if r not in LAYER_TYPES})
        if unknown:
            raise ConfigError(f"{self.name}: compress ratios {unknown} are not 0 (sliding), 4 (CSA) or 128 (HCA)")
        if self.head_dim != V4_HEAD_DIM or self.rope_head_dim != V4_ROPE_DIM:
            raise ConfigError(
                f"{self.name}: head_dim={self.head_dim}, rope_head_dim={self.rope_head_dim}: the V4 cache entry "
                f"(448 FP8 + 64 BF16 dims) needs {V4_HEAD_DIM} / {V4_ROPE_DIM}"
            )
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ConfigError(
                f"{self.name}: {self.n_heads} heads x {self.head_dim} do not split into {self.o_groups} groups"
            )
        if self.index_head_dim % 32 or self.index_head_dim & (self.index_head_dim - 1):
            raise ConfigError(
                f"{self.name}: index_head_dim={self.index_head_dim} must be a power of two and a multiple of 32 "
                "(Hadamard rotation, FP4 block 32)"
            )
        if self.window_size < 1 or self.index_topk < 1:
            raise ConfigError(f"{self.name}: window_size and index_topk must be positive")

    # ---- layer types --------------------------------------------------------------------------

    def ratio(self, layer: int) -> int:
        """Compress ratio of ``layer``: 0, 4 or 128."""
        return self.compress_ratios[layer]

    def layer_type(self, layer: int) -> LayerType:
        return LAYER_TYPES[self.ratio(layer)]

    @property
    def layer_types(self) -> tuple[LayerType, ...]:
        return tuple(self.layer_type(i) for i in range(self.n_layers))

    def count(self, kind: LayerType) -> int:
        """How many of the ``n_layers`` layers are of type ``kind``."""
        return sum(t == kind for t in self.layer_types)

    # ---- derived dimensions -------------------------------------------------------------------

    @property
    def nope_head_dim(self) -> int:
        """Dims of an entry without RoPE (448): stored as FP8."""
        return self.head_dim - self.rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``head_dim^-0.5`` (no YaRN mscale: V4 applies YaRN to frequencies only)."""
        return self.head_dim**-0.5

    @property
    def group_width(self) -> int:
        """Input width of one output group: ``n_heads * head_dim / o_groups``."""
        return self.n_heads * self.head_dim // self.o_groups

    def with_layers(self, n_layers: int) -> V4ModelConfig:
        """The first ``n_layers`` layers (their types as in the full model)."""
        if n_layers > len(self.compress_ratios):
            raise ConfigError(f"{self.name} has {len(self.compress_ratios)} layers, asked for {n_layers}")
        return dataclasses.replace(self, n_layers=n_layers)


def _alternating(n_layers: int, head: tuple[int, ...]) -> tuple[int, ...]:
    """``head`` then CSA, HCA, CSA, ... to ``n_layers`` (the published V4 schedules)."""
    rest = tuple(CSA_RATIO if i % 2 == 0 else HCA_RATIO for i in range(n_layers - len(head)))
    return head + rest


V4_PRESETS: dict[str, V4ModelConfig] = {
    # config.json of DeepSeek-V4-Flash: 2 sliding layers, then CSA / HCA alternating, CSA last.
    "deepseek-v4-flash": V4ModelConfig(
        name="deepseek-v4-flash",
        n_layers=43,
        dim=4096,
        n_heads=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        compress_ratios=_alternating(43, (0, 0)),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
    ),
    # config.json of DeepSeek-V4-Pro: 2 HCA layers, then CSA / HCA alternating, CSA last.
    "deepseek-v4-pro": V4ModelConfig(
        name="deepseek-v4-pro",
        n_layers=61,
        dim=7168,
        n_heads=128,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        compress_ratios=_alternating(61, (HCA_RATIO, HCA_RATIO)),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=1024,
    ),
    # CPU-sized, all three layer types, the real window, ratios and cache entry; top-k 16 selects a
    # strict subset of a few hundred tokens' CSA entries.
    "tiny-v4": V4ModelConfig(
        name="tiny-v4",
        n_layers=3,
        dim=256,
        n_heads=4,
        q_lora_rank=96,
        o_groups=2,
        o_lora_rank=64,
        compress_ratios=(0, CSA_RATIO, HCA_RATIO),
        index_n_heads=16,
        index_head_dim=128,
        index_topk=16,
        vocab_size=512,
        original_seq_len=4096,
        max_seq_len=1 << 16,
    ),
}


CONFIG_TYPE = V4ModelConfig  # the registry's entries (reference_impl.families)
PRESETS = V4_PRESETS

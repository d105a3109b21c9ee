"""GLM-5.3's linear-attention layer: Kimi Delta Attention (KDA), pure torch, float32 state.

The math is ``transformers``' ``Glm5NextTextLinearAttention`` with its torch fallbacks
(``causal_conv1d_fn`` and ``chunk_kimi_delta_attention``), for one sequence at a time:

1. ``mixed = [q_proj(x) | k_proj(x) | v_proj(x)]``, then a causal depthwise convolution of width
   ``K = linear_conv_kernel_dim`` over the sequence (weights float32, no bias) and SiLU. Its cache is
   the last ``K - 1`` rows of ``mixed`` (before the convolution): a later span (a chunk, another
   rank's block) convolves ``[those rows | its own rows]``.
2. ``q, k`` L2-normalised per head (eps inside the root, as FLA does), ``q`` scaled by ``head_dim^-0.5``;
   forget gate ``g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))`` per channel (a log
   decay in ``(lower_bound, 0)``), input gate ``beta = sigmoid(b_proj(x))`` per head.
3. Per head, the gated delta rule on a ``[head_dim, head_dim]`` float32 state ``S``: for each token
   ``S <- (I - beta k k^T) diag(exp g) S + beta k v^T`` and ``o = S^T q``. :func:`kda_chunked` mirrors
   the chunked torch fallback (64-token chunks, the WY form within a chunk).
4. ``o_proj(gated_rmsnorm(o, sigmoid(g_b(g_a(x)))))``.

**The state map.** Step 3 is affine in the state: a span of tokens maps ``S_in`` to
``A S_in + B`` with ``A = M_T ... M_1`` (``M_t = (I - beta_t k_t k_t^T) diag(exp g_t)``) and ``B`` the
span's state from zero. :func:`span_map` computes both with the same chunked routine (``A``: the
recurrence from ``I`` with zero values). This is what CP exchanges: each rank maps its blocks, the
maps are all-gathered, and each rank composes the maps before its block (:func:`compose`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from reference_impl.families.glm53.config import Glm53Config

KDA_CHUNK = 64  # transformers' chunk_kimi_delta_attention default


class ForgetGate(nn.Module):
    """Per-channel log decay; parameter names as in ``transformers`` (``forget_gate.*``)."""

    def __init__(self, cfg: Glm53Config) -> None:
        super().__init__()
        self.head_dim, self.num_heads = cfg.linear_head_dim, cfg.linear_num_heads
        self.f_a_proj = nn.Linear(cfg.dim, cfg.linear_head_dim, bias=False)
        self.f_b_proj = nn.Linear(cfg.linear_head_dim, cfg.qkv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(cfg.qkv_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(cfg.linear_num_heads, dtype=torch.float32))
        self.lower_bound = cfg.linear_lower_bound

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, dim]`` -> ``g [T, heads, head_dim]`` float32 (natural-log decay per token and channel)."""
        f = self.f_b_proj(self.f_a_proj(x))
        g = (f.float() + self.dt_bias.float()).view(len(x), self.num_heads, self.head_dim)
        decay_rate = self.A_log.float().exp().view(1, -1, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(decay_rate * g)
        return -decay_rate * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))


class GatedRMSNorm(nn.Module):
    """float32 RMSNorm over a head's channels times ``sigmoid(gate)`` (``o_norm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h * torch.sigmoid(gate.float())).to(x.dtype)


class KDAttention(nn.Module):
    """One KDA layer's parameters (``transformers``' names) and its per-span pieces. ``ops``: the
    recurrence's cores (:class:`KDAOps`; the torch references, :data:`KDA_TORCH_OPS`, by default)."""

    def __init__(self, cfg: Glm53Config, ops: KDAOps | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops or KDA_TORCH_OPS
        d, hd = cfg.dim, cfg.linear_head_dim
        self.q_proj = nn.Linear(d, cfg.qkv_dim, bias=False)
        self.k_proj = nn.Linear(d, cfg.qkv_dim, bias=False)
        self.v_proj = nn.Linear(d, cfg.qkv_dim, bias=False)
        self.conv1d = nn.Conv1d(
            cfg.conv_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim, groups=cfg.conv_dim, bias=False, dtype=torch.float32
        )
        self.forget_gate = ForgetGate(cfg)
        self.b_proj = nn.Linear(d, cfg.linear_num_heads, bias=False)
        self.g_a_proj = nn.Linear(d, hd, bias=False)
        self.g_b_proj = nn.Linear(hd, cfg.qkv_dim, bias=False)
        self.o_norm = GatedRMSNorm(hd, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(cfg.qkv_dim, d, bias=False)

    @property
    def halo(self) -> int:
        """Rows of ``mixed`` a span needs from before it: ``conv - 1``."""
        return self.cfg.linear_conv_kernel_dim - 1

    def mixed(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, dim]`` -> ``[T, 3 * qkv_dim]``: the convolution's input rows."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def conv(self, mixed: torch.Tensor, halo: torch.Tensor) -> torch.Tensor:
        """SiLU of the causal convolution of ``mixed [T, C]`` after ``halo [K - 1, C]`` (the rows before
        the span, zeros before the sequence's start) -> ``[T, C]``."""
        seq = torch.cat([halo.to(mixed), mixed]).to(self.conv1d.weight.dtype).t().unsqueeze(0)
        out = F.conv1d(seq, self.conv1d.weight, groups=self.cfg.conv_dim)[0].t()
        return F.silu(out).to(mixed.dtype)

    def qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, C]`` -> q, k (L2-normalised, q scaled) and v, float32 ``[T, heads, head_dim]``."""
        shape = (len(conv_out), self.cfg.linear_num_heads, self.cfg.linear_head_dim)
        q, k, v = (t.reshape(shape).float() for t in conv_out.split(self.cfg.qkv_dim, dim=-1))
        return l2norm(q) * self.cfg.linear_head_dim**-0.5, l2norm(k), v

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g [T, heads, head_dim], beta [T, heads])``, float32."""
        return self.forget_gate(x), torch.sigmoid(self.b_proj(x)).float()

    def finish(self, x: torch.Tensor, core: torch.Tensor) -> torch.Tensor:
        """The core output ``[T, heads, head_dim]`` through the gated norm and ``o_proj`` -> ``[T, dim]``."""
        gate = self.g_b_proj(self.g_a_proj(x)).view(core.shape)
        return self.o_proj(self.o_norm(core.to(x.dtype), gate).reshape(len(x), -1))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's L2 norm (``x / sqrt(sum x^2 + eps)``), as ``transformers`` mirrors it."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = KDA_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one span, float32: ``q, k [T, H, Dk]`` (q already scaled), ``v [T, H, Dv]``,
    ``g [T, H, Dk]``, ``beta [T, H]``, ``state [H, Dk, Dv]`` -> ``(o [T, H, Dv], final state [H, Dk, Dv])``.

    ``transformers``' ``chunk_kimi_delta_attention`` for one sequence, step for step."""
    check_kda_inputs(q, k, v, g, beta, state)
    T = q.shape[0]
    if T == 0:
        return v.new_zeros(v.shape), state.float().clone()
    q, k, v, g = (t.float().transpose(0, 1) for t in (q, k, v, g))  # [H, T, D]
    beta = beta.float().transpose(0, 1)  # [H, T]
    pad = (chunk - T % chunk) % chunk
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    H, n = q.shape[0], (T + pad) // chunk
    q, k, v, g, k_beta, v_beta = (t.reshape(H, n, chunk, t.shape[-1]) for t in (q, k, v, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)
    dev = q.device
    mask = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=dev), diagonal=0)
    strict = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=dev), diagonal=1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict[..., None], float("-inf")).exp()
    attn = -(k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(mask, 0)
    for i in range(1, chunk):
        row, sub = attn[..., i, :i].clone(), attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    attn = attn + torch.eye(chunk, dtype=attn.dtype, device=dev)
    value = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp())
    S = state.float().clone()
    out = torch.zeros_like(value)
    for i in range(n):
        q_i, k_i, v_i, g_i = q[:, i], k[:, i], value[:, i], g[:, i]
        inter = (q_i * g_i.exp()) @ S
        intra = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay[:, i]).sum(dim=-1).masked_fill(strict, 0)
        v_new = v_i - k_cumdecay[:, i] @ S
        out[:, i] = inter + intra @ v_new
        S = S * g_i[:, -1].exp().unsqueeze(-1) + (k_i * (g_i[:, -1:] - g_i).exp()).transpose(-1, -2) @ v_new
    return out.reshape(H, n * chunk, -1)[:, :T].transpose(0, 1), S


def check_kda_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> None:
    """Refuse, by argument name, inputs :func:`kda_chunked` (or a kernel with its contract) cannot take:
    ``q, k, g [T, H, Dk]``, ``v [T, H, Dv]``, ``beta [T, H]``, ``state [H, Dk, Dv]``, floating point, one device.
    Shapes only: nothing is read from the device."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: a floating-point tensor is needed, got {kind}")
        if t.dim() != (2 if name == "beta" else 3):
            raise ValueError(f"{name}: {2 if name == 'beta' else 3} dims expected, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: one device needed")
    T, H, Dk = q.shape
    Dv = v.shape[2]
    want = {"k": (T, H, Dk), "g": (T, H, Dk), "v": (T, H, Dv), "beta": (T, H), "state": (H, Dk, Dv)}
    for name, shape in want.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(
                f"{name}: shape {tuple(named[name].shape)}, expected {shape} "
                f"(q {tuple(q.shape)} = [T, H, Dk], v {tuple(v.shape)} = [T, H, Dv])"
            )
    if H == 0 or Dk == 0 or Dv == 0:
        raise ValueError(f"q {tuple(q.shape)}, v {tuple(v.shape)}: heads and head dims must be positive")


def span_map(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The span's state map ``S -> A S + B``: ``(A [H, Dk, Dk], B [H, Dk, Dv])``, float32 (see the module docstring)."""
    H, Dk = k.shape[1], k.shape[2]
    eye = torch.eye(Dk, dtype=torch.float32, device=k.device).expand(H, Dk, Dk)
    zeros_v = k.new_zeros((k.shape[0], H, Dk), dtype=torch.float32)
    _, A = kda_chunked(k, k, zeros_v, g, beta, eye)
    _, B = kda_chunked(k, k, v, g, beta, k.new_zeros((H, Dk, v.shape[2]), dtype=torch.float32))
    return A, B


def compose(state: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The state after a span of map ``(A, B)`` entered with ``state`` ``[H, Dk, Dv]``."""
    return A @ state + B


@dataclass(frozen=True)
class KDAOps:
    """What a KDA layer hands to kernels (the torch references by default, :data:`KDA_TORCH_OPS`):

    * ``chunked(q, k, v, g, beta, state)`` -> ``(o [T, H, Dv], final state [H, Dk, Dv])`` float32
      (:func:`kda_chunked`);
    * ``span_map(k, v, g, beta)`` -> ``(A [H, Dk, Dk], B [H, Dk, Dv])`` float32 (:func:`span_map`).

    The kernel table is :data:`reference_impl.families.glm53.kernels.dispatch.KDA_KERNEL_OPS`.
    """

    name: str
    chunked: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    span_map: Callable[..., tuple[torch.Tensor, torch.Tensor]]


KDA_TORCH_OPS = KDAOps("torch", kda_chunked, span_map)

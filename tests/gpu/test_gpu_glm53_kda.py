"""GLM-5.3's chunked KDA kernels compiled on CUDA (GPU tier), at GLM-5.3-Flash's head shape.

64 heads of ``Dk = Dv = 128``, bf16 inputs (as the layer hands them on a GPU), a float32 entering state:
the outputs and final state against the torch reference run on the same GPU in float32 (TF32 off),
the span map likewise, the dispatch picking the kernel, and the model built with ``kernels=True``
against the torch one.

Tolerance ``TOL = 1e-4`` of ``max(1, max |reference|)``: as in ``tests/test_glm53_kda_kernel.py``
(the same chunked algorithm in float32, sums reordered, every state factor a contraction), with
sums of up to ``C + Dk = 192`` terms and the GPU's ``exp`` a few ulp off: ten times the CPU bound.
A bf16 state would be off by ``2^-9`` of its scale and fail it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

TOL = 1e-4
HEADS, DIM = 64, 128  # GLM-5.3-Flash: linear_num_heads, linear_head_dim


@pytest.fixture(autouse=True)
def _float32_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference's matmuls in IEEE float32: TF32 would round them to ~1e-3."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _inputs(T: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, g, beta)`` bf16 as the layer makes them (unit ``q``, ``k``; ``g`` in ``(-5, 0)``) and a
    float32 entering state."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    q = F.normalize(draw(T, HEADS, DIM), dim=-1) * DIM**-0.5
    k = F.normalize(draw(T, HEADS, DIM), dim=-1)
    v, g = draw(T, HEADS, DIM), -5.0 * torch.sigmoid(draw(T, HEADS, DIM) - 2.0)
    beta = torch.sigmoid(draw(T, HEADS))
    return tuple(t.bfloat16() for t in (q, k, v, g, beta)) + (draw(HEADS, DIM, DIM),)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max())
    assert err <= TOL * scale, (err, scale)


@pytest.mark.parametrize("T", [1, 3001, 4096])
def test_kda_kernel_at_flash_shape(T: int) -> None:
    from reference_impl.families.glm53.kernels.kda_triton import kda_chunked_triton
    from reference_impl.families.glm53.model.kda import kda_chunked

    args = _inputs(T, seed=T)
    out, final = kda_chunked_triton(*args)
    want_out, want_final = kda_chunked(*args)
    _close(out, want_out)
    _close(final, want_final)
    scale = max(1.0, float(want_final.abs().max()))
    assert float((want_final.bfloat16().float() - want_final).abs().max()) > TOL * scale


def test_span_map_at_flash_shape() -> None:
    from reference_impl.families.glm53.kernels.kda_triton import span_map_triton
    from reference_impl.families.glm53.model.kda import compose, kda_chunked, span_map

    q, k, v, g, beta, state = _inputs(3001, seed=1)
    A, B = span_map_triton(k, v, g, beta)
    want_A, want_B = span_map(k, v, g, beta)
    _close(A, want_A)
    _close(B, want_B)
    _close(compose(state, A, B), kda_chunked(q, k, v, g, beta, state)[1])


def test_dispatch_runs_the_kernel_on_cuda() -> None:
    from reference_impl.families.glm53.kernels import dispatch
    from reference_impl.families.glm53.model.kda import kda_chunked
    from reference_impl.kernels import fallback

    args = _inputs(700, seed=2)
    assert dispatch.kda_kernel_name(args[0].device) == "triton"
    for got, want in zip(dispatch.kda_chunked(*args), kda_chunked(*args)):
        _close(got, want)
    assert "Triton GLM-5.3 KDA" not in fallback.fallbacks_taken()


def test_model_with_kernels_matches_the_torch_model() -> None:
    """tiny-glm53 in float32 on CUDA: the oracle through the kernel table against the torch table, over
    a prefix and two chunks (the KDA state handed from span to span through the kernels)."""
    from reference_impl.families.glm53.config import PRESETS
    from reference_impl.families.glm53.family import FAMILY
    from reference_impl.families.glm53.model.oracle import run_glm53_oracle

    cfg, dev = PRESETS["tiny-glm53"], torch.device("cuda")
    kernel_model = FAMILY.build_model(cfg, torch.float32, 0, dev, kernels=True)
    torch_model = FAMILY.build_model(cfg, torch.float32, 0, dev, kernels=False)
    x = torch.randn(300, cfg.dim, generator=torch.Generator(device="cuda").manual_seed(4), device="cuda")
    got = run_glm53_oracle(kernel_model, [100], [x], torch.float32, chunk_size=130)
    want = run_glm53_oracle(torch_model, [100], [x], torch.float32, chunk_size=130)
    _close(got.hidden[0], want.hidden[0])


def test_tokens_per_second_is_measured() -> None:
    """The bench entry returns a rate (a measurement, no threshold)."""
    from reference_impl.families.glm53.bench import kda_tokens_per_second

    rate = kda_tokens_per_second(4096, HEADS, DIM, device="cuda")
    assert math.isfinite(rate) and rate > 0

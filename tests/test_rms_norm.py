"""The RMSNorm kernel under the CPU interpreter, against the torch reference, and its dispatch.

The kernel's sum runs in another order than torch's, so results agree to float32 rounding (and,
in bf16, to one bf16 step); the GPU tier checks the hardware path (``tests/gpu/test_gpu_glue_kernels.py``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from reference_impl.kernels import dispatch, fallback
from reference_impl.kernels.rms_norm_triton import rms_norm_triton
from reference_impl.model import norm
from reference_impl.model.oracle import DSAModel
from reference_impl.presets import get_preset


def _case(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, magnitude: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = (torch.randn(*shape, generator=gen) * magnitude).to(dtype)
    weight = 1.0 + 0.1 * torch.randn(shape[-1], generator=gen)
    return x, weight


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Float32 to a few ulps; bf16 to one bf16 step (the sum order moves the last float32 bits)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    step = 2.0**-7 if want.dtype == torch.bfloat16 else 2.0**-21
    assert ((got.float() - want.float()).abs() <= step * want.float().abs() + 1e-30).all()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 9),
    width=st.sampled_from([1, 7, 128, 512, 1536, 7168]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_kernel_matches_the_reference(
    rows: int, width: int, dtype: torch.dtype, magnitude: float, seed: int
) -> None:
    x, weight = _case(torch.Generator().manual_seed(seed), (rows, width), dtype, magnitude)
    _assert_close(rms_norm_triton(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))


def test_rms_norm_kernel_takes_any_leading_shape_and_zero_rows() -> None:
    x, weight = _case(torch.Generator().manual_seed(1), (3, 5, 96), torch.bfloat16, 2.0)
    x[1, 2] = 0  # an all-zero row: rsqrt(eps) times zero
    got = rms_norm_triton(x, weight, 1e-6)
    _assert_close(got, norm.rms_norm(x, weight, 1e-6))
    assert (got[1, 2] == 0).all()
    assert rms_norm_triton(x[:0], weight, 1e-6).shape == (0, 5, 96)


def test_rms_norm_kernel_names_what_it_cannot_run() -> None:
    x, weight = _case(torch.Generator().manual_seed(2), (2, 8), torch.float32, 1.0)
    with pytest.raises(ValueError, match="float16"):
        rms_norm_triton(x.half(), weight, 1e-6)
    with pytest.raises(ValueError, match=r"weight must be float32 \[8\]"):
        rms_norm_triton(x, weight[:4], 1e-6)


def test_the_dispatch_runs_the_kernel_where_kernels_run_and_falls_back_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from reference_impl.kernels import rms_norm_triton as module

    fallback.reset_fallbacks()
    x, weight = _case(torch.Generator().manual_seed(3), (4, 64), torch.bfloat16, 1.0)
    want = norm.rms_norm(x, weight, 1e-6)
    calls: list[int] = []
    real = module.rms_norm_triton
    monkeypatch.setattr(module, "rms_norm_triton", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert torch.equal(dispatch.rms_norm(x, weight, 1e-6), want) and calls == []  # CPU: the reference
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
    _assert_close(dispatch.rms_norm(x, weight, 1e-6), want)
    assert calls == [1]
    monkeypatch.setenv("DSACP_NO_FUSED_GLUE", "1")
    assert torch.equal(dispatch.rms_norm(x, weight, 1e-6), want) and calls == [1]
    monkeypatch.delenv("DSACP_NO_FUSED_GLUE")

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("no norm today")

    monkeypatch.setattr(module, "rms_norm_triton", boom)
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        for _ in range(2):
            assert torch.equal(dispatch.rms_norm(x, weight, 1e-6), want)
    assert [r.getMessage().split()[1] for r in caplog.records] == ["rms_norm"]
    fallback.reset_fallbacks()


def test_every_norm_of_a_kernel_model_goes_through_the_ops() -> None:
    model = DSAModel(get_preset("tiny"), torch.float32, ops=dispatch.KERNEL_OPS)
    norms = [m for m in model.modules() if type(m).__name__ == "RMSNorm"]
    assert len(norms) == 2 * 3 + 1  # attn_norm, q_norm, kv_norm per layer, and the final norm
    assert all(m.ops is dispatch.KERNEL_OPS for m in norms)

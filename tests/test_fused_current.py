"""Phase 7's current-rows fill under the CPU interpreter: the kernel writes the torch path's bytes, and its dispatch.

The torch path is phase 3's :func:`reference_impl.cp.current_reuse.fill_rows` (pack, dequantize,
scatter; quantize the indexer K, scatter). The GPU tier checks the hardware path
(``tests/gpu/test_gpu_fused_kernels.py``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import triton
import triton.language as tl
from conftest import as_bytes

from reference_impl.config import ConfigError
from reference_impl.cp import fused_ops
from reference_impl.cp.current_reuse import fill_rows
from reference_impl.kernels import fallback
from reference_impl.kernels.fused_current import fill_current_triton
from reference_impl.kernels.triton_helpers import e4m3_value
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import LocOutOfRangeError


def _case(
    gen: torch.Generator, layout: KVLayout, n_rows: int, n_view: int, dtype: torch.dtype, magnitude: float = 2.0
) -> tuple[torch.Tensor, ...]:
    kv = (torch.randn(n_rows, layout.kv_width, generator=gen) * magnitude).to(dtype)
    k = (torch.randn(n_rows, 128, generator=gen) * magnitude).to(dtype)
    kv[0, : layout.kv_lora // 2] = 0  # an all-zero quantization block: the amax floor's scale
    view_rows = torch.randperm(n_view, generator=gen)[:n_rows]
    return kv, k, view_rows


def _views(layout: KVLayout, n_view: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-view buffers whose unfilled rows keep recognizable values."""
    return (
        torch.full((n_view, layout.kv_width), 3.0, dtype=torch.bfloat16),
        torch.full((n_view, 128), 1.0).to(torch.float8_e4m3fn),
        torch.full((n_view,), -1.0),
    )


def _fill_both(
    layout: KVLayout, n_view: int, *args: torch.Tensor, **launch: object
) -> tuple[tuple[torch.Tensor, ...], ...]:
    want, got = _views(layout, n_view), _views(layout, n_view)
    fill_rows(*args, *want, layout)
    fill_current_triton(*args, *got, layout, **launch)  # type: ignore[arg-type]
    return got, want


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kv_dtype=st.sampled_from(["fp8", "bf16"]),
    scale_fmt=st.sampled_from(["ue8m0", "fp32"]),
    mla_scale_fmt=st.sampled_from(["ue8m0", "fp32"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    n_rows=st.integers(1, 40),
    magnitude=st.sampled_from([1e-3, 2.0, 500.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fill_current_kernel_writes_the_torch_paths_bytes(
    kv_dtype: str, scale_fmt: str, mla_scale_fmt: str, dtype: torch.dtype, n_rows: int, magnitude: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(128, 64, kv_dtype, 16, index_scale_fmt=scale_fmt, mla_scale_fmt=mla_scale_fmt)  # type: ignore[arg-type]
    n_view = n_rows + 9
    got, want = _fill_both(layout, n_view, *_case(gen, layout, n_rows, n_view, dtype, magnitude), block_m=8)
    for g, w in zip(got, want):
        assert torch.equal(as_bytes(g), as_bytes(w))


@pytest.mark.parametrize("mla_scale_fmt", ["ue8m0", "fp32"])
def test_fill_current_at_deepseek_widths_leaves_other_rows_alone(mla_scale_fmt: str) -> None:
    gen = torch.Generator().manual_seed(1)
    layout = KVLayout(512, 64, "fp8", 64, index_scale_fmt="ue8m0", mla_scale_fmt=mla_scale_fmt)
    kv, k, view_rows = _case(gen, layout, 21, 50, torch.bfloat16)
    got, want = _fill_both(layout, 50, kv, k, view_rows)
    for g, w in zip(got, want):
        assert torch.equal(as_bytes(g), as_bytes(w))
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[view_rows] = False
    assert (got[0][untouched] == 3.0).all() and (got[2][untouched] == -1.0).all()


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_fill_current_mla_only_for_a_shared_layer(kv_dtype: str) -> None:
    """IndexShare's shared layers have no indexer K: both paths fill the MLA rows alone, the same bytes."""
    gen = torch.Generator().manual_seed(2)
    layout = KVLayout(128, 64, kv_dtype, 16)  # type: ignore[arg-type]
    kv, _, view_rows = _case(gen, layout, 13, 20, torch.bfloat16)
    want, got = _views(layout, 20)[0], _views(layout, 20)[0]
    fill_rows(kv, None, view_rows, want, None, None, layout)
    fill_current_triton(kv, None, view_rows, got, None, None, layout, block_m=8)
    assert torch.equal(as_bytes(got), as_bytes(want))
    assert not (want[view_rows] == 3.0).all()  # the rows were written
    with pytest.raises(ConfigError, match="together"):
        fill_current_triton(kv, None, view_rows, got, torch.zeros(20, 128).to(torch.float8_e4m3fn), None, layout)


@triton.jit
def _decode_kernel(codes_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, e4m3_value(tl.load(codes_ptr + offs)))


def test_the_software_e4m3_decode_is_exact_for_every_finite_code() -> None:
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # all but the NaNs
    codes = torch.cat([codes, codes[:2]])  # 256 entries
    out = torch.empty(256)
    _decode_kernel[(1,)](codes, out, BLOCK=256)
    assert torch.equal(out.view(torch.int32), codes.view(torch.float8_e4m3fn).float().view(torch.int32))  # -0.0 too


def test_fill_current_names_bad_input_on_both_paths_without_falling_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    layout = KVLayout(128, 64, "fp8", 16)
    kv, k, i8, sc = (
        torch.zeros(4, 192),
        torch.zeros(4, 128),
        torch.zeros(8, 128).to(torch.float8_e4m3fn),
        torch.zeros(8),
    )
    view, rows = torch.zeros(8, 192, dtype=torch.bfloat16), torch.arange(4)
    bad = {
        "one row per view row": (kv[:3], k, rows, view, i8, sc),
        "bf16 kv": (kv, k, rows, torch.zeros(8, 192), i8, sc),
        "int64": (kv, k, rows.int(), view, i8, sc),
        "float32 scales": (kv, k, rows, view, i8, sc[:5]),
    }
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # the dispatch would take the kernel
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        for match, args in bad.items():
            with pytest.raises(ConfigError, match=match):
                fill_current_triton(*args, layout)
            with pytest.raises(ConfigError, match=match):
                fused_ops.fill_current_rows(*args, layout)
    assert not caplog.records and not fallback.fallbacks_taken()


# ---- dispatch ------------------------------------------------------------------------------------


@pytest.fixture
def fresh_warnings() -> None:
    fallback.reset_fallbacks()
    yield
    fallback.reset_fallbacks()


def test_dispatch_runs_the_kernel_falls_back_once_and_checks_rows_in_debug(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    gen = torch.Generator().manual_seed(2)
    layout = KVLayout(128, 64, "fp8", 16)
    args = _case(gen, layout, 12, 20, torch.bfloat16)
    want = _views(layout, 20)
    fill_rows(*args, *want, layout)

    calls: list[int] = []
    real = fused_ops._triton_fill_current
    monkeypatch.setattr(fused_ops, "_triton_fill_current", lambda *a: (calls.append(1), real(*a))[1])

    def run(**kw: object) -> tuple[torch.Tensor, ...]:
        views = _views(layout, 20)
        fused_ops.fill_current_rows(*args, *views, layout, **kw)  # type: ignore[arg-type]
        return views

    assert all(torch.equal(as_bytes(g), as_bytes(w)) for g, w in zip(run(), want)) and calls == []  # CPU: torch
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
    assert all(torch.equal(as_bytes(g), as_bytes(w)) for g, w in zip(run(), want)) and calls == [1]

    def boom(*a: object) -> None:
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(fused_ops, "_triton_fill_current", boom)
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        for _ in range(2):
            assert all(torch.equal(as_bytes(g), as_bytes(w)) for g, w in zip(run(), want))
    assert [r.getMessage().split()[1] for r in caplog.records] == ["fill_current"]

    bad = (args[0], args[1], args[2].clone())
    bad[2][0] = 20
    with pytest.raises(LocOutOfRangeError):
        fused_ops.fill_current_rows(*bad, *_views(layout, 20), layout, debug=True)

"""The query-preparation kernels (indexer query, MLA query RoPE) under the CPU interpreter, and their dispatch.

Under the interpreter the kernels take their exact rounding paths. RoPE is elementwise (two rounded
products and a rounded sum, no FMA), so it equals the torch reference of
:mod:`reference_impl.model.query_prep` bit for bit on any machine. The indexer query's Hadamard
rotation is a 128-term float32 sum per value, which the kernel (``tl.dot``: numpy under the
interpreter) and the reference (a torch GEMM: MKL, OpenBLAS, ...) add in orders that depend on the
machine; its results are compared within the bounds of :func:`_assert_query_within_bounds`. The GPU tier
checks the hardware path (``tests/gpu/test_gpu_glue_kernels.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from reference_impl.fp8 import hadamard_matrix
from reference_impl.kernels import dispatch, fallback
from reference_impl.kernels.query_prep_triton import indexer_query_triton, rope_into_triton
from reference_impl.model import query_prep as ref
from reference_impl.model.attention import DSAAttention
from reference_impl.model.oracle import init_weights
from reference_impl.model.rope import rope_cos_sin, rope_frequencies
from reference_impl.model.sparse_attention import TORCH_OPS
from reference_impl.presets import get_preset

V32 = get_preset("deepseek-v3.2")


def _tables(n_tokens: int, rope_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 160_000, (n_tokens,), generator=gen)
    freqs = rope_frequencies(dataclasses.replace(V32, qk_rope_head_dim=rope_dim))  # YaRN-corrected, [rope_dim / 2]
    return rope_cos_sin(freqs, positions)


def _query_case(
    gen: torch.Generator, n_tokens: int, n_heads: int, dtype: torch.dtype, magnitude: float = 3.0
) -> tuple[torch.Tensor, ...]:
    q = (torch.randn(n_tokens, n_heads, 128, generator=gen) * magnitude).to(dtype)
    cos, sin = _tables(n_tokens, 64, gen)
    return q, cos, sin, hadamard_matrix(128), torch.randn(n_tokens, n_heads, generator=gen)


def _assert_same_query(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The same computation on both sides (the reference twice): bit for bit."""
    assert got[0].dtype == torch.float8_e4m3fn and got[0].shape == want[0].shape
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


FP32_UNIT_ROUNDOFF = 2.0**-24


def _gamma(n: int) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: a float32 sum of ``n + 1`` terms, added in ANY order, is
    within ``gamma_n * sum |x_i|`` of the exact sum (Higham, *Accuracy and Stability of Numerical
    Algorithms*, chapter 4)."""
    return n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)


ROTATION_BOUND = 2 * _gamma(127) * math.sqrt(128) + 4 * FP32_UNIT_ROUNDOFF
"""How far the kernel's and the reference's float32 rotated value ``y_j = (H x)_j / sqrt(128)`` can be
apart, relative to the row's ``amax = max_j |y_j|`` (1.7e-4). Each side's sum errs by at most
``gamma_127 * sum_i |x_i|`` (the products by +-1 are exact) <= ``gamma_127 * sqrt(128) * ||x||_2``
(Cauchy-Schwarz), and ``H / sqrt(128)`` is orthogonal, so after the scaling that is
``gamma_127 * ||y||_2 <= gamma_127 * sqrt(128) * amax``; twice that for two sides, plus each side's
rounded product by ``1 / sqrt(128)`` (``u |y_j|``) and slack for ``amax`` being the computed one."""

ROUNDING_TO_DTYPE = {torch.float32: 0.0, torch.bfloat16: 2.0**-7}
"""After the rotation each side rounds to the input dtype: two values a float32 bit apart can round to
neighbouring bf16 values, one bf16 step, at most ``2^-7`` of the value (8 significant bits)."""


def _e4m3_half_step(q: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at the value ``q`` (float64): the most FP8 rounding moved the value to
    ``q``. Normal binades ``[2^e, 2^(e+1))``, ``e >= -6``, are spaced ``2^(e-3)``; below, ``2^-9``."""
    exponent = torch.frexp(q.abs())[1].to(torch.float64) - 1  # floor(log2 |q|); 0 gives -1, clamped below
    return torch.exp2(exponent.clamp(min=-6) - 4)


def _assert_query_within_bounds(
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    scale_fmt: str,
    equal_fraction: float = 0.99,
) -> None:
    """The kernel's indexer query (``got``) against the reference's (``want``), whose Hadamard sums
    ran in other orders (see the module docstring). Three checks, each able to fail on its own:

    * **most bits equal**: at least ``equal_fraction`` of the FP8 codes (and of the head weights,
      except for float32 input with float32 scales, where ``amax``'s last bit reaches every weight)
      are bit-equal: a flip needs a value within the order difference of a rounding boundary;
    * **weights**: ``weight = head_weight * Hi^-0.5 * (amax / 448) * D^-0.5``, so the weights' ratio is
      the scales' ratio. float32 scales: within ``ROTATION_BOUND`` + the dtype rounding of ``amax`` + the
      six roundings of the division and two products. ue8m0 scales (powers of two): equal, or one
      power of two apart where ``amax / 448`` sits on the power of two (a near tie): then the side
      with the smaller scale has a code of 448 and the other's largest code is 224;
    * **codes**: dequantized in units of the reference's scale, each value within ``448 * ROTATION_BOUND``
      (the rotated values' difference over the scale, ``amax / scale <= 448``), the dtype rounding, the
      scales' difference, and both FP8 roundings (half a step each). Where ``|code| >= 1`` that allows
      one FP8 step and never two.
    """
    got_q, got_w = got
    want_q, want_w = want
    assert got_q.dtype == torch.float8_e4m3fn and got_q.shape == want_q.shape and got_w.shape == want_w.shape
    n_rows = want_w.numel()
    got_bytes, want_bytes = got_q.view(torch.uint8).reshape(n_rows, -1), want_q.view(torch.uint8).reshape(n_rows, -1)
    allowed_codes = max(1, int((1 - equal_fraction) * got_bytes.numel()))
    codes_differ = int((got_bytes != want_bytes).sum())
    assert codes_differ <= allowed_codes, f"{codes_differ} FP8 codes differ (at most {allowed_codes})"
    weights_differ = int((got_w != want_w).sum())
    if not (dtype == torch.float32 and scale_fmt == "fp32"):
        allowed_weights = max(1, int((1 - equal_fraction) * n_rows))
        assert weights_differ <= allowed_weights, f"{weights_differ} head weights differ (at most {allowed_weights})"

    gw, ww = got_w.reshape(-1).double(), want_w.reshape(-1).double()
    assert bool(((ww == 0) == (gw == 0)).all()), "a zero weight on one side only"
    ratio = torch.where(ww == 0, torch.ones_like(ww), gw / torch.where(ww == 0, torch.ones_like(ww), ww))
    gq, wq = got_q.float().double().reshape(n_rows, -1), want_q.float().double().reshape(n_rows, -1)
    amax_bound = ROTATION_BOUND + ROUNDING_TO_DTYPE[dtype]
    if scale_fmt == "fp32":
        scales_bound = amax_bound + 8 * FP32_UNIT_ROUNDOFF
        worst = float((ratio - 1).abs().max())
        assert worst <= scales_bound, f"head weights differ by {worst:.3g} relative (bound {scales_bound:.3g})"
    else:
        moved = (ratio - 1).abs() > 8 * FP32_UNIT_ROUNDOFF
        for row in moved.nonzero().flatten().tolist():
            up = float(ratio[row]) > 1  # the kernel's scale is the larger one
            want_ratio = 2.0 if up else 0.5
            off = abs(float(ratio[row]) - want_ratio)
            assert off <= 8 * FP32_UNIT_ROUNDOFF, f"row {row}: scale ratio {float(ratio[row])}"
            small, large = (wq[row], gq[row]) if up else (gq[row], wq[row])
            near_tie = float(small.abs().max()) == 448 and float(large.abs().max()) == 224
            assert near_tie, f"row {row}: a scale moved off a near tie"
        scales_bound = 8 * FP32_UNIT_ROUNDOFF

    r = ratio[:, None]
    magnitude = torch.maximum(gq.abs() * r, wq.abs()) * (1 + 2.0**-4)  # >= |y / scale| on both sides
    allowed = (
        448 * ROTATION_BOUND * (1 + 1e-3)
        + (ROUNDING_TO_DTYPE[dtype] + scales_bound) * magnitude
        + _e4m3_half_step(gq) * r
        + _e4m3_half_step(wq)
        + 448 * 4 * FP32_UNIT_ROUNDOFF  # the clamp to +-448 after a rounded division
    )
    excess = (gq * r - wq).abs() - allowed
    assert float(excess.max()) <= 0, f"an FP8 code is {float(excess.max()):.3g} (scale units) beyond its bound"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_indexer_query_kernel_equals_the_reference(dtype: torch.dtype, interleaved: bool, scale_fmt: str) -> None:
    gen = torch.Generator().manual_seed(1)
    q, cos, sin, h, w = _query_case(gen, 37, 8, dtype)  # 296 rows: four programs, the last one partial
    q[3, 2] = 0  # an all-zero head: the amax floor gives its scale
    q[5, 1, :64] = 0  # zero rope part
    want = ref.indexer_query(q, cos, sin, h, w, 64, interleaved, scale_fmt)
    got = indexer_query_triton(q, cos, sin, h, w, 64, interleaved, scale_fmt)
    _assert_query_within_bounds(got, want, dtype, scale_fmt)


def _moved_codes(q_fp8: torch.Tensor, at: torch.Tensor, steps: int) -> torch.Tensor:
    """``q_fp8`` with the codes at flat positions ``at`` moved ``steps`` e4m3 steps away from zero."""
    codes = q_fp8.view(torch.uint8).clone().reshape(-1)
    codes[at] += steps  # sign-magnitude: +1 on the magnitude bits is the next e4m3 value out
    return codes.view(q_fp8.shape).view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "dtype,scale_fmt", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"), (torch.bfloat16, "ue8m0")]
)
def test_the_query_bounds_catch_wrong_values(dtype: torch.dtype, scale_fmt: str) -> None:
    """The bounds let a rounding difference through and nothing bigger: one code one step away passes;
    a code two steps away, 2% of the codes one step away, a weight off by 2% (float32: 0.1%), or a ue8m0
    scale doubled away from a near tie each fail."""
    gen = torch.Generator().manual_seed(1)
    q, cos, sin, h, w = _query_case(gen, 37, 8, dtype)
    want_q, want_w = ref.indexer_query(q, cos, sin, h, w, 64, False, scale_fmt)
    codes = want_q.view(torch.uint8).reshape(-1)
    large = ((codes & 0x7F) >= 0x50) & ((codes & 0x7F) <= 0x70)  # |code| in [32, 256]: a step is >= 4
    first = int(large.nonzero()[0])
    one_step = _moved_codes(want_q, torch.tensor([first]), 1)
    _assert_query_within_bounds((one_step, want_w), (want_q, want_w), dtype, scale_fmt)
    wrong: list[tuple[torch.Tensor, torch.Tensor]] = [
        (_moved_codes(want_q, torch.tensor([first]), 2), want_w),
        (_moved_codes(want_q, large.nonzero().flatten()[: codes.numel() // 50], 1), want_w),
    ]
    off = want_w.clone()
    off[4, 3] *= 1.001 if dtype == torch.float32 else 1.02
    wrong.append((want_q, off))
    if scale_fmt == "ue8m0":
        row_max = want_q.float().abs().amax(-1)
        token, head = (row_max < 448).nonzero()[0].tolist()
        doubled = want_w.clone()
        doubled[token, head] *= 2
        wrong.append((want_q, doubled))
    for case in wrong:
        with pytest.raises(AssertionError):
            _assert_query_within_bounds(case, (want_q, want_w), dtype, scale_fmt)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_tokens=st.integers(1, 9),
    n_heads=st.sampled_from([1, 3, 16]),
    rope_dim=st.sampled_from([2, 32, 64, 128]),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_indexer_query_kernel_equals_the_reference_on_any_shape(
    n_tokens: int, n_heads: int, rope_dim: int, magnitude: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    q, _, _, h, w = _query_case(gen, n_tokens, n_heads, torch.bfloat16, magnitude)
    cos, sin = _tables(n_tokens, rope_dim, gen)
    want = ref.indexer_query(q, cos, sin, h, w, rope_dim, False, "ue8m0")
    got = indexer_query_triton(q, cos, sin, h, w, rope_dim, False, "ue8m0", block_m=16)
    _assert_query_within_bounds(got, want, torch.bfloat16, "ue8m0")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_into_writes_the_references_bits_into_a_strided_view(dtype: torch.dtype, interleaved: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(21, 5, 192, generator=gen).to(dtype)  # [T, H, nope + rope], as wq_b's output
    cos, sin = _tables(21, 64, gen)
    want = torch.full((21, 5, 576), 7.0, dtype=dtype)
    got = want.clone()
    ref.rope_into(want[..., 512:], q[..., 128:], cos, sin, interleaved)
    rope_into_triton(got[..., 512:], q[..., 128:], cos, sin, interleaved, block_m=16)
    assert torch.equal(got, want)  # the latent columns untouched, the rope columns equal bit for bit
    assert not torch.equal(want[..., 512:], q[..., 128:])


def test_the_kernels_name_inputs_they_cannot_take() -> None:
    gen = torch.Generator().manual_seed(3)
    q, cos, sin, h, w = _query_case(gen, 4, 2, torch.bfloat16)
    with pytest.raises(ValueError, match="index head dim 256"):
        indexer_query_triton(
            torch.zeros(4, 2, 256, dtype=torch.bfloat16), cos, sin, hadamard_matrix(256), w, 64, False, "fp32"
        )
    with pytest.raises(ValueError, match="float16"):
        indexer_query_triton(q.half(), cos, sin, h, w, 64, False, "fp32")
    with pytest.raises(ValueError, match="rope_dim 63"):
        indexer_query_triton(q, cos, sin, h, w, 63, False, "fp32")
    with pytest.raises(ValueError, match="scale_fmt 'e5m2'"):
        indexer_query_triton(q, cos, sin, h, w, 64, False, "e5m2")
    with pytest.raises(ValueError, match=r"cos must be float32 \(4, 32\)"):
        indexer_query_triton(q, cos[:3], sin, h, w, 64, False, "fp32")
    with pytest.raises(ValueError, match="head_weights"):
        indexer_query_triton(q, cos, sin, h, w[:, :1], 64, False, "fp32")
    with pytest.raises(ValueError, match="one shape"):
        rope_into_triton(torch.zeros(4, 2, 32), torch.zeros(4, 2, 64), cos, sin, True)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        rope_into_triton(torch.zeros(4, 64, 2).transpose(1, 2), torch.zeros(4, 2, 64), cos, sin, True)


# ---- dispatch ------------------------------------------------------------------------------------


@pytest.fixture
def fresh_warnings() -> None:
    fallback.reset_fallbacks()
    yield
    fallback.reset_fallbacks()


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    from reference_impl.kernels import query_prep_triton

    calls: list[int] = []
    real = getattr(query_prep_triton, name)

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(query_prep_triton, name, spy)
    return calls


def test_the_dispatch_runs_the_kernels_where_kernels_run_and_the_references_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(4)
    q, cos, sin, h, w = _query_case(gen, 5, 4, torch.bfloat16)
    want = ref.indexer_query(q, cos, sin, h, w, 64, False, "ue8m0")
    query_calls, rope_calls = _spy(monkeypatch, "indexer_query_triton"), _spy(monkeypatch, "rope_into_triton")
    out = torch.zeros(5, 4, 64, dtype=torch.bfloat16)

    _assert_same_query(dispatch.indexer_query(q, cos, sin, h, w, 64, False, "ue8m0"), want)  # CPU: the reference
    dispatch.rope_into(out, q[..., 64:], cos, sin, True)
    assert (query_calls, rope_calls) == ([], [])

    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA: the kernel
    _assert_query_within_bounds(dispatch.indexer_query(q, cos, sin, h, w, 64, False, "ue8m0"), want, q.dtype, "ue8m0")
    dispatch.rope_into(out, q[..., 64:], cos, sin, True)
    assert (query_calls, rope_calls) == ([1], [1])

    # Inputs the kernel does not take go to the reference, without a warning.
    q256 = torch.randn(5, 4, 256, generator=gen).to(torch.bfloat16)
    got = dispatch.indexer_query(q256, cos, sin, hadamard_matrix(256), w, 64, False, "ue8m0")
    _assert_same_query(got, ref.indexer_query(q256, cos, sin, hadamard_matrix(256), w, 64, False, "ue8m0"))
    assert query_calls == [1] and not fallback.fallbacks_taken()

    # DSACP_NO_FUSED_GLUE=1 and force_torch take the references.
    monkeypatch.setenv("DSACP_NO_FUSED_GLUE", "1")
    dispatch.indexer_query(q, cos, sin, h, w, 64, False, "ue8m0")
    dispatch.rope_into(out, q[..., 64:], cos, sin, True)
    monkeypatch.delenv("DSACP_NO_FUSED_GLUE")
    dispatch.indexer_query(q, cos, sin, h, w, 64, False, "ue8m0", force_torch=True)
    assert (query_calls, rope_calls) == ([1], [1])


def test_a_failing_kernel_falls_back_to_the_reference_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    from reference_impl.kernels import query_prep_triton

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)
    monkeypatch.setattr(query_prep_triton, "indexer_query_triton", boom)
    monkeypatch.setattr(query_prep_triton, "rope_into_triton", boom)
    gen = torch.Generator().manual_seed(5)
    q, cos, sin, h, w = _query_case(gen, 3, 2, torch.bfloat16)
    want = ref.indexer_query(q, cos, sin, h, w, 64, True, "fp32")
    out, want_rope = torch.zeros(3, 2, 64), torch.zeros(3, 2, 64)
    ref.rope_into(want_rope, q[..., :64].float(), cos, sin, False)
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        for _ in range(2):
            _assert_same_query(dispatch.indexer_query(q, cos, sin, h, w, 64, True, "fp32"), want)
            dispatch.rope_into(out, q[..., :64].float(), cos, sin, False)
            assert torch.equal(out, want_rope)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("no kernel today" in m for m in warnings)
    assert set(fallback.fallbacks_taken()) == {"Triton indexer_query", "Triton rope_into"}


@pytest.mark.parametrize("preset", ["tiny", "glm-5"])
@torch.no_grad()
def test_a_layer_projects_the_same_bits_with_the_kernels(monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    """The model's ``project`` through the query kernels (interpreted) equals the torch ops' bit for bit,
    but for the indexer query's codes and weights, whose Hadamard sums run in another order (within
    :func:`_assert_query_within_bounds`). RMSNorm stays on torch here: its kernel sums in another order
    too (``tests/test_rms_norm.py``)."""
    cfg = get_preset(preset)
    if preset == "glm-5":  # its widths, fewer of them: the interleaved indexer RoPE at 32 heads
        cfg = dataclasses.replace(cfg, dim=256, q_lora_rank=96, n_heads=4)
    torch.manual_seed(0)
    layer = init_weights(DSAAttention(cfg, torch.bfloat16), seed=0)  # type: ignore[arg-type]
    x = torch.randn(20, cfg.dim).to(torch.bfloat16)
    positions = torch.arange(100, 120)
    want = layer.project(x, positions)
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)
    query_calls, rope_calls = _spy(monkeypatch, "indexer_query_triton"), _spy(monkeypatch, "rope_into_triton")
    kernel_layer = DSAAttention(
        cfg, torch.bfloat16, ops=dataclasses.replace(dispatch.KERNEL_OPS, rms_norm=TORCH_OPS.rms_norm)
    )
    kernel_layer.load_state_dict(layer.state_dict())
    got = kernel_layer.project(x, positions)
    assert (query_calls, rope_calls) == ([1], [1])
    for name in ("q", "kv", "index_k"):  # torch's ops on both sides, and RoPE's elementwise kernel
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    got_query, want_query = (got.index_q_fp8, got.index_weights), (want.index_q_fp8, want.index_weights)
    _assert_query_within_bounds(got_query, want_query, torch.bfloat16, cfg.index_scale_fmt)
    assert layer.ops is TORCH_OPS


def test_the_glue_bench_runs_dry_on_cpu(tmp_path: Path) -> None:
    """``bench.glue``'s script logic at toy sizes under the interpreter: every op, checked and timed."""
    from reference_impl.bench import glue

    out = tmp_path / "glue.json"
    assert glue.main(["--device", "cpu", "--tokens", "4", "--cp-size", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == [
        "indexer_query",
        "rope_into",
        "rms_norm_7168",
        "rms_norm_1536",
        "rms_norm_512",
        "fill_current",
    ]
    # The indexer query's Hadamard sums run in another order in the kernel than in the reference's GEMM
    # (``_assert_query_within_bounds``): a code or a head's scale at a rounding tie may move. RoPE and
    # the cache fill are elementwise: bit for bit.
    assert rows[0]["codes_equal"] >= 0.99 and rows[0]["weights_equal"] >= 0.99, rows[0]
    assert rows[1]["bit_equal"] and rows[-1]["bytes_equal"]
    assert all(r["kernel_ms"] > 0 and r["bytes"] > 0 for r in rows)

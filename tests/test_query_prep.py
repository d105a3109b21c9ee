"""The query-preparation kernels (indexer query, MLA query RoPE) under the CPU interpreter, and their dispatch.

Under the interpreter the kernels take their exact rounding paths, so they must equal the torch
references of :mod:`reference_impl.model.query_prep` bit for bit; the GPU tier checks the hardware
path (``tests/gpu/test_gpu_glue_kernels.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
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
    assert got[0].dtype == torch.float8_e4m3fn and got[0].shape == want[0].shape
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_indexer_query_kernel_equals_the_reference(dtype: torch.dtype, interleaved: bool, scale_fmt: str) -> None:
    gen = torch.Generator().manual_seed(1)
    q, cos, sin, h, w = _query_case(gen, 37, 8, dtype)  # 296 rows: four programs, the last one partial
    q[3, 2] = 0  # an all-zero head: the amax floor gives its scale
    q[5, 1, :64] = 0  # zero rope part
    want = ref.indexer_query(q, cos, sin, h, w, 64, interleaved, scale_fmt)
    _assert_same_query(indexer_query_triton(q, cos, sin, h, w, 64, interleaved, scale_fmt), want)


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
    _assert_same_query(indexer_query_triton(q, cos, sin, h, w, rope_dim, False, "ue8m0", block_m=16), want)


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
        indexer_query_triton(torch.zeros(4, 2, 256, dtype=torch.bfloat16), cos, sin, hadamard_matrix(256), w, 64, False, "fp32")
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

    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
    _assert_same_query(dispatch.indexer_query(q, cos, sin, h, w, 64, False, "ue8m0"), want)
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
    """The model's ``project`` through the query kernels (interpreted) equals the torch ops' bit for bit
    (RMSNorm stays on torch here: its kernel sums in another order, ``tests/test_rms_norm.py``)."""
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
    kernel_layer = DSAAttention(cfg, torch.bfloat16, ops=dataclasses.replace(dispatch.KERNEL_OPS, rms_norm=TORCH_OPS.rms_norm))
    kernel_layer.load_state_dict(layer.state_dict())
    got = kernel_layer.project(x, positions)
    assert (query_calls, rope_calls) == ([1], [1])
    for name in ("q", "kv", "index_weights", "index_k"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.index_q_fp8.view(torch.uint8), want.index_q_fp8.view(torch.uint8))
    assert layer.ops is TORCH_OPS



def test_the_glue_bench_runs_dry_on_cpu(tmp_path: Path) -> None:
    """``bench.glue``'s script logic at toy sizes under the interpreter: every op, checked and timed."""
    from reference_impl.bench import glue

    out = tmp_path / "glue.json"
    assert glue.main(["--device", "cpu", "--tokens", "4", "--cp-size", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["indexer_query", "rope_into", "rms_norm_7168", "rms_norm_1536", "rms_norm_512", "fill_current"]
    assert rows[0]["codes_equal"] == 1.0 and rows[1]["bit_equal"] and rows[-1]["bytes_equal"]
    assert all(r["kernel_ms"] > 0 and r["bytes"] > 0 for r in rows)

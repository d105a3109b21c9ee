"""FP8 projections with 128-block scales (opt-in): the math, the Triton GEMM under the interpreter,
the error against bf16, and a CP run that agrees with its oracle with the knob on."""

from __future__ import annotations

import pytest
import torch

from reference_impl.fp8 import act_quant
from reference_impl.model.fp8_linear import (
    PROJECTIONS,
    Fp8BlockLinear,
    dequantize_weight,
    emulated_block_fp8_gemm,
    quantize_projections,
    quantize_weight,
)

# Measured below at DeepSeek-V3.2's wq_a shape (7168 -> 1536), unit-variance inputs, N(0, 1/K) weights:
# FP8 e4m3 keeps 3 mantissa bits, so one operand is off by up to 2^-4 per element; summed over
# 7,168 products the errors average to about 3.7% of the output's norm (bf16 rounding of the output: 0.17%).
FP8_REL_ERR_BOUND = 0.05


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_weight_blocks_round_trip_and_pad_to_whole_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(576, 256, generator=gen)  # 576 rows: 4.5 blocks, padded to 640
    w[:128, :128] *= 100  # one block of large weights: its own scale
    w_fp8, scale = quantize_weight(w)
    assert w_fp8.shape == (640, 256) and scale.shape == (5, 2)
    back = dequantize_weight(w_fp8, scale)
    assert (back[576:] == 0).all()
    assert _rel(back[:576], w) < 0.03
    assert float(scale[0, 0]) > 50 * float(scale[1, 1])
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_weight(torch.randn(128, 96))


def test_the_error_against_bf16_at_deepseek_widths() -> None:
    """The FP8 projection against the float32 product of the same bf16 weights and inputs."""
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(7168, 1536, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1536, 7168, generator=gen) / 7168**0.5)
    x = torch.randn(64, 7168, generator=gen).to(torch.bfloat16)
    want = x.float() @ linear.weight.detach().float().t()
    for scale_fmt in ("fp32", "ue8m0"):
        with torch.no_grad():
            err = _rel(Fp8BlockLinear(linear, scale_fmt)(x), want)
        assert 0.005 < err < FP8_REL_ERR_BOUND, (scale_fmt, err)  # a real quantization error, bounded


triton = pytest.importorskip("triton")


@pytest.mark.parametrize(("m", "n", "k"), [(37, 256, 384), (5, 128, 128), (64, 384, 256)])
def test_triton_gemm_matches_the_emulation(m: int, n: int, k: int) -> None:
    """The Triton kernel (fp32 products under the interpreter) against the torch emulation: the
    same block scaling, to fp32 rounding; rows that are not a whole tile are masked."""
    from reference_impl.kernels.fp8_gemm import block_fp8_gemm_triton

    gen = torch.Generator().manual_seed(m)
    x_fp8, x_scale = act_quant(torch.randn(m, k, generator=gen) * 3, 128, "ue8m0")
    w_fp8, w_scale = quantize_weight(torch.randn(n, k, generator=gen))
    w_scale[0, -1] *= 4  # scales differ per block: a kernel that mixes them up fails
    want = emulated_block_fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.float32)
    got = block_fp8_gemm_triton(x_fp8, x_scale, w_fp8, w_scale, torch.float32)
    assert _rel(got, want) < 1e-5
    assert block_fp8_gemm_triton(x_fp8, x_scale, w_fp8, w_scale).dtype == torch.bfloat16


def test_the_dispatch_emulates_on_cpu_and_scaled_mm_refuses_cpu_tensors() -> None:
    from reference_impl.kernels.fp8_gemm import block_fp8_gemm, scaled_mm_block_fp8

    gen = torch.Generator().manual_seed(3)
    x_fp8, x_scale = act_quant(torch.randn(8, 256, generator=gen), 128)
    w_fp8, w_scale = quantize_weight(torch.randn(128, 256, generator=gen))
    assert torch.equal(
        block_fp8_gemm(x_fp8, x_scale, w_fp8, w_scale),
        emulated_block_fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.bfloat16),
    )
    with pytest.raises(RuntimeError, match="sm_90"):
        scaled_mm_block_fp8(x_fp8, x_scale, w_fp8, w_scale)
    with pytest.raises(ValueError, match="do not match"):
        block_fp8_gemm(x_fp8, x_scale[:, :1], w_fp8, w_scale)


def test_quantize_projections_replaces_the_attention_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3.2 widths: all six maps become FP8 (``wkv_b`` and ``weights_proj`` stay); the
    ``tiny`` preset keeps the two whose input (q_lora 96) is not whole blocks."""
    from reference_impl.model.attention import DSAAttention
    from reference_impl.presets import get_preset

    with torch.device("meta"):
        layer = DSAAttention(get_preset("deepseek-v3.2"), torch.bfloat16)
    monkeypatch.setattr(
        "reference_impl.model.fp8_linear.quantize_weight",
        lambda w: (
            torch.empty(-(-w.shape[0] // 128) * 128, w.shape[1], dtype=torch.float8_e4m3fn, device="meta"),
            torch.empty(-(-w.shape[0] // 128), w.shape[1] // 128, device="meta"),
        ),
    )
    assert quantize_projections(layer, "ue8m0") == len(PROJECTIONS) == 6
    assert isinstance(layer.wq_a, Fp8BlockLinear) and isinstance(layer.indexer.wk, Fp8BlockLinear)
    assert not isinstance(layer.wkv_b, Fp8BlockLinear) and not isinstance(layer.indexer.weights_proj, Fp8BlockLinear)


def test_a_cp_run_with_fp8_projections_agrees_with_its_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DSACP_FP8_PROJECTIONS=1``: ranks and oracle build the same FP8 model and agree; the
    outputs differ from the bf16 model's by the FP8 error, not more."""
    from conftest import tiny

    from reference_impl.config import Request
    from reference_impl.runner import run_prefill
    from reference_impl.workload import build_model

    run = tiny(cp_size=2, requests=(Request(0, 48), Request(20, 30)))
    monkeypatch.setenv("DSACP_FP8_PROJECTIONS", "1")
    model = build_model(run, torch.device("cpu"))
    assert sum(isinstance(m, Fp8BlockLinear) for m in model.modules()) == 4 * run.model.n_layers  # tiny: 4 of 6
    rep = run_prefill(run)
    assert rep["problems"] == [] and rep["matches_oracle"] is True and rep["cache_equal"] is True
    monkeypatch.setenv("DSACP_FP8_PROJECTIONS", "maybe")
    from reference_impl.errors import ConfigError

    with pytest.raises(ConfigError, match="DSACP_FP8_PROJECTIONS"):
        build_model(run, torch.device("cpu"))


def test_the_limits_bench_runs_dry_on_cpu(tmp_path) -> None:
    """``python -m reference_impl.bench.limits`` without its compute section: the logits variants
    agree bit for bit, the FP8 GEMM is checked against the emulation (cuBLAS's path refused on a
    CPU, recorded), and the layer ran for every variant."""
    import json

    from reference_impl.bench.limits import main

    out = tmp_path / "limits.json"
    assert main(["--out", str(out), "--device", "cpu", "--layers", "1", "--level-repeats", "1", "--skip-compute"]) == 0
    doc = json.loads(out.read_text())
    assert all(r["bitwise_equal_to_default"] for r in doc["logits_variants"]["rows"])
    assert {(r["num_warps"], r["block_pointers"]) for r in doc["logits_variants"]["rows"]} == {
        (4, False),
        (4, True),
        (8, False),
        (8, True),
    }
    toy = doc["fp8_projections"]["projections"]["toy"]
    assert toy["triton"]["rel_err_vs_emulation"] < 1e-5 and "sm_90" in toy["scaled_mm"]["error"]
    assert 0.01 < toy["fp8_rel_err_vs_bf16"] < FP8_REL_ERR_BOUND
    assert set(doc["layer_128k"]["variants"]) == {
        "default",
        "fp8_projections",
        "block_pointer_logits",
        "fp8_projections+block_pointer_logits",
    }
    assert all("layer_ms_median" in v for v in doc["layer_128k"]["variants"].values())


def test_the_logits_kernel_builds_for_sm90_without_spills_through_block_pointers(tmp_path) -> None:
    """Compiled for sm_90 on a CPU (a child process: this tier runs under the interpreter, whose
    kernels do not compile): loaded through block pointers, the default config spills nothing
    (``scripts/inspect_logits_kernel.py``; its per-element address tensors spill at 255 registers)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton as triton_module

    if not os.path.exists(os.path.join(os.path.dirname(triton_module.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton ships no CUDA backend tools")
    root = Path(__file__).resolve().parent.parent
    recorded = json.loads((root / "docs" / "results" / "logits_kernel_sm90.json").read_text())["triton"]
    if triton_module.__version__ != recorded:  # register allocation is the compiler's: the claim is about that version
        pytest.skip(
            f"the no-spill result is Triton {recorded}'s (docs/results/logits_kernel_sm90.json); this is "
            f"Triton {triton_module.__version__}, whose allocation differs "
            "(Triton 3.6 still spills with block pointers)"
        )
    out = tmp_path / "logits.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, str(root / "scripts" / "inspect_logits_kernel.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    default_warps = rows[0]["num_warps"]
    with_block_pointers = next(r for r in rows if r["block_pointers"] and r["num_warps"] == default_warps)
    assert with_block_pointers["spill_store_bytes"] == 0 and with_block_pointers["registers"] <= 255, (
        with_block_pointers
    )

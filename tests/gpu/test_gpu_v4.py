"""DeepSeek-V4 on CUDA at V4-Flash dimensions (GPU tier): the attention kernel against the torch
reference, and CP prefill against the V4 oracle with the compiled kernel.

``deepseek-v4-flash`` cut to its first four layers (sliding, sliding, CSA, HCA: every layer type),
two ranks sharing the GPU over gloo, bf16 compute: outputs agree within the rounding-tolerant rule
of :mod:`reference_impl.check`, CSA top-k sets up to boundary swaps, caches by value.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl.config import PhaseSet, Request, RunConfig

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_ranks]

FLASH = RunConfig(preset="deepseek-v4-flash", n_layers=4, cp_size=2, device="cuda",
                  requests=(Request(0, 2501), Request(301, 1203)), chunk_size=1001)


@pytest.fixture(scope="module")
def v4_reports() -> dict[str, dict]:
    from reference_impl.runner import run_prefills

    configs = {"level0": FLASH.replace(phases=PhaseSet.level(0)), "level8": FLASH.replace(phases=PhaseSet.level(8))}
    return dict(zip(configs, run_prefills(list(configs.values()), timeout_s=600)))


@pytest.mark.parametrize("name", ["level0", "level8"])
def test_v4_flash_ranks_match_the_oracle(v4_reports: dict[str, dict], name: str) -> None:
    rep = v4_reports[name]
    assert rep["matches_oracle"] is True, rep["problems"]
    assert rep["collectives_identical"] and rep["kernel_fallbacks"] == {}
    assert rep["attention_kernel"] == "v4-triton"


def test_v4_flash_level8_shards_and_never_syncs(v4_reports: dict[str, dict]) -> None:
    base, top = v4_reports["level0"]["per_rank"], v4_reports["level8"]["per_rank"]
    assert sum(r["csa_bytes"] for r in top) == base[0]["csa_bytes"]
    assert max(r["csa_bytes"] for r in top) < 0.75 * base[0]["csa_bytes"]
    assert all(r["host_syncs_in_layer_loop"] == 0 for r in top)


def test_v4_attention_kernel_at_flash_shape() -> None:
    """64 heads x 512, a 128-token window + 512 selected entries, and an HCA run of 1,000 entries."""
    from reference_impl.kernels.v4_attention_triton import v4_sparse_attention_triton
    from reference_impl.model.v4.sparse import sparse_attention_sinks

    g = torch.Generator(device="cuda").manual_seed(0)
    t, s = 256, 9000
    q = (torch.randn(t, 64, 512, device="cuda", generator=g) / 4).bfloat16()
    view = torch.randn(s, 512, device="cuda", generator=g).bfloat16()
    idx = torch.randint(-1, s, (t, 128 + 512), device="cuda", generator=g, dtype=torch.int32)
    sinks = torch.randn(64, device="cuda", generator=g)
    start = torch.randint(0, s - 1000, (t,), device="cuda", generator=g)
    length = torch.randint(0, 1001, (t,), device="cuda", generator=g)
    ref = sparse_attention_sinks(q, view, idx, sinks, 512**-0.5, start, length, 1000)
    out = v4_sparse_attention_triton(q, view, idx, sinks, 512**-0.5, start, length)
    err = (out - ref).abs().max().item()
    assert err <= 2e-2 * ref.abs().max().item(), err

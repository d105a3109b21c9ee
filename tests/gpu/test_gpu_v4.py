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

FLASH = RunConfig(
    preset="deepseek-v4-flash",
    n_layers=4,
    cp_size=2,
    device="cuda",
    requests=(Request(0, 2501), Request(301, 1203)),
    chunk_size=1001,
)


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


def test_v4_flash_on_an_evicting_pool_matches_the_oracle() -> None:
    """Four batches on a budget of 48 pages (phase 5's lanes included): r2 = r0:1031+300 hits, r4 = r1:1033+200
    misses (r1 was evicted) and recomputes its prefix; the compiled kernels agree with the oracle throughout."""
    from reference_impl.config import parse_batches
    from reference_impl.engine import replay_pool
    from reference_impl.runner import run_prefill

    requests, sizes = parse_batches("0+1500;0+1500;r0:1031+300,0+600;r1:1033+200")
    run = FLASH.replace(requests=tuple(requests), batch_sizes=sizes, chunk_size=None, pool_pages=48)
    run = run.replace(phases=PhaseSet.level(8))
    rep = run_prefill(run, timeout_s=600)
    assert rep["matches_oracle"] is True, rep["problems"]
    assert rep["prefix_cache"] == replay_pool(run).counts
    assert rep["prefix_cache"]["hits"] == 1 and rep["prefix_cache"]["misses"] == 1
    assert rep["prefix_cache"]["evicted_requests"] == 3


def test_v4_attention_kernel_at_flash_shape() -> None:
    """64 heads x 512, a 128-token window + 512 selected entries, and an HCA run of 1,000 entries."""
    from reference_impl.families.deepseek_v4.kernels.attention_triton import v4_sparse_attention_triton
    from reference_impl.families.deepseek_v4.model.sparse import sparse_attention_sinks

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


def test_v4_indexer_kernel_at_flash_shape() -> None:
    """64 heads x 128 FP4-simulated dims, 4,096 queries over 32,768 entries (a 128K context's CSA
    keys), top-512 with the causal entry rule, in one key tile and streamed in four: every row selects
    ``min(512, visible)`` distinct visible entries whose scores sum to the reference's within
    rounding, and nearly every row's set is the reference's exactly."""
    from reference_impl.families.deepseek_v4.cache_layout import fp4_simulate
    from reference_impl.families.deepseek_v4.kernels import dispatch as v4_dispatch
    from reference_impl.families.deepseek_v4.model.sparse import index_scores, select_entries
    from reference_impl.kernels import fallback, indexer_triton

    g = torch.Generator(device="cuda").manual_seed(1)
    t, s, topk = 4096, 32768, 512
    q = fp4_simulate(torch.randn(t, 64, 128, device="cuda", generator=g)).bfloat16()
    keys = fp4_simulate(torch.randn(s, 128, device="cuda", generator=g)).bfloat16()
    weights = torch.randn(t, 64, device="cuda", generator=g) * 128**-0.5 * 64**-0.5
    positions = torch.linspace(0, 4 * s - 1, t, device="cuda").long()
    key_start, n_visible = torch.zeros_like(positions), (positions + 1) // 4
    bounds = ([0] * t, n_visible.tolist())
    assert v4_dispatch.indexer_kernel_name(q, keys) == "triton"
    got = v4_dispatch.select_entries(q, weights, keys, key_start, n_visible, topk, host_bounds=bounds)
    tiled = indexer_triton.indexer_topk_triton(  # the 1M path: keys streamed in tiles of 8,192
        q,
        weights,
        keys,
        torch.ones(s, device="cuda"),
        key_start,
        n_visible,
        topk,
        host_bounds=bounds,
        selector="triton",
        dot_dtype="bf16",
        key_tile=8192,
    )
    ref = select_entries(q, weights, keys, key_start, n_visible, topk)
    assert fallback.fallbacks_taken() == {}
    scores = torch.cat([index_scores(q[r : r + 256], weights[r : r + 256], keys) for r in range(0, t, 256)])  # [t, s]
    for sel in (got, tiled):
        valid = sel >= 0
        assert torch.equal(valid.sum(1), n_visible.clamp(max=topk))
        assert bool((sel[valid].long() < n_visible[:, None].expand_as(sel)[valid]).all())
        ordered = torch.sort(torch.where(valid, sel, s).long(), dim=1).values
        assert bool(((ordered[:, 1:] != ordered[:, :-1]) | (ordered[:, 1:] == s)).all())  # distinct
        got_sum = scores.gather(1, sel.clamp(min=0).long()).masked_fill(~valid, 0).sum(1)
        ref_sum = scores.gather(1, ref.clamp(min=0).long()).masked_fill(ref < 0, 0).sum(1)
        assert torch.allclose(got_sum, ref_sum, rtol=1e-5, atol=1e-5)
        same = (torch.sort(sel, 1).values == torch.sort(ref, 1).values).all(1).float().mean().item()
        assert same >= 0.95, same


@pytest.mark.parametrize("ratio, width", [(4, 512), (4, 128), (128, 512)])  # CSA main, CSA indexer, HCA
def test_v4_compressor_pool_kernel_at_flash_shape(ratio: int, width: int) -> None:
    """Pooling from column slices of one pre-pool table, as the CP layer passes them: 4,096 CSA
    entries (a 128K context's on one rank of 8) and 128 HCA entries (16,384 tokens)."""
    from reference_impl.families.deepseek_v4.kernels.compressor_triton import pool_triton
    from reference_impl.families.deepseek_v4.model.compressor import overlaps, pool, slot_positions

    g = torch.Generator(device="cuda").manual_seed(2)
    coff = 2 if overlaps(ratio) else 1
    n_entries = 4096 if ratio == 4 else 128
    table = torch.randn(n_entries * ratio, 2 * coff * width + 64, device="cuda", generator=g) * 3
    slots = slot_positions(torch.arange(n_entries, device="cuda"), ratio)
    slots = torch.where(slots >= 0, slots, -1)
    kv, score = table[:, : coff * width], table[:, coff * width : 2 * coff * width]
    out, ref = pool_triton(kv, score, slots, ratio), pool(kv, score, slots, ratio)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (out - ref).abs().max().item()


def test_v4_rope_tail_kernel_at_flash_shape() -> None:
    """The query's per-head norm + RoPE ([4096, 64, 512] bf16) and the output's inverse RoPE with its
    cast (float32 -> bf16): within one bf16 step of the head's largest value (the sum order of the
    mean and fused multiply-adds may move a rounding), and 99% of the elements bit-equal."""
    from reference_impl.families.deepseek_v4.kernels.rope_triton import rope_tail_triton
    from reference_impl.families.deepseek_v4.model.rope_tail import rope_tail
    from reference_impl.model.rope import rope_cos_sin, yarn_frequencies

    g = torch.Generator(device="cuda").manual_seed(3)
    t = 4096
    x = (torch.randn(t, 64, 512, device="cuda", generator=g) * 2).bfloat16()
    freqs = yarn_frequencies(64, 160000.0, 16.0, 65536, 32, 1).cuda()
    cos, sin = rope_cos_sin(freqs, torch.arange(t, device="cuda") * 31)
    for args in ((x, cos, sin, 64, 1e-6, None), (x.float() * 3, cos, -sin, 64, None, torch.bfloat16)):
        out, ref = rope_tail_triton(*args), rope_tail(*args)
        assert out.dtype == ref.dtype == torch.bfloat16
        # One bf16 step of the head's largest value: a rotated pair that nearly cancels keeps its
        # inputs' rounding, not its own.
        err = (out.float() - ref.float()).abs()
        assert bool((err <= 2**-7 * ref.float().abs().amax(-1, keepdim=True)).all()), err.max().item()
        assert (out == ref).float().mean().item() > 0.99


def test_v4_fp4_kernel_is_bit_exact_at_flash_shape() -> None:
    """The indexer query of 4,096 tokens ([4096, 64, 128] bf16, values over six decades): bit-equal."""
    from reference_impl.families.deepseek_v4.cache_layout import fp4_simulate
    from reference_impl.families.deepseek_v4.kernels.fp4_triton import fp4_simulate_triton

    g = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(4096, 64, 128, device="cuda", generator=g) * torch.logspace(-3, 3, 128, device="cuda")).bfloat16()
    assert torch.equal(fp4_simulate_triton(x).view(torch.int16), fp4_simulate(x).view(torch.int16))

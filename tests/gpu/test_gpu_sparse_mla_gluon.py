"""The two Gluon sparse MLA kernels against the torch reference and the Triton kernel, on an sm_90 GPU (GPU tier).

Gluon has no CPU interpreter, so this module runs only where the kernels do (an H100 / H200); the
CPU tier checks the dispatch around them (``tests/test_kernels_compute.py``) and compiles the
warp-specialized kernel for sm_90 (``tests/test_sparse_mla_gluon_ws.py``).
"""

from __future__ import annotations

import pytest
import torch

from reference_impl.kernels import dispatch
from reference_impl.model import sparse_attention as ref


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _sm90(), reason="the Gluon kernel needs an sm_90 GPU")]
DEVICE = torch.device("cuda")


def sparse_mla_attention_gluon(*args, **kwargs):  # imported on use: the module needs Gluon (CUDA Triton)
    from reference_impl.kernels.sparse_mla_gluon import sparse_mla_attention_gluon as kernel

    return kernel(*args, **kwargs)


def sparse_mla_attention_gluon_ws(*args, **kwargs):
    from reference_impl.kernels.sparse_mla_gluon_ws import sparse_mla_attention_gluon_ws as kernel

    return kernel(*args, **kwargs)


def sparse_mla_attention_triton(*args, **kwargs):
    from reference_impl.kernels.sparse_mla_triton import sparse_mla_attention_triton as kernel

    return kernel(*args, **kwargs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _assert_matches_reference_and_triton(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    d_v: int,
) -> None:
    """A Gluon kernel's answer against the torch reference and the Triton kernel: the same rows with
    no key (row 2 of :func:`_case` has none: ``out = 0``, ``lse = -inf``), the output within 1e-2
    of the reference and 5e-3 of the Triton kernel, the LSE within 1e-3."""
    want_out, want_lse = ref.sparse_mla_attention(q, kv, indices, scale, d_v)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[~finite] == float("-inf")).all() and (out[2] == 0).all()
    assert _rel(out, want_out) < 1e-2  # P is rounded to the KV dtype for the value product
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3
    triton_out, _ = sparse_mla_attention_triton(q, kv, indices, scale, d_v)
    assert _rel(out, triton_out) < 5e-3


def _case(n_tokens: int, n_heads: int, n_kv: int, topk: int, d_qk: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(n_tokens, n_heads, d_qk, device=DEVICE, generator=gen).to(dtype)
    kv = torch.randn(n_kv, d_qk, device=DEVICE, generator=gen).to(dtype)
    indices = torch.randint(0, n_kv, (n_tokens, topk), device=DEVICE, generator=gen, dtype=torch.int32)
    indices[1, 3 : topk // 2] = -1  # a hole in the middle
    indices[2] = -1  # no valid index at all: out 0, lse -inf
    indices[3, topk // 3 :] = -1  # -1 padded tail, as indexer_topk returns it
    return q, kv, indices


@pytest.mark.parametrize(
    ("n_tokens", "n_heads", "n_kv", "topk", "d_qk", "d_v", "dtype"),
    [
        (37, 16, 300, 100, 576, 512, torch.bfloat16),  # one partial head block, a partial last key tile
        (40, 130, 5000, 2048, 576, 512, torch.float16),  # three head blocks, the last partial; DeepSeek top-k
        (20, 64, 1000, 256, 320, 256, torch.bfloat16),  # other widths: d_v 256, rope 64
        (9, 128, 64, 64, 80, 64, torch.bfloat16),  # the smallest widths: d_v 64, rope 16
    ],
)
@pytest.mark.parametrize(("overlap_pv", "evict_last"), [(False, False), (True, False), (False, True)])
def test_gluon_matches_the_reference_and_the_triton_kernel(
    n_tokens: int,
    n_heads: int,
    n_kv: int,
    topk: int,
    d_qk: int,
    d_v: int,
    dtype: torch.dtype,
    overlap_pv: bool,
    evict_last: bool,
) -> None:
    q, kv, indices = _case(n_tokens, n_heads, n_kv, topk, d_qk, dtype, seed=n_tokens)
    scale = d_qk**-0.5
    out, lse = sparse_mla_attention_gluon(q, kv, indices, scale, d_v, overlap_pv=overlap_pv, evict_last=evict_last)
    _assert_matches_reference_and_triton(out, lse, q, kv, indices, scale, d_v)


@pytest.mark.parametrize(
    ("n_tokens", "n_heads", "n_kv", "topk", "d_qk", "d_v", "dtype"),
    [
        (37, 16, 300, 100, 576, 512, torch.bfloat16),  # one partial head block; one pair, the odd block partial
        (40, 130, 5000, 2048, 576, 512, torch.float16),  # three head blocks, the last partial; 16 pairs
        (11, 64, 900, 192, 576, 512, torch.bfloat16),  # three key blocks: the second pair's odd block is all past topk
        (20, 64, 1000, 256, 320, 256, torch.bfloat16),  # d_v 256, rope 64 (sS0 in slot 0's rope part)
        (9, 128, 64, 64, 80, 64, torch.bfloat16),  # d_v 64, rope 16 (sS0 a buffer of its own)
    ],
)
@pytest.mark.parametrize("pipeline_qk", [True, False])
def test_warp_specialized_matches_the_reference_and_the_triton_kernel(
    n_tokens: int, n_heads: int, n_kv: int, topk: int, d_qk: int, d_v: int, dtype: torch.dtype, pipeline_qk: bool
) -> None:
    q, kv, indices = _case(n_tokens, n_heads, n_kv, topk, d_qk, dtype, seed=n_tokens)
    scale = d_qk**-0.5
    out, lse = sparse_mla_attention_gluon_ws(q, kv, indices, scale, d_v, pipeline_qk=pipeline_qk)
    _assert_matches_reference_and_triton(out, lse, q, kv, indices, scale, d_v)
    bf16_out, bf16_lse = sparse_mla_attention_gluon_ws(
        q, kv, indices, scale, d_v, out_dtype=torch.bfloat16, pipeline_qk=pipeline_qk
    )
    assert torch.equal(bf16_out, out.to(torch.bfloat16)) and torch.equal(bf16_lse, lse)


def test_warp_specialized_without_any_key_returns_the_empty_row_answer() -> None:
    q, kv, indices = _case(5, 64, 10, 8, 576, torch.bfloat16, seed=4)
    for keys, idx in ((kv[:0], indices), (kv, indices[:, :0])):
        out, lse = sparse_mla_attention_gluon_ws(q, keys, idx, 0.1, 512)
        assert (out == 0).all() and (lse == float("-inf")).all()


def test_dispatch_runs_the_gluon_kernels_on_hopper_unless_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    q, kv, indices = _case(6, 128, 500, 128, 576, torch.bfloat16, seed=3)
    assert dispatch.sparse_mla_kernels(q, kv, 512) == ["gluon_ws", "gluon", "triton", "torch"]
    out, lse = dispatch.sparse_mla_attention(q, kv, indices, 0.05, 512, out_dtype=torch.bfloat16)
    direct = sparse_mla_attention_gluon_ws(q, kv, indices, 0.05, 512, out_dtype=torch.bfloat16)
    assert torch.equal(out, direct[0]) and torch.equal(lse, direct[1])
    monkeypatch.setenv("DSACP_NO_GLUON_WS", "1")
    assert dispatch.sparse_mla_kernel(q, kv, 512) == "gluon"
    out, lse = dispatch.sparse_mla_attention(q, kv, indices, 0.05, 512, out_dtype=torch.bfloat16)
    direct = sparse_mla_attention_gluon(q, kv, indices, 0.05, 512, out_dtype=torch.bfloat16)
    assert torch.equal(out, direct[0]) and torch.equal(lse, direct[1])
    monkeypatch.delenv("DSACP_NO_GLUON_WS")
    # A rope part wider than 64 fits only the first Gluon kernel's shared memory plan.
    wide_q = torch.zeros(1, 64, 256 + 128, device=DEVICE, dtype=torch.bfloat16)
    wide_kv = torch.zeros(4, 256 + 128, device=DEVICE, dtype=torch.bfloat16)
    assert dispatch.sparse_mla_kernels(wide_q, wide_kv, 256) == ["gluon", "triton", "torch"]
    monkeypatch.setenv("DSACP_NO_GLUON", "1")
    assert dispatch.sparse_mla_kernel(q, kv, 512) == "triton"
    monkeypatch.delenv("DSACP_NO_GLUON")
    assert dispatch.sparse_mla_kernel(q.float(), kv.float(), 512) == "triton"  # fp32: the Triton kernel's IEEE path


def test_gluon_without_any_key_returns_the_empty_row_answer() -> None:
    q, kv, indices = _case(5, 64, 10, 8, 576, torch.bfloat16, seed=4)
    for keys, idx in ((kv[:0], indices), (kv, indices[:, :0])):
        out, lse = sparse_mla_attention_gluon(q, keys, idx, 0.1, 512)
        assert (out == 0).all() and (lse == float("-inf")).all()

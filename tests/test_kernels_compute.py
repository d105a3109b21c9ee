"""Triton compute kernels (sparse MLA attention, indexer top-k) under the CPU interpreter, and dispatch.

The kernels are called directly at toy sizes and compared with the torch references in
``reference_impl.model.sparse_attention``; the dispatch tests substitute a failing kernel.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from conftest import gluon_operand_refusals

from reference_impl.errors import ConfigError  # noqa: E402
from reference_impl.fp8 import act_quant  # noqa: E402
from reference_impl.kernels import dispatch, fallback  # noqa: E402
from reference_impl.model import sparse_attention as ref  # noqa: E402


@pytest.fixture(scope="module")
def mla() -> object:
    return importlib.import_module("reference_impl.kernels.sparse_mla_triton")


@pytest.fixture(scope="module")
def idx_mod() -> object:
    return importlib.import_module("reference_impl.kernels.indexer_triton")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _attention_case(
    gen: torch.Generator, n_tokens: int, n_heads: int, d_qk: int, n_kv: int, topk: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(n_tokens, n_heads, d_qk, generator=gen).to(dtype)
    kv = torch.randn(n_kv, d_qk, generator=gen).to(dtype)
    indices = torch.randint(0, n_kv, (n_tokens, topk), generator=gen, dtype=torch.int32)
    indices[1, 3 : topk // 2] = -1  # a hole in the middle
    indices[2] = -1  # no valid index at all
    indices[3, topk // 3 :] = -1  # -1 padded tail, as indexer_topk returns it
    return q, kv, indices


# ---- sparse MLA attention --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("defer_pv", "lazy_rescale", "reload_prev"),
    [(True, False, False), (False, False, False), (True, True, False), (False, True, False), (True, False, True)],
)
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)],
)
def test_sparse_mla_matches_reference(
    mla: object, dtype: torch.dtype, tol: float, defer_pv: bool, lazy_rescale: bool, reload_prev: bool
) -> None:
    gen = torch.Generator().manual_seed(1)
    d_qk, d_v, scale = 192, 128, 192**-0.5
    q, kv, indices = _attention_case(gen, n_tokens=12, n_heads=6, d_qk=d_qk, n_kv=150, topk=40, dtype=dtype)
    # block_k=16 gives three tiles, the last one partial; 6 heads in a 16-head block are masked.
    out, lse = mla.sparse_mla_attention_triton(  # type: ignore[attr-defined]
        q, kv, indices, scale, d_v, block_k=16, defer_pv=defer_pv, lazy_rescale=lazy_rescale, reload_prev=reload_prev
    )
    ref_out, ref_lse = ref.sparse_mla_attention(q, kv, indices, scale, d_v)
    assert out.shape == (12, 6, d_v) and out.dtype == torch.float32 and lse.shape == (12, 6)
    assert _rel_err(out, ref_out) < tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=tol, atol=tol)
    # The all -1 row: lse -inf, out exactly 0.
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()


def test_interpreter_repair_runs_a_runtime_bounded_range_on_older_triton(mla: object, monkeypatch) -> None:
    """Triton < 3.7's interpreter reads a scalar's ``__index__`` as ``int()`` of a one-element array,
    which NumPy 2 refuses, so the kernel's ``tl.range(0, topk, ...)`` fails (as on the H200 image's
    triton 3.6); :func:`interpreter_compat.apply` repairs it."""
    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError

    from reference_impl.kernels import interpreter_compat

    current = interpreter._patch_lang_tensor
    unpatched = getattr(current, "__wrapped__", current)

    def triton_3_6_patch(tensor, scope) -> None:  # what triton 3.6 installs
        unpatched(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", triton_3_6_patch)
    gen = torch.Generator().manual_seed(2)
    q, kv, indices = _attention_case(gen, n_tokens=4, n_heads=2, d_qk=32, n_kv=40, topk=20, dtype=torch.float32)
    call = lambda: mla.sparse_mla_attention_triton(q, kv, indices, 32**-0.5, 16, block_k=16)  # type: ignore[attr-defined]  # noqa: E731
    with pytest.raises(InterpreterError, match="0-dimensional"):
        call()
    assert interpreter_compat.apply()
    assert not interpreter_compat.apply()  # once is enough
    out, _ = call()
    ref_out, _ = ref.sparse_mla_attention(q, kv, indices, 32**-0.5, 16)
    assert _rel_err(out, ref_out) < 1e-5


@pytest.mark.parametrize("defer_pv", [True, False])
def test_sparse_mla_lazy_rescale_small_and_large_max_growth(mla: object, defer_pv: bool) -> None:
    """Scores that grow a little from tile to tile (the stale max is kept: no rescale) and then by
    far more than the threshold (the block rescales): equal to the reference in fp32."""
    gen = torch.Generator().manual_seed(5)
    n_tokens, n_heads, d_qk, d_v, topk = 3, 4, 80, 64, 64
    q = torch.randn(n_tokens, n_heads, d_qk, generator=gen)
    kv = torch.randn(topk, d_qk, generator=gen)
    # Scores scale with the tile: tile 1 raises the max by less than the threshold (kept stale,
    # probabilities above 1), tile 2 far past it (rescale), tile 3 stays below (stale).
    growth = torch.tensor([1.0] * 16 + [1.1] * 16 + [40.0] * 16 + [2.0] * 16)
    kv = kv * growth[:, None]
    indices = torch.arange(topk, dtype=torch.int32).repeat(n_tokens, 1)
    scale = 0.5
    ref_out, ref_lse = ref.sparse_mla_attention(q, kv, indices, scale, d_v)
    for lazy in (True, False):
        out, lse = mla.sparse_mla_attention_triton(  # type: ignore[attr-defined]
            q, kv, indices, scale, d_v, block_k=16, defer_pv=defer_pv, lazy_rescale=lazy
        )
        assert _rel_err(out, ref_out) < 1e-5, lazy
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-4)


def test_sparse_mla_real_widths_several_head_blocks_bf16_out(mla: object) -> None:
    """576/512 widths, 20 heads in two 16-head blocks (second partial), bf16 output."""
    gen = torch.Generator().manual_seed(2)
    q, kv, indices = _attention_case(gen, n_tokens=6, n_heads=20, d_qk=576, n_kv=64, topk=16, dtype=torch.bfloat16)
    scale = 192**-0.5
    out, lse = mla.sparse_mla_attention_triton(  # type: ignore[attr-defined]
        q, kv, indices, scale, 512, out_dtype=torch.bfloat16, block_h=16, block_k=16
    )
    ref_out, ref_lse = ref.sparse_mla_attention(q, kv, indices, scale, 512)
    assert out.dtype == torch.bfloat16
    assert _rel_err(out, ref_out) < 1e-2
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_tokens=st.integers(1, 5),
    n_heads=st.integers(1, 17),
    n_kv=st.integers(1, 90),
    topk=st.integers(1, 33),
    seed=st.integers(0, 2**31 - 1),
)
def test_sparse_mla_property_fp32(mla: object, n_tokens: int, n_heads: int, n_kv: int, topk: int, seed: int) -> None:
    """Any shape, indices anywhere in [-1, S): fp32 kernel equals the reference tightly."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_tokens, n_heads, 80, generator=gen)
    kv = torch.randn(n_kv, 80, generator=gen)
    indices = torch.randint(-1, n_kv, (n_tokens, topk), generator=gen, dtype=torch.int32)
    out, lse = mla.sparse_mla_attention_triton(q, kv, indices, 0.125, 64, block_k=16)  # type: ignore[attr-defined]
    ref_out, ref_lse = ref.sparse_mla_attention(q, kv, indices, 0.125, 64)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)  # -inf where ref is -inf


# ---- indexer ------------------------------------------------------------------------------------


def _indexer_case(
    gen: torch.Generator, n_heads: int = 4, d: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two requests in one full view: A keys [0, 100) with prefix 88, B keys [100, 190) with prefix 60.

    A's 12 queries see 89..100 keys, B's 14 queries see 61..74 keys (fewer than top-k 64 for none,
    more than top-k for all): rows differ in range, start and length.
    """
    n_a, n_b = 12, 14
    q_fp8, q_scale = act_quant(torch.randn(n_a + n_b, n_heads, d, generator=gen))
    weights = torch.randn(n_a + n_b, n_heads, generator=gen) * q_scale.squeeze(-1) * (n_heads * d) ** -0.5
    k_fp8, k_scale = act_quant(torch.randn(190, d, generator=gen))
    key_start = torch.cat([torch.zeros(n_a), torch.full((n_b,), 100)]).long()
    key_end = torch.cat([88 + torch.arange(n_a) + 1, 100 + 60 + torch.arange(n_b) + 1]).long()
    return q_fp8, weights, k_fp8, k_scale.squeeze(-1), key_start, key_end


def _assert_topk_sets_equal_up_to_ties(
    got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, rel: float = 1e-5
) -> None:
    """Per row: same number of valid entries, and differing elements score within ``rel`` of the k-th."""
    for row in range(want.shape[0]):
        g = set(got[row][got[row] >= 0].tolist())
        w = set(want[row][want[row] >= 0].tolist())
        assert len(g) == len(w) == int((got[row] >= 0).sum()), f"row {row}: count or duplicates differ"
        if g == w:
            continue
        kth = scores[row, sorted(w, key=lambda c: -float(scores[row, c]))[-1]]
        for col in g ^ w:
            assert abs(float(scores[row, col] - kth)) <= rel * abs(float(kth)), f"row {row}: {col} is not a tie"


def test_indexer_logits_match_reference(idx_mod: object) -> None:
    gen = torch.Generator().manual_seed(3)
    q_fp8, weights, k_fp8, k_scale, key_start, key_end = _indexer_case(gen)
    # Columns [40, 190): the window starts mid-request-A so some rows' ranges start before it.
    logits = idx_mod.indexer_logits_triton(  # type: ignore[attr-defined]
        q_fp8, weights, k_fp8, k_scale, key_start, key_end, 40, 190, block_t=16, block_s=32
    )
    scores = ref.indexer_scores(q_fp8, weights, k_fp8, k_scale)[:, 40:]
    cols = torch.arange(40, 190)
    visible = (cols >= key_start[:, None]) & (cols < key_end[:, None])
    assert torch.isneginf(logits[~visible]).all()
    torch.testing.assert_close(logits[visible], scores[visible], rtol=1e-5, atol=1e-5 * float(scores.abs().max()))


@pytest.mark.parametrize("rows_per_chunk", [0, 5])
def test_indexer_topk_matches_reference(idx_mod: object, rows_per_chunk: int) -> None:
    gen = torch.Generator().manual_seed(4)
    q_fp8, weights, k_fp8, k_scale, key_start, key_end = _indexer_case(gen)
    topk = 64
    got = idx_mod.indexer_topk_triton(  # type: ignore[attr-defined]
        q_fp8, weights, k_fp8, k_scale, key_start, key_end, topk, rows_per_chunk
    )
    want = ref.indexer_topk(q_fp8, weights, k_fp8, k_scale, key_start, key_end, topk, rows_per_chunk)
    assert got.shape == (26, topk) and got.dtype == torch.int32
    visible = (key_end - key_start).clamp(max=topk)
    assert torch.equal((got >= 0).sum(1), visible)
    in_range = (got < 0) | ((got >= key_start[:, None]) & (got < key_end[:, None]))
    assert in_range.all()
    _assert_topk_sets_equal_up_to_ties(got, want, ref.indexer_scores(q_fp8, weights, k_fp8, k_scale))


@pytest.mark.parametrize("selector", ["torch", "triton"])
def test_indexer_topk_fewer_visible_than_topk(idx_mod: object, selector: str) -> None:
    """First query rows of a fresh request see 1..n keys: -1 padded beyond min(topk, visible)."""
    gen = torch.Generator().manual_seed(5)
    q_fp8, q_scale = act_quant(torch.randn(10, 2, 128, generator=gen))
    weights = torch.rand(10, 2, generator=gen) * q_scale.squeeze(-1)
    k_fp8, k_scale = act_quant(torch.randn(10, 128, generator=gen))
    key_start = torch.zeros(10, dtype=torch.long)
    key_end = torch.arange(10) + 1
    got = idx_mod.indexer_topk_triton(  # type: ignore[attr-defined]
        q_fp8, weights, k_fp8, k_scale.squeeze(-1), key_start, key_end, 16, selector=selector
    )
    want = ref.indexer_topk(q_fp8, weights, k_fp8, k_scale.squeeze(-1), key_start, key_end, 16)
    # visible <= topk: every row holds all its keys; torch.topk lists them by score (ReLU zeros tie,
    # and their order is torch.topk's own), the selection kernel by key.
    for row in range(10):
        assert sorted(got[row, : row + 1].tolist()) == sorted(want[row, : row + 1].tolist()) == list(range(row + 1))
        if selector == "triton":
            assert got[row, : row + 1].tolist() == list(range(row + 1))
    assert (got[:, 10:] == -1).all() and torch.equal((got >= 0).sum(1), key_end)


# ---- dispatch -----------------------------------------------------------------------------------


@pytest.fixture()
def fresh_warnings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("DSACP_FORCE_TORCH", raising=False)
    fallback.reset_fallbacks()
    yield
    fallback.reset_fallbacks()


def _boom(*args: object, **kwargs: object) -> object:
    raise RuntimeError("simulated kernel failure")


def test_dispatch_failing_kernel_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
    monkeypatch.setitem(dispatch.SPARSE_MLA_LAUNCHERS, "triton", _boom)
    monkeypatch.setattr(dispatch, "_triton_indexer_topk", _boom)
    gen = torch.Generator().manual_seed(6)
    q, kv, indices = _attention_case(gen, n_tokens=5, n_heads=3, d_qk=96, n_kv=30, topk=8, dtype=torch.float32)
    iq, w, k, ks, kst, ke = _indexer_case(gen, n_heads=2)
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        for _ in range(3):
            out, lse = dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64)
            top = dispatch.indexer_topk(iq, w, k, ks, kst, ke, 16)
    ref_out, ref_lse = ref.sparse_mla_attention(q, kv, indices, 0.1, 64)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(top, ref.indexer_topk(iq, w, k, ks, kst, ke, 16))
    records = [r for r in caplog.records if r.name == fallback.__name__]
    assert len(records) == 2, [r.getMessage() for r in records]  # one per kernel, not per call
    assert {"sparse_mla_attention" in r.getMessage() for r in records} == {True, False}
    assert all("simulated kernel failure" in r.getMessage() for r in records)


def test_dispatch_force_torch_and_cpu_skip_the_kernel(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    calls: list[str] = []

    def spy(*args: object, **kwargs: object) -> object:
        calls.append("kernel")
        raise RuntimeError("must not run")

    monkeypatch.setitem(dispatch.SPARSE_MLA_LAUNCHERS, "triton", spy)
    gen = torch.Generator().manual_seed(7)
    q, kv, indices = _attention_case(gen, n_tokens=4, n_heads=2, d_qk=96, n_kv=20, topk=8, dtype=torch.float32)
    with caplog.at_level(logging.DEBUG, logger=fallback.__name__):
        dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64)  # CPU tensors: torch path
        monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
        dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64, force_torch=True)
        monkeypatch.setenv("DSACP_FORCE_TORCH", "1")
        dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64)
    assert calls == [] and not caplog.records
    assert fallback.triton_available() is True


def test_compute_bench_dry_run_sweeps_at_the_per_rank_shape(tmp_path, monkeypatch) -> None:
    """``bench.compute --sweep`` on CPU (interpreter, toy sizes): every section checks against the
    torch reference, the sweep runs at the per-rank shape, and its rows carry every config key
    that ``scripts/apply_sweep.py`` writes into the kernel default."""
    import json

    from reference_impl.bench import compute, compute_sweep

    candidates = [(16, 16, 4, 1, True, False, False, True), (16, 16, 4, 1, False, True, False, False)]
    monkeypatch.setattr(compute_sweep, "ATTN_SWEEP", candidates)
    monkeypatch.setattr(compute_sweep, "INDEXER_SWEEP", [(16, 64, 4, 1, "fp8")])
    out = tmp_path / "compute.json"
    assert (
        compute.main(
            [
                "--out",
                str(out),
                "--device",
                "cpu",
                "--tokens",
                "24",
                "--heads",
                "4",
                "--topk",
                "8",
                "--index-heads",
                "2",
                "--cp-context",
                "48",
                "--cp-size",
                "2",
                "--check-rows",
                "6",
            ]
            + ["--sweep"]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["sweep"]["S"] == 48 and doc["sweep"]["T"] == doc["per_rank"]["attention"]["T"] == 24
    assert all(row["check"]["ok"] for row in doc["sweep"]["attention"] + doc["attention"] + doc["indexer"]), json.dumps(
        [r["check"] for r in doc["sweep"]["attention"] + doc["attention"] + doc["indexer"]]
    )
    assert set(compute_sweep.ATTENTION_KEYS) == set(doc["sweep"]["attention"][0]["config"])
    # No Gluon off sm_90: no Gluon rows, and the engine figures the planner reads are the Triton kernel's.
    rank_row = doc["per_rank"]["attention"]
    assert doc["sweep"]["gluon"] == [] and "gluon" not in rank_row and "gluon_ws" not in rank_row
    assert rank_row["engine_tflops"] == rank_row["triton_tflops"] and rank_row["engine_ms"] == rank_row["triton_ms"]
    smoke = doc["dispatch_smoke"]  # the dispatch itself ran (on CPU tensors: the torch references)
    assert "error" not in smoke and smoke["attention_kernel"] == "torch" and smoke["fallback_warnings"] == [], smoke


def test_the_compute_bench_checks_and_times_each_gluon_kernel_it_is_asked_for(monkeypatch) -> None:
    """The Gluon rows of an attention row, on CPU with stand-ins for the two Gluon launchers (the
    torch reference, the first one also taking its switches): each kernel asked for and supported
    gets a checked, timed row, the first with its config; one not asked for, or not supported, none."""
    from reference_impl.bench import compute_cases
    from reference_impl.kernels import sparse_mla_gluon, sparse_mla_gluon_ws

    seen: list[str] = []

    def stand_in(name: str):
        def attention(q, kv, ix, scale, d_v, *, out_dtype=torch.float32, **switches):
            seen.append(f"{name}{sorted(switches)}")
            out, lse = ref.sparse_mla_attention(q, kv, ix, scale, d_v)
            return out.to(out_dtype), lse

        return attention

    monkeypatch.setattr(sparse_mla_gluon, "sparse_mla_attention_gluon", stand_in("gluon"))
    monkeypatch.setattr(sparse_mla_gluon_ws, "sparse_mla_attention_gluon_ws", stand_in("ws"))
    monkeypatch.setattr(sparse_mla_gluon, "gluon_supported", lambda *a: True)
    monkeypatch.setattr(sparse_mla_gluon_ws, "ws_supported", lambda *a: True)
    gen = torch.Generator().manual_seed(0)
    q, kv, indices = compute_cases.attention_inputs(torch.arange(40, 52), 64, 4, 8, gen, torch.device("cpu"))
    rows = torch.arange(6)
    switches = {"overlap_pv": False, "evict_last": True}
    both = compute_cases._gluon_rows(q, kv, indices, rows, 0.1, 1e9, 100.0, switches, True)
    assert (
        set(both) == {"gluon", "gluon_ws"} and both["gluon"]["config"] == switches and "config" not in both["gluon_ws"]
    )
    for row in both.values():
        assert row["check"]["ok"] and row["ms"] > 0 and row["tflops"] == pytest.approx(1e9 / row["ms"] / 1e9)
    assert seen == ["gluon['evict_last', 'overlap_pv']"] * 2 + ["ws[]"] * 2  # checked, then timed
    assert set(compute_cases._gluon_rows(q, kv, indices, rows, 0.1, 1e9, 100.0, None, True)) == {"gluon_ws"}
    monkeypatch.setattr(sparse_mla_gluon_ws, "ws_supported", lambda *a: False)
    assert compute_cases._gluon_rows(q, kv, indices, rows, 0.1, 1e9, 100.0, None, True) == {}


def test_compute_sweep_records_a_failing_candidate_and_never_picks_it(monkeypatch) -> None:
    """A candidate that raises (as one out of shared memory does on the GPU) becomes an error row;
    the pick ignores it and falls back to the current default when nothing else passed."""
    from reference_impl.bench import compute_sweep

    good, bad = (64, 64, 8, 2, False, False, False, False), (64, 64, 8, 2, True, False, False, True)
    monkeypatch.setattr(compute_sweep, "ATTN_SWEEP", [good, bad])
    monkeypatch.setattr(compute_sweep, "INDEXER_SWEEP", [(64, 128, 4, 3, "fp8")])

    def time_attention(config: dict) -> dict:
        if config["reload_prev"]:
            raise RuntimeError("out of resource: shared memory")
        return {"config": config, "triton_tflops": 200.0, "check": {"ok": True}}

    def time_indexer(config: dict) -> dict:
        raise RuntimeError("compile error")

    def time_gluon(config: dict) -> dict:
        if config["overlap_pv"]:
            raise RuntimeError("compile error")
        return {"engine_kernel": "gluon", "gluon": {"config": config, "tflops": 300.0, "check": {"ok": True}}}

    attention, indexer, gluon = compute_sweep.run_sweep(time_attention, time_indexer, time_gluon)
    assert "error" not in attention[0] and attention[1]["error"].startswith("RuntimeError: out of resource")
    assert compute_sweep.pick_attention(attention, bad) == good
    assert compute_sweep.pick_indexer(indexer, (1, 2, 3, 4, "bf16")) == (1, 2, 3, 4, "bf16")
    assert [("error" in row) for row in gluon] == [config[0] for config in compute_sweep.GLUON_SWEEP]
    assert compute_sweep.pick_gluon(gluon, (True, False)) == (False, False)  # the failing default is replaced
    assert compute_sweep.run_sweep(time_attention, time_indexer)[2] == []  # no Gluon where it cannot run


# ---- the Gluon kernel's place in the dispatch (the kernel itself: tests/test_sparse_mla_gluon.py) ----


def test_gluon_kernel_names_what_it_cannot_run() -> None:
    """The Gluon kernel's input limits, each refused with its reason (checked without a GPU)."""
    from reference_impl.kernels.sparse_mla_gluon import sparse_mla_attention_gluon, unsupported_reason

    bf16 = torch.bfloat16
    assert unsupported_reason("cuda", (9, 0), bf16, bf16, 576, 512) is None
    assert unsupported_reason("cuda", (9, 0), torch.float16, torch.float16, 80, 64) is None
    refused = {
        **gluon_operand_refusals(),
        "power-of-two": [
            ("cuda", (9, 0), bf16, bf16, 560, 500),
            ("cuda", (9, 0), bf16, bf16, 552, 512),
            ("cuda", (9, 0), bf16, bf16, 40, 32),
        ],
        "d_qk <= 576": [("cuda", (9, 0), bf16, bf16, 640, 512)],
    }
    for words, cases in refused.items():
        for case in cases:
            reason = unsupported_reason(*case)
            assert reason is not None and words in reason, (case, reason)
    q, kv, indices = _attention_case(torch.Generator().manual_seed(1), 4, 4, 576, 10, 8, bf16)
    with pytest.raises(ValueError, match="Gluon sparse MLA kernel does not run under TRITON_INTERPRET=1"):
        sparse_mla_attention_gluon(q, kv, indices, 0.1, 512)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="Gluon sparse MLA kernel needs an sm_90 GPU, got cpu"):
            sparse_mla_attention_gluon(q, kv, indices, 0.1, 512)


def _reference_kernel(calls: list[str], name: str):
    def kernel(q, kv, indices, scale, d_v, out_dtype):  # type: ignore[no-untyped-def]
        calls.append(name)
        out, lse = ref.sparse_mla_attention(q, kv, indices, scale, d_v)
        return out.to(out_dtype), lse

    return kernel


def _pretend_gluon_applies(monkeypatch: pytest.MonkeyPatch, warp_specialized: bool = False) -> None:
    """As on an H200: Gluon imports and the first Gluon kernel (and, if asked, the warp-specialized
    one) supports the inputs."""
    import reference_impl.kernels.sparse_mla_gluon as gluon_module
    import reference_impl.kernels.sparse_mla_gluon_ws as ws_module

    monkeypatch.setattr(dispatch, "gluon_available", lambda: True)
    monkeypatch.setattr(gluon_module, "gluon_supported", lambda *a: True)
    monkeypatch.setattr(ws_module, "ws_supported", lambda *a: warp_specialized)


def test_dispatch_tries_gluon_then_triton(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    """Gluon first; where it does not apply (here, CPU tensors) the Triton kernel runs silently;
    where it fails, the Triton kernel runs after one warning naming Gluon."""
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
    calls: list[str] = []
    monkeypatch.setitem(dispatch.SPARSE_MLA_LAUNCHERS, "triton", _reference_kernel(calls, "triton"))
    q, kv, indices = _attention_case(torch.Generator().manual_seed(8), 4, 2, 96, 20, 8, torch.float32)
    want, _ = ref.sparse_mla_attention(q, kv, indices, 0.1, 64)
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        assert dispatch.sparse_mla_kernel(q, kv, 64) == "triton"  # the real Gluon check declines CPU tensors
        assert torch.equal(dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64)[0], want)
        assert calls == ["triton"] and not caplog.records
        _pretend_gluon_applies(monkeypatch)
        monkeypatch.setitem(dispatch.SPARSE_MLA_LAUNCHERS, "gluon", _reference_kernel(calls, "gluon"))
        dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64)
        assert calls == ["triton", "gluon"]
        monkeypatch.setitem(dispatch.SPARSE_MLA_LAUNCHERS, "gluon", _boom)
        for _ in range(3):
            assert torch.equal(dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64)[0], want)
    assert calls == ["triton", "gluon", "triton", "triton", "triton"]
    messages = [r.getMessage() for r in caplog.records if r.name == fallback.__name__]
    assert len(messages) == 1 and "Gluon sparse_mla_attention failed" in messages[0]
    assert "falling back to the Triton kernel" in messages[0] and "simulated kernel failure" in messages[0]


def test_dispatch_chain_runs_warp_specialized_then_gluon_then_triton(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    """Where both Gluon kernels apply, the warp-specialized one runs; when it fails, one warning
    names it and the first Gluon kernel runs; when that fails too, one more warning and the Triton
    kernel runs. ``DSACP_NO_GLUON_WS=1`` skips only the first of the three."""
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
    calls: list[str] = []
    for name in ("gluon_ws", "gluon", "triton"):
        monkeypatch.setitem(dispatch.SPARSE_MLA_LAUNCHERS, name, _reference_kernel(calls, name))
    q, kv, indices = _attention_case(torch.Generator().manual_seed(10), 4, 2, 96, 20, 8, torch.float32)
    want, _ = ref.sparse_mla_attention(q, kv, indices, 0.1, 64)
    _pretend_gluon_applies(monkeypatch, warp_specialized=True)
    assert dispatch.sparse_mla_kernels(q, kv, 64) == ["gluon_ws", "gluon", "triton", "torch"]
    with caplog.at_level(logging.WARNING, logger=fallback.__name__):
        assert torch.equal(dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64)[0], want)
        assert calls == ["gluon_ws"] and not caplog.records
        monkeypatch.setitem(dispatch.SPARSE_MLA_LAUNCHERS, "gluon_ws", _boom)
        assert torch.equal(dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64)[0], want)
        monkeypatch.setitem(dispatch.SPARSE_MLA_LAUNCHERS, "gluon", _boom)
        assert torch.equal(dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64)[0], want)
    assert calls == ["gluon_ws", "gluon", "triton"]
    messages = [r.getMessage() for r in caplog.records if r.name == fallback.__name__]
    assert len(messages) == 2
    assert "Warp-specialized Gluon sparse_mla_attention failed" in messages[0]
    assert "falling back to the Gluon kernel" in messages[0]
    assert messages[1].startswith("Gluon sparse_mla_attention failed") and "the Triton kernel" in messages[1]
    monkeypatch.setenv("DSACP_NO_GLUON_WS", "1")
    assert dispatch.sparse_mla_kernels(q, kv, 64) == ["gluon", "triton", "torch"]
    monkeypatch.setenv("DSACP_NO_GLUON_WS", "maybe")
    with pytest.raises(ConfigError, match="DSACP_NO_GLUON_WS='maybe'"):
        dispatch.sparse_mla_kernel(q, kv, 64)


def test_dispatch_no_gluon_skips_the_gluon_kernel(monkeypatch: pytest.MonkeyPatch, fresh_warnings: None) -> None:
    monkeypatch.setattr(fallback, "device_runs_kernels", lambda device: True)  # pretend CUDA
    calls: list[str] = []
    monkeypatch.setitem(dispatch.SPARSE_MLA_LAUNCHERS, "triton", _reference_kernel(calls, "triton"))
    q, kv, indices = _attention_case(torch.Generator().manual_seed(9), 4, 2, 96, 20, 8, torch.float32)
    monkeypatch.setenv("DSACP_NO_GLUON", "1")
    _pretend_gluon_applies(monkeypatch)
    monkeypatch.setitem(dispatch.SPARSE_MLA_LAUNCHERS, "gluon", _boom)  # must not run
    assert dispatch.sparse_mla_kernel(q, kv, 64) == "triton"
    dispatch.sparse_mla_attention(q, kv, indices, 0.1, 64)
    assert calls == ["triton"] and not fallback.fallbacks_taken()
    monkeypatch.delenv("DSACP_NO_GLUON")
    assert dispatch.sparse_mla_kernel(q, kv, 64) == "gluon"
    assert dispatch.sparse_mla_kernel(q, kv, 64, force_torch=True) == "torch"

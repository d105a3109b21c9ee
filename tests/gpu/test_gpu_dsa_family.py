"""Both MLA cache scale formats in the compiled kernels, and GLM-5 / GLM-5.2 (IndexShare) end to end (GPU tier).

The fused MLA store (both code paths, with and without the fast division) and the current-rows
fill (with and without index K, as on an IndexShare shared layer) write the torch path's bytes at
DeepSeek-V3.2 / GLM-5 cache widths (512 latent + 64 rope, 656-byte rows) in the ``ue8m0`` and
``fp32`` formats, with the hardware conversions (the CPU tier checks the interpreter's); the
materialize reads both (``test_gpu_fused_kernels.py::test_materialize_equals_torch``). Then GLM-5.2
at its real dims, 4 layers (full, full, full, shared), two ranks
sharing the GPU at levels 0 and 8, against the oracle, with less index K per rank than GLM-5.
"""

from __future__ import annotations

import pytest
import torch
from conftest import as_bytes

from gpu.test_gpu_fused_kernels import _kv, no_fallbacks  # noqa: F401  (the autouse fixture applies here too)
from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.kernels import fused_torch
from reference_impl.kvcache.layout import KVLayout

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_ranks]

DEVICE = torch.device("cuda")
TOKENS, PAGE = 8192 + 37, 64
FORMATS = ("ue8m0", "fp32")


@pytest.mark.parametrize("fast_div", [False, True])
@pytest.mark.parametrize("one_pass", [False, True])
def test_the_mla_store_writes_both_formats_like_torch(one_pass: bool, fast_div: bool) -> None:
    from reference_impl.kernels.fused_store import store_mla_triton

    kv = _kv(TOKENS, 576, 1)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    dst = torch.randperm(TOKENS + 100, generator=gen, device=DEVICE)[:TOKENS]
    rows = {}
    for fmt in FORMATS:
        layout = KVLayout(512, 64, "fp8", PAGE, mla_scale_fmt=fmt)
        got = torch.zeros(TOKENS + 100, 656, dtype=torch.uint8, device=DEVICE)
        want = got.clone()
        store_mla_triton(kv, None, dst, got, layout, one_pass=one_pass, fast_div=fast_div)
        fused_torch.store_mla_torch(kv, None, dst, want, layout)
        assert torch.equal(got, want), fmt
        rows[fmt] = got
    assert not torch.equal(rows["ue8m0"], rows["fp32"])  # the formats really differ


@pytest.mark.parametrize("with_index", [True, False], ids=["full-layer", "shared-layer"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_current_fill_writes_both_formats_like_torch(fmt: str, with_index: bool) -> None:
    from reference_impl.cp.current_reuse import fill_rows
    from reference_impl.kernels.fused_current import fill_current_triton

    layout = KVLayout(512, 64, "fp8", PAGE, mla_scale_fmt=fmt)
    n = 8 * 16384
    kv, k = _kv(n, 576, 3), _kv(n, 128, 4)
    view_rows = torch.randperm(n + 300, generator=torch.Generator(device=DEVICE).manual_seed(5), device=DEVICE)[:n]
    views = []
    for run in (fill_current_triton, fill_rows):
        kv_view = torch.full((n + 300, 576), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        i8 = torch.zeros(n + 300, 128, dtype=torch.uint8, device=DEVICE)
        sc = torch.zeros(n + 300, device=DEVICE)
        if with_index:
            run(kv, k, view_rows, kv_view, i8.view(torch.float8_e4m3fn), sc, layout)
        else:
            run(kv, None, view_rows, kv_view, None, None, layout)
        views.append((kv_view, i8, sc))
    for got, want in zip(*views):
        assert torch.equal(as_bytes(got), as_bytes(want))


GLM_RUN = RunConfig(
    preset="glm-5.2",
    n_layers=4,
    cp_size=2,
    requests=(Request(1000, 2100), Request(64, 900)),
    page_size=64,
    device="cuda",
)
GLM_RUNS = {
    "glm-5.2-level0": GLM_RUN.replace(phases=PhaseSet.level(0)),
    "glm-5.2-level8-fp32": GLM_RUN.replace(phases=PhaseSet.level(8), mla_scale_fmt="fp32"),
    "glm-5.2-level8": GLM_RUN.replace(phases=PhaseSet.level(8)),
    "glm-5-level8": GLM_RUN.replace(preset="glm-5", phases=PhaseSet.level(8)),
}


@pytest.fixture(scope="module")
def glm_reports() -> dict[str, dict]:
    from reference_impl.runner import run_prefills

    return dict(zip(GLM_RUNS, run_prefills(list(GLM_RUNS.values()))))


@pytest.mark.parametrize("name", list(GLM_RUNS))
def test_glm_presets_match_the_oracle_on_the_gpu(glm_reports: dict[str, dict], name: str) -> None:
    rep = glm_reports[name]
    assert rep["matches_oracle"] is True, rep["problems"]
    assert rep["collectives_identical"] and rep["kernel_fallbacks"] == {}


def test_glm52_keeps_and_moves_less_index_k_than_glm5(glm_reports: dict[str, dict]) -> None:
    glm52, glm5 = glm_reports["glm-5.2-level8"], glm_reports["glm-5-level8"]
    assert glm52["config"]["index_topk_pattern"] == "FFFS" and glm5["config"]["index_topk_pattern"] == "FFFF"
    for a, b in zip(glm52["per_rank"], glm5["per_rank"]):
        assert 4 * a["index_bytes"] == 3 * b["index_bytes"] and a["kv_bytes"] == b["kv_bytes"]
        assert a["gather_bytes"] < b["gather_bytes"]

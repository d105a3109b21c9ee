"""GLM-5.3's FP8 latent row on CUDA, and its round-robin split end to end (GPU tier).

The row's encoder on the GPU writes the CPU's bytes (``block_scales`` divides by a tensor, IEEE on every
device), in both scale formats. Then ``tiny-glm53`` with two ranks sharing the GPU, FP8 rows, a cached
prefix and unaligned chunks, in-seq and round-robin at levels 2 and 8, against the oracle in bf16 (the
rounding-tolerant rule): the KDA layers run the Triton kernels, the round-robin runs receive their re-split
rows and outputs back, and level 8 prefetches the history.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.families.glm53.cache_layout import LatentRows

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_ranks]


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_the_fp8_row_encodes_on_cuda_as_on_the_cpu(scale_fmt: str) -> None:
    gen = torch.Generator().manual_seed(3)
    latent = torch.randn(4096, 512, generator=gen) * torch.logspace(-6, 4, 4096)[:, None]
    latent[0] = 0.0
    fmt = LatentRows(512, fp8=True, scale_fmt=scale_fmt)
    on_cpu = fmt.encode(latent)
    on_gpu = fmt.encode(latent.cuda())
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), on_cpu)
    assert torch.equal(fmt.decode(on_gpu).cpu(), fmt.decode(on_cpu))
    assert bool(fmt.in_format(on_gpu).all())


RUN = RunConfig(
    preset="tiny-glm53",
    cp_size=2,
    phases=PhaseSet.level(2),
    page_size=64,
    chunk_size=700,
    requests=(Request(300, 1500), Request(0, 900)),
    device="cuda",
)
RUNS = {
    "in-seq": RUN,
    "round-robin": RUN.replace(split_mode="round-robin"),
    # Level 8 (round-robin without phases 4 and 5, the in-seq split's own): the history prefetched on a side
    # stream as stored FP8 rows, phase 3's current rows encoded the same way.
    "in-seq level 8": RUN.replace(phases=PhaseSet.level(8)),
    "round-robin level 8": RUN.replace(split_mode="round-robin", phases=PhaseSet.level(8).for_split("round-robin")),
}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    from reference_impl.runner import run_prefills

    return dict(zip(RUNS, run_prefills(list(RUNS.values()))))


@pytest.mark.parametrize("name", list(RUNS))
def test_glm53_matches_the_oracle_on_the_gpu(reports: dict[str, dict], name: str) -> None:
    rep = reports[name]
    assert rep["matches_oracle"] is True, rep["problems"]
    assert rep["config"]["kv_dtype"] == "fp8"
    assert rep["attention_kernel"] == "glm53-kda-triton+indexer-triton", rep["attention_kernel"]
    assert not rep["kernel_fallbacks"], rep["kernel_fallbacks"]
    moved = [r["kda_resplit_bytes_received"] for r in rep["per_rank"]]
    assert all(m > 0 for m in moved) if name.startswith("round-robin") else moved == [0, 0]
    if name.endswith("level 8"):  # the cached prefix and earlier chunks' rows: prefetched, not read in the layer
        assert all(r["prefetch_bytes_received"] > 0 == r["view_bytes_received"] for r in rep["per_rank"])

"""GLM-5.3 on CUDA (GPU tier): ``tiny-glm53`` CP prefill at levels 0 and 8 against its oracle.

Two ranks share the GPU over gloo; requests and chunks are not multiples of the 16-token group, the
blocks or the pages, and one request has a cached prefix, so level 8 materializes history and
prefetches it on a CUDA side stream over the KDA layer before each indexed layer; the KDA layers and the
indexers' scoring and selection run the Triton kernels (the model's kernel tables). A third run puts two
batches on one pool: a request hits the first's prefix inside a KDA block and a chunk, from the checkpoint
kept there. The runs keep bf16 latent
rows (FP8 rows: ``test_gpu_glm53_rows_and_round_robin.py``) and compute in float32: the GLM-5.3 check
compares every indexed layer's selections as exact sets, and in float32 the CP run's and the oracle's
different GEMM batching cannot move a group across the selection boundary the way bf16 rounding can.
Outputs follow the rounding-tolerant rule of :mod:`reference_impl.check` (not a CPU run).
"""

from __future__ import annotations

import pytest

from reference_impl.config import PhaseSet, Request, RunConfig, parse_batches

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_ranks]

TINY = RunConfig(
    preset="tiny-glm53",
    cp_size=2,
    device="cuda",
    kv_dtype="bf16",
    compute_dtype="fp32",
    page_size=4,
    requests=(Request(37, 61), Request(0, 45)),
    chunk_size=23,
)


@pytest.fixture(scope="module")
def glm53_reports() -> dict[str, dict]:
    from reference_impl.runner import run_prefills

    requests, sizes = parse_batches("0+150;r0:69+30,13+20")  # P = 69: inside r0's second chunk, mid-group
    configs = {
        "level0": TINY.replace(phases=PhaseSet.level(0)),
        "level8": TINY.replace(phases=PhaseSet.level(8)),
        "level8_hits": TINY.replace(phases=PhaseSet.level(8), requests=tuple(requests), batch_sizes=sizes),
    }
    return dict(zip(configs, run_prefills(list(configs.values()), timeout_s=600)))


@pytest.mark.parametrize("name", ["level0", "level8", "level8_hits"])
def test_tiny_glm53_ranks_match_the_oracle(glm53_reports: dict[str, dict], name: str) -> None:
    rep = glm53_reports[name]
    assert rep["matches_oracle"] is True, rep["problems"]
    assert rep["collectives_identical"]
    # The KDA layers and the indexers ran the Triton kernels (the model's kernel tables), none falling back.
    assert rep["attention_kernel"] == "glm53-kda-triton+indexer-triton", rep["attention_kernel"]
    assert not rep["kernel_fallbacks"], rep["kernel_fallbacks"]


def test_tiny_glm53_level8_shards_materializes_history_and_never_syncs(glm53_reports: dict[str, dict]) -> None:
    base, top = glm53_reports["level0"]["per_rank"], glm53_reports["level8"]["per_rank"]
    assert sum(r["kv_bytes"] for r in top) == base[0]["kv_bytes"]  # every latent row on exactly one rank
    assert max(r["kv_bytes"] for r in top) < base[0]["kv_bytes"]
    assert all(r["materialized_bytes"] > 0 for r in top)  # the prefix and the earlier chunks: history
    assert all(r["host_syncs_in_layer_loop"] == 0 for r in top)

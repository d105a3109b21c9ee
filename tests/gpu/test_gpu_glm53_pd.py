"""GLM-5.3 PD on CUDA (GPU tier): two prefill ranks and the decode share the GPU over gloo; each rank's
blocks are read and copied to pinned host memory on a side stream.

``tiny-glm53`` (every layer type: KDA, an indexed layer with its own indexer, one sharing its selection) and
``glm-5.3-flash`` cut to its first four layers (three KDA layers and an indexed one: the Flash state of
64 x 128 x 128 float32 per head set, 528-byte FP8 rows), at level 8 with chunks and a cached prefix. On a
GPU the decode is compared with the prefill ranks' caches at rest, byte for byte (the CP prefill itself is
checked against the oracle in ``test_gpu_glm53.py``), and its next token with the same step taken here over
the caches it received (the rounding-tolerant rule: kernels may split their reductions differently from one
launch to the next).
"""

from __future__ import annotations

import pytest

from reference_impl.config import PhaseSet, Request, RunConfig
from tests.gpu.pd_decode import check_the_decode_continues

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_ranks]

RUNS = {
    "tiny": RunConfig(
        preset="tiny-glm53",
        cp_size=2,
        device="cuda",
        requests=(Request(301, 1203), Request(0, 911)),
        chunk_size=500,
        phases=PhaseSet.level(8),
    ),
    "flash": RunConfig(
        preset="glm-5.3-flash",
        n_layers=4,
        cp_size=2,
        device="cuda",
        requests=(Request(130, 603), Request(0, 411)),
        chunk_size=300,
        phases=PhaseSet.level(8),
    ),
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def glm53_pd(request):  # noqa: ANN001, ANN201
    from reference_impl.prefill_decode import run_prefill_and_decode

    run = RUNS[request.param]
    return run, run_prefill_and_decode(run, timeout_s=600, transfer="rows")


def test_the_glm53_decode_equals_the_caches_at_rest_and_the_send_never_syncs(glm53_pd) -> None:  # noqa: ANN001
    from reference_impl.families.glm53.pd import request_bytes

    run, result = glm53_pd
    assert result.matches_oracle, result.problems  # on CUDA: against the prefill ranks' caches at rest
    assert not result.oracle_checked and result.next_token_error is None
    assert all(s.bytes_sent == s.bytes_at_rest > 0 for s in result.sent)
    assert result.bytes_received == sum(s.bytes_sent for s in result.sent)
    assert result.bytes_received == sum(request_bytes(run, r.total) for r in run.requests)  # bf16 tails on CUDA
    assert all(p.stats["host_syncs_in_layer_loop"] == 0 for p in result.prefill)
    assert all(s.staging_ms is not None and s.staging_ms > 0 for s in result.sent)  # the side stream's leg
    assert all(0 <= s.staging_hidden_fraction <= 1 for s in result.sent)


def test_the_glm53_decode_continues_from_the_caches_it_received(glm53_pd) -> None:  # noqa: ANN001
    from reference_impl.families.glm53.pd import next_token

    run, result = glm53_pd
    check_the_decode_continues(run, result, next_token)

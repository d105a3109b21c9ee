"""DeepSeek-V4 PD on CUDA at V4-Flash dimensions (GPU tier): two prefill ranks and the decode share
the GPU over gloo; each rank's blocks are read and copied to pinned host memory on a side stream.

``deepseek-v4-flash`` cut to its first four layers (sliding, sliding, CSA, HCA: every layer type). On
a GPU the decode is compared with the prefill ranks' caches at rest, byte for byte (the CP prefill
itself is checked against the V4 oracle in ``test_gpu_v4.py``), and its next token with the same
step taken here over the caches it received (the rounding-tolerant rule: kernels may split their
reductions differently from one launch to the next).
"""

from __future__ import annotations

import pytest

from reference_impl.config import PhaseSet, Request, RunConfig
from tests.gpu.pd_decode import check_the_decode_continues

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_ranks]

FLASH = RunConfig(
    preset="deepseek-v4-flash",
    n_layers=4,
    cp_size=2,
    device="cuda",
    requests=(Request(0, 2501), Request(301, 1203)),
    chunk_size=1001,
    phases=PhaseSet.level(8),
)


@pytest.fixture(scope="module")
def v4_pd():  # noqa: ANN201
    from reference_impl.prefill_decode import run_prefill_and_decode

    return run_prefill_and_decode(FLASH, timeout_s=600, transfer="rows")


def test_the_v4_decode_equals_the_caches_at_rest_and_the_send_never_syncs(v4_pd) -> None:  # noqa: ANN001
    result = v4_pd
    assert result.matches_oracle, result.problems  # on CUDA: against the prefill ranks' caches at rest
    assert not result.oracle_checked and result.next_token_error is None
    assert all(s.bytes_sent == s.bytes_at_rest > 0 for s in result.sent)
    assert result.bytes_received == sum(s.bytes_sent for s in result.sent)
    assert all(p.stats["host_syncs_in_layer_loop"] == 0 for p in result.prefill)
    assert all(s.staging_ms is not None and s.staging_ms > 0 for s in result.sent)  # the side stream's leg
    assert all(0 <= s.staging_hidden_fraction <= 1 for s in result.sent)


def test_the_v4_decode_continues_from_the_caches_it_received(v4_pd) -> None:  # noqa: ANN001
    from reference_impl.families.deepseek_v4.pd import next_token

    check_the_decode_continues(FLASH, v4_pd, next_token)

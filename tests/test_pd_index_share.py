"""PD of an IndexShare run (GLM-5.2's pattern of full and shared indexer layers): index K travels for
the full layers only; the decode keeps index pages for those only; its bytes equal the oracle's."""

from __future__ import annotations

import pytest
import torch

from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig
from reference_impl.kvcache.layout import KVLayout
from reference_impl.pd.dcp import DcpDecodeShard, DcpLayout
from reference_impl.pd.transport import RowBlock
from reference_impl.prefill_decode import run_prefill_and_decode

REQUESTS = (Request(37, 70), Request(0, 45), Request(5, 9))  # prefixes 37 and 5 end mid-page
PAGE = 16


def share_run(**changes) -> RunConfig:  # noqa: ANN003
    base = RunConfig(
        preset="tiny",
        cp_size=2,
        requests=REQUESTS,
        page_size=PAGE,
        phases=PhaseSet.level(3),
        device="cpu",
        index_topk_pattern="FS",  # tiny has two layers: layer 1 reuses layer 0's top-k
    )
    return base.replace(**changes)


@pytest.mark.parametrize("changes", [{}, {"cp_size": 3, "chunk_size": 20}], ids=["C2", "C3-chunked"])
def test_index_share_rows_carry_index_k_for_full_layers_only(changes: dict) -> None:
    run = share_run(**changes)
    result = run_prefill_and_decode(run, transfer="rows")
    assert result.matches_oracle, result.problems  # the rows at rest and the oracle, byte for byte
    layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
    for req, r in enumerate(REQUESTS):
        mla, k_bytes, k_scale = result.rows[0][req]  # full layer
        assert k_bytes.shape == (r.total, layout.index_head_dim) and k_scale.shape == (r.total,)
        mla, k_bytes, k_scale = result.rows[1][req]  # shared layer: none
        assert mla.shape == (r.total, layout.mla_bytes) and k_bytes.shape == (r.total, 0) and k_scale.numel() == 0
    assert all(s.bytes_sent == s.bytes_at_rest > 0 for s in result.sent)
    tokens = sum(r.total for r in REQUESTS)
    one_full_layer = tokens * (layout.mla_bytes * 2 + layout.index_head_dim + 4)  # two layers, index K on one
    assert result.bytes_received == sum(s.bytes_sent for s in result.sent) == one_full_layer


def test_index_share_over_mooncake_writes_no_index_k_on_a_shared_layer() -> None:
    from tests.test_pd_mooncake import require_mooncake

    require_mooncake()
    run = share_run()
    result = run_prefill_and_decode(run, transfer="rows", transport="mooncake")
    assert result.matches_oracle, result.problems
    assert all(s.bytes_sent == s.bytes_at_rest > 0 for s in result.sent)
    assert result.bytes_received == sum(s.bytes_sent for s in result.sent)
    assert all(result.rows[1][req][1].shape[1] == 0 for req in range(len(REQUESTS)))


def test_the_page_transfer_refuses_index_share() -> None:
    with pytest.raises(ConfigError, match="transfer='rows'"):
        run_prefill_and_decode(share_run(phases=PhaseSet.level(2)), transfer="pages")


def test_the_decode_refuses_index_k_on_a_shared_layer_and_its_absence_on_a_full_one() -> None:
    run = share_run()
    layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
    shard = DcpDecodeShard(0, DcpLayout(1, 1), layout, 2, 1, "cpu")
    shard.admit(0, 4)
    mla = torch.zeros(4, layout.mla_bytes, dtype=torch.uint8)
    keys, scales = torch.zeros(4, layout.index_head_dim, dtype=torch.uint8), torch.ones(4)
    no_keys, no_scales = torch.zeros(4, 0, dtype=torch.uint8), torch.zeros(0)
    with pytest.raises(ConfigError, match="layer 1 request 0: the block carries index K"):
        shard.receive(RowBlock(0, 1, torch.arange(4), mla, keys, scales))
    with pytest.raises(ConfigError, match="layer 0 request 0: the block lacks index K"):
        shard.receive(RowBlock(0, 0, torch.arange(4), mla, no_keys, no_scales))
    shard.receive(RowBlock(0, 0, torch.arange(4), mla, keys, scales))
    shard.receive(RowBlock(0, 1, torch.arange(4), mla, no_keys, no_scales))
    shard.check_complete(2)
    with pytest.raises(ConfigError, match="disagree on the row count"):  # index-less rows carry no scales
        RowBlock(0, 1, torch.arange(4), mla, no_keys, scales)

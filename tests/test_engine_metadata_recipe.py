"""The engine-metadata recipe (``scripts/engine_metadata_recipe.py``): SGLang-shaped and vLLM-shaped batch
metadata turned into the reference's split, physical locs and gather plans, checked against the reference's own."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import engine_metadata_recipe as recipe  # noqa: E402
from reference_impl.errors import ConfigError  # noqa: E402


@pytest.mark.parametrize(("cp_size", "page_size", "shuffle"), [(2, 4, None), (4, 8, None), (3, 16, 5), (1, 4, None)])
def test_both_engines_give_the_reference_split_locs_and_gathers(
    cp_size: int, page_size: int, shuffle: int | None
) -> None:
    summary = recipe.run_checks(cp_size, page_size, shuffle)
    checks = summary["checks"]
    assert all(checks.values()), [name for name, ok in checks.items() if not ok]
    # The comparisons with the reference's own allocator run exactly when the pages are its own.
    assert any(name.startswith("reference:") for name in checks) == (shuffle is None)
    assert len(checks) == (19 if shuffle is None else 13)


def test_the_default_batch_matches_the_published_zigzag_and_dual_chunk_swap() -> None:
    """C = 2, extends 12 and 8: SGLang's blocks of 3 and 2 tokens, rank 0 owning blocks 0 and 3 of each; vLLM's
    DualChunkSwap gives rank 0 the same tokens, request by request."""
    summary = recipe.run_checks(2, 4)
    assert summary["rank_tokens"][0] == [0, 1, 2, 12, 13, 9, 10, 11, 18, 19]
    assert summary["vllm_rank_tokens"][0] == [0, 1, 2, 9, 10, 11, 12, 13, 18, 19]
    assert summary["pages"] == [[0, 1, 2, 3, 4], [5, 6]]


def test_vllm_dcp_slot_mapping_keeps_only_the_ranks_positions() -> None:
    """Interleave 1, DCP 2: position t stays on rank t % 2 at slot block * P + (offset // 2), others get -1."""
    block_table = torch.tensor([[7, 9]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 6], dtype=torch.int32)
    positions = torch.arange(2, 8)
    rank1 = recipe.vllm_slot_mapping(block_table, query_start_loc, positions, page_size=4, dcp_size=2, dcp_rank=1)
    # virtual block 0 spans positions 0..7 of block 7: odd positions 3, 5, 7 sit at local offsets 1, 2, 3
    assert rank1.tolist() == [-1, 7 * 4 + 1, -1, 7 * 4 + 2, -1, 7 * 4 + 3]


def test_inconsistent_engine_metadata_is_refused_by_its_field_name() -> None:
    pages = [[0, 1, 2], [3, 4]]
    prefix_lens, extend_lens = [6, 0], [4, 8]
    batch, req_to_token = recipe.sglang_batch(pages, prefix_lens, extend_lens, page_size=4)
    swapped = batch.out_cache_loc.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    with pytest.raises(ConfigError, match="out_cache_loc"):
        recipe.from_sglang(dataclasses.replace(batch, out_cache_loc=swapped), req_to_token)
    md = recipe.vllm_metadata(pages, prefix_lens, extend_lens, page_size=4)
    shifted = md.slot_mapping + 1
    with pytest.raises(ConfigError, match="slot_mapping"):
        recipe.from_vllm(dataclasses.replace(md, slot_mapping=shifted), page_size=4)
    with pytest.raises(ConfigError, match="cp_size"):
        recipe.run_checks(0, 4)


def test_the_command_refuses_a_bad_flag_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert recipe.main(["--cp-size", "0"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --cp-size 0")
    assert recipe.main(["--page-size", "6"]) == 2
    assert "error: --page-size 6" in capsys.readouterr().err
    assert recipe.main(["--json"]) == 0
    assert '"checks"' in capsys.readouterr().out

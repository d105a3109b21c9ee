"""PD of a DeepSeek-V4 cache (``tiny-v4``: sliding, CSA and HCA layers): C prefill processes ship, per
layer and request, their CSA entries and keys and (the replica sender) the HCA entries, window tail and
compressor state; the decode's caches equal the oracle's byte for byte and its next token equals the
oracle's step over the oracle's own caches.

Request lengths are not multiples of 4 or 128: every request has a partial compression block (a
non-empty compressor state) and a window tail that straddles the ranks' blocks.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from reference_impl.cli import main
from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig, parse_batches
from reference_impl.families.deepseek_v4.cache_layout import index_entry_bytes, main_entry_bytes
from reference_impl.families.deepseek_v4.model.cache import V4LayerCache
from reference_impl.families.deepseek_v4.model.compressor import state_start
from reference_impl.families.deepseek_v4.pd import ENTRIES, STATE, WINDOW, V4Decoder, V4PDPayload, parts_of
from reference_impl.pd.transport import RowBlock
from reference_impl.prefill_decode import NEXT_TOKEN_BOUND, PDResult, run_prefill_and_decode

REQUESTS = (Request(0, 203), Request(29, 110))


def v4_run(**changes) -> RunConfig:  # noqa: ANN003
    base = RunConfig(preset="tiny-v4", cp_size=2, requests=REQUESTS, phases=PhaseSet.level(3), device="cpu")
    return base.replace(**changes)


def cache_bytes(run: RunConfig) -> int:
    """A V4 cache's bytes, every request and layer, from the layout's arithmetic alone."""
    cfg, b, bi = run.model, main_entry_bytes(run.kv_dtype), index_entry_bytes(run.kv_dtype, run.model.index_head_dim)
    total = 0
    for r in run.requests:
        n = r.total
        for layer in range(cfg.n_layers):
            m = cfg.ratio(layer)
            total += min(n, cfg.window_size - 1) * b  # the window tail
            if m == 4:  # entries and keys; state: kv and score (2 D each), the indexer's (2 Di each), float32
                total += (n // 4) * (b + bi) + (n - state_start(n, 4)) * (4 * cfg.head_dim + 4 * cfg.index_head_dim) * 4
            elif m:
                total += (n // m) * b + (n - state_start(n, m)) * 2 * cfg.head_dim * 4
    return total


def check_shipped(run: RunConfig, result: PDResult) -> None:
    assert result.matches_oracle, result.problems  # rows at rest and the oracle, byte for byte
    assert result.next_token_error is not None and result.next_token_error <= NEXT_TOKEN_BOUND
    assert [tuple(h.shape) for h in result.next_token] == [(1, run.model.dim)] * len(run.requests)
    assert all(torch.isfinite(h).all() for h in result.next_token)
    blocks = sum(len(parts_of(run.model, layer)) for layer in range(run.model.n_layers)) * len(run.requests)
    for s in result.sent:
        assert s.bytes_sent == s.bytes_at_rest > 0  # every rank stores CSA entries of these requests
        assert s.blocks_sent == s.blocks_sent_in_layer_loop == blocks  # one per part, layer and request
    assert result.bytes_received == sum(s.bytes_sent for s in result.sent) == cache_bytes(run)


@pytest.mark.parametrize(
    "changes",
    [{}, {"cp_size": 3, "chunk_size": 71, "phases": PhaseSet.level(8), "debug": True}],
    ids=["C2", "C3-chunked-level8"],
)
def test_v4_pd_over_torch_matches_the_oracle_and_continues_one_token(changes: dict) -> None:
    run = v4_run(**changes)
    result = run_prefill_and_decode(run, transfer="rows")
    check_shipped(run, result)
    if run.debug:  # level 8 in debug mode: a host sync in the layer loop would have raised
        assert all(p.stats["host_syncs_in_layer_loop"] == 0 for p in result.prefill)


def test_v4_pd_of_several_batches_with_a_prefix_hit() -> None:
    """A request of the second batch reuses 64 tokens of the first batch's request 0 (its entries
    and the checkpoint there); each request ships its whole cache when its batch finishes it."""
    requests, sizes = parse_batches("0+130,21+40;r0:64+20,5+9")
    run = v4_run(requests=tuple(requests), batch_sizes=sizes)
    check_shipped(run, run_prefill_and_decode(run, transfer="rows"))


def test_v4_pd_over_mooncake_matches_the_oracle() -> None:
    from tests.test_pd_mooncake import require_mooncake

    require_mooncake()
    run = v4_run(phases=PhaseSet.level(5))
    result = run_prefill_and_decode(run, transfer="rows", transport="mooncake")
    check_shipped(run, result)
    assert result.protocol in ("tcp", "rdma") and all(s.protocol == result.protocol for s in result.sent)


def _blocks(run: RunConfig, stored: list, rank: int, replica: int) -> list[RowBlock]:
    """What ``rank`` ships, rebuilt from its rows at rest (``RankResult.stored``): its CSA entries,
    and the replicated parts when it is ``replica``."""
    cfg, out = run.model, []
    for layer, per_request in enumerate(stored):
        for req, (_, tail, pool, ids, entries, index) in per_request.items():
            n = run.requests[req].total
            m = cfg.ratio(layer)
            parts = {WINDOW: (torch.arange(n - tail.shape[0], n), tail)}
            if m:
                parts[STATE] = (torch.arange(n - pool.shape[0], n), pool.contiguous().view(torch.uint8))
                parts[ENTRIES] = (ids, torch.cat([entries, index], dim=1))
            for part, (positions, rows) in parts.items():
                if rank == replica or (part == ENTRIES and m == 4):
                    empty = rows.new_empty(rows.shape[0], 0)
                    out.append(RowBlock(req, layer, positions, rows, empty, torch.zeros(0), part))
    return out


def test_a_rank_left_out_or_a_replica_shipped_twice_is_caught() -> None:
    """The decode books every row once: a rank's entries missing, or the replicated parts from two
    ranks, is an error naming the row; the caches without a rank's entries compare unequal."""
    run = v4_run()
    result = run_prefill_and_decode(run, transfer="rows")
    assert result.matches_oracle, result.problems
    stored = [p.stored for p in result.prefill]
    payload = V4PDPayload(run)
    decoded = SimpleNamespace(caches=result.rows)  # the full transfer's caches (equal to the oracle's)

    whole = V4Decoder(run)
    for rank in range(run.cp_size):
        for block in _blocks(run, stored[rank], rank, replica=0):
            whole.receive(block)
    whole.check_complete()
    assert payload.oracle_mismatches(whole.caches(), decoded) == []

    partial = V4Decoder(run)
    for block in _blocks(run, stored[0], 0, replica=0):  # rank 1's CSA entries never arrive
        partial.receive(block)
    with pytest.raises(ConfigError, match=r"layer 1: the decode's entries row at position \d+ arrived 0 times"):
        partial.check_complete()
    problems = payload.oracle_mismatches(partial.caches(), decoded)
    assert problems and all("entries differs" in p or "indexer keys differs" in p for p in problems)

    twice = V4Decoder(run)
    for block in _blocks(run, stored[0], 0, replica=0):
        twice.receive(block)
    replicated = [
        b for b in _blocks(run, stored[1], 1, replica=1) if b.part != ENTRIES or run.model.ratio(b.layer) != 4
    ]
    with pytest.raises(ConfigError, match="row arrived twice"):
        twice.receive(replicated[0])


def test_a_block_of_the_wrong_width_or_beyond_the_request_is_refused() -> None:
    run = v4_run()
    decoder = V4Decoder(run)
    b = main_entry_bytes(run.kv_dtype)
    window = torch.zeros(3, b, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="window tail rows of 583 bytes, the decode's are 584"):
        decoder.receive(RowBlock(0, 0, torch.arange(200, 203), window[:, 1:], window[:, :0], torch.zeros(0), WINDOW))
    with pytest.raises(ConfigError, match=r"window tail positions 201..203 outside the decode's \[76, 203\)"):
        decoder.receive(RowBlock(0, 0, torch.arange(201, 204), window, window[:, :0], torch.zeros(0), WINDOW))
    with pytest.raises(ConfigError, match="layer 0: the decode keeps no entries rows there"):  # a sliding layer
        decoder.receive(RowBlock(0, 0, torch.arange(3), window, window[:, :0], torch.zeros(0), ENTRIES))


def test_a_cache_holding_only_its_window_tail_reads_the_window_a_full_cache_reads() -> None:
    g = torch.Generator().manual_seed(0)
    full = V4LayerCache.empty("fp8", 0, 512, 128, "cpu")
    full.n_tokens = 300
    full.raw = torch.randint(0, 256, (300, main_entry_bytes("fp8")), dtype=torch.uint8, generator=g)
    tail = V4LayerCache.empty("fp8", 0, 512, 128, "cpu")
    tail.n_tokens, tail.raw_start, tail.raw = 300, 173, full.raw[173:]  # the last window - 1 = 127 rows
    for window in (128, 64):
        assert torch.equal(tail.window_tail(window), full.window_tail(window))


def test_the_pd_command_ships_a_v4_cache(capsys) -> None:
    argv = ["pd", "--preset", "tiny-v4", "--cp-size", "2", "--requests", "29+110,0+203", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["decode_matches_oracle"] is True and doc["transfer"] == "rows", doc["problems"]
    assert doc["decode_next_token_error"] is not None and doc["decode_next_token_error"] <= NEXT_TOKEN_BOUND
    assert all(r["bytes_sent"] == r["bytes_at_rest"] for r in doc["prefill_ranks"])
    assert main(["pd", "--preset", "tiny-v4", "--transfer", "pages"]) == 2
    assert "tiny-v4 ships its own cache parts as rows: use transfer='rows'" in capsys.readouterr().err

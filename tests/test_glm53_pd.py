"""PD of a GLM-5.3 cache (``tiny-glm53``: KDA layers, an indexed layer with its own indexer and one sharing
its selection): C prefill processes ship, per layer and request, their latent rows and group keys and (the
replica sender) the KDA states, convolution tails and pending indexer rows; the decode's caches equal the
rows the prefill ranks held at rest byte for byte, the oracle's within the family check's bounds, and its
next token the oracle's step over the oracle's own caches within the PD bound.

Request lengths are not multiples of the 16-token group: every request has pending indexer rows, and
its groups straddle the ranks' blocks.
"""

from __future__ import annotations

import json

import pytest
import torch

from reference_impl.cli import main
from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig
from reference_impl.cp.ownership import Ownership
from reference_impl.engine import request_locs
from reference_impl.families.glm53.check import decode_cache_mismatches
from reference_impl.families.glm53.model.oracle import DSACache
from reference_impl.families.glm53.pd import (
    CONV,
    KEYS,
    LATENT,
    PENDING,
    STATE,
    Glm53Decoder,
    Glm53PDPayload,
    bytes_at_rest,
    parts_of,
    request_bytes,
)
from reference_impl.pd.transport import RowBlock
from reference_impl.prefill_decode import NEXT_TOKEN_BOUND, PDResult, run_prefill_and_decode

REQUESTS = (Request(0, 203), Request(29, 110))


def glm_run(**changes) -> RunConfig:  # noqa: ANN003
    base = RunConfig(preset="tiny-glm53", cp_size=2, requests=REQUESTS, phases=PhaseSet.level(3), device="cpu")
    return base.replace(**changes)


def cache_bytes(run: RunConfig) -> int:
    """A GLM-5.3 cache's bytes, every request and layer, from the dimensions alone (float32 on CPU)."""
    cfg = run.model
    latent = 256 + 2 * 4 if run.kv_dtype == "fp8" else 256 * 2  # tiny: 256 codes and two tile scales, or bf16
    assert cfg.kv_lora_rank == 256 and cfg.index_kpool == 16
    total = 0
    for r in run.requests:
        n = r.total
        for layer in range(cfg.n_layers):
            if cfg.is_kda(layer):  # float32 state [2, 16, 16]; tail [3, 3 * 2 * 16] float32
                total += 2 * 16 * 16 * 4 + 3 * 96 * 4
            elif cfg.shares_selection(layer):
                total += n * latent
            else:  # rows, group keys (16 float32), pending keys and gates (16 float32 each)
                total += n * latent + (n // 16) * 16 * 4 + (n % 16) * 2 * 16 * 4
    return total


def check_shipped(run: RunConfig, result: PDResult) -> None:
    assert result.matches_oracle, result.problems  # rows at rest byte for byte, the oracle within bounds
    assert result.next_token_error is not None and result.next_token_error <= NEXT_TOKEN_BOUND
    assert [tuple(h.shape) for h in result.next_token] == [(1, run.model.dim)] * len(run.requests)
    assert all(torch.isfinite(h).all() for h in result.next_token)
    blocks = sum(len(parts_of(run.model, layer)) for layer in range(run.model.n_layers)) * len(run.requests)
    for s in result.sent:
        assert s.bytes_sent == s.bytes_at_rest > 0  # every rank stores latent rows of these requests
        assert s.blocks_sent == s.blocks_sent_in_layer_loop == blocks  # one per part, layer and request
    assert result.bytes_received == sum(s.bytes_sent for s in result.sent) == cache_bytes(run)
    assert sum(request_bytes(run, r.total) for r in run.requests) == cache_bytes(run)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"cp_size": 3, "chunk_size": 71, "phases": PhaseSet.level(8), "debug": True},
        {"cp_size": 3, "split_mode": "round-robin", "chunk_size": 64},
        {"kv_dtype": "bf16", "kv_interleave": 1},
    ],
    ids=["C2", "C3-chunked-level8", "C3-round-robin-chunked", "C2-bf16-token-interleave"],
)
def test_glm53_pd_over_torch_matches_and_continues_one_token(changes: dict) -> None:
    run = glm_run(**changes)
    result = run_prefill_and_decode(run, transfer="rows")
    check_shipped(run, result)
    if run.debug:  # level 8 in debug mode: a host sync in the layer loop would have raised
        assert all(p.stats["host_syncs_in_layer_loop"] == 0 for p in result.prefill)


def test_glm53_pd_over_mooncake_matches() -> None:
    from tests.test_pd_mooncake import require_mooncake

    require_mooncake()
    run = glm_run(phases=PhaseSet.level(5))
    result = run_prefill_and_decode(run, transfer="rows", transport="mooncake")
    check_shipped(run, result)
    assert result.protocol in ("tcp", "rdma") and all(s.protocol == result.protocol for s in result.sent)


def test_the_replica_sender_owns_the_last_token_and_ships_every_replicated_byte() -> None:
    """Per request, only the owner of its last token's slot counts the KDA states, tails and pending rows;
    every rank counts the latent rows and group keys it owns; together, the cache's whole arithmetic."""
    run = glm_run(requests=(Request(0, 150),), cp_size=3)
    locs = request_locs(run)[0]
    owner = Ownership(3, run.interleave, run.page_size).owner(locs[:150])
    replicated = 2 * (2 * 16 * 16 * 4 + 3 * 96 * 4) + (150 % 16) * 2 * 16 * 4  # KDA layers 0 and 3; pending on 1
    assert int(owner[149]) == 2  # not rank 0: a sender fixed on rank 0 would fail
    for rank in range(3):
        rows = int((owner == rank).sum())  # latent rows on layers 1 and 2
        groups = int((owner[15::16] == rank).sum())  # group keys on layer 1, by their last token
        sharded = 2 * rows * 264 + groups * 16 * 4
        extra = replicated if rank == int(owner[149]) else 0
        assert rows and bytes_at_rest(run, rank, request_locs(run)) == sharded + extra
    assert sum(bytes_at_rest(run, rank, request_locs(run)) for rank in range(3)) == cache_bytes(run)


def _blocks(run: RunConfig, stored: list, decoded: list, rank: int, sharded: bool, replicated: bool) -> list[RowBlock]:
    """What ``rank`` ships, rebuilt from its rows at rest (``RankResult.stored``): its latent rows and group
    keys when ``sharded``; when ``replicated``, the KDA states and tails (its own copies) and the pending rows
    (from a decoded cache: a rank does not report them)."""
    cfg, out = run.model, []

    def block(req: int, layer: int, positions: torch.Tensor, rows: torch.Tensor, part: int) -> RowBlock:
        rows = rows.contiguous().view(torch.uint8)
        return RowBlock(req, layer, positions, rows, rows.new_empty(len(rows), 0), torch.zeros(0), part)

    for layer, per_request in enumerate(stored):
        for req, held in per_request.items():
            n = run.requests[req].total
            if cfg.is_kda(layer):
                if replicated:
                    state, conv = held
                    out.append(block(req, layer, torch.arange(2), state.reshape(2, -1), STATE))
                    out.append(block(req, layer, torch.arange(3), conv, CONV))
                continue
            positions, rows, ids, keys = held
            if sharded:
                out.append(block(req, layer, positions, rows, LATENT))
                if ids is not None:
                    out.append(block(req, layer, ids, keys, KEYS))
            cache = decoded[layer][req]
            assert isinstance(cache, DSACache)
            if replicated and cache.pending_k is not None and cache.pending_gate is not None:
                pending = torch.cat([cache.pending_k, cache.pending_gate], dim=1)
                out.append(block(req, layer, torch.arange(n - len(pending), n), pending, PENDING))
    return out


def test_a_rank_left_out_or_the_replicated_parts_twice_or_never_are_caught() -> None:
    """The decode books every row once: a rank's rows missing, or the replicated parts from two ranks or
    from none, is an error naming the row; the caches without a rank's rows differ from the ranks' at rest."""
    run = glm_run()
    result = run_prefill_and_decode(run, transfer="rows")
    assert result.matches_oracle, result.problems
    stored, decoded = [p.stored for p in result.prefill], result.rows
    payload = Glm53PDPayload(run, decode_cache_mismatches)

    whole = Glm53Decoder(run)
    for rank in range(2):
        for b in _blocks(run, stored[rank], decoded, rank, sharded=True, replicated=rank == 0):
            whole.receive(b)
    whole.check_complete()
    assert payload.store_mismatches(whole.caches(), stored) == []

    partial = Glm53Decoder(run)
    for b in _blocks(run, stored[0], decoded, 0, sharded=True, replicated=True):  # rank 1's rows never arrive
        partial.receive(b)
    with pytest.raises(ConfigError, match=r"layer 1: the decode's latent row at position \d+ arrived 0 times"):
        partial.check_complete()
    problems = payload.store_mismatches(partial.caches(), stored)
    assert problems and all(
        "latent rows differ from rank 1" in p or "group keys differ from rank 1" in p for p in problems
    )

    never = Glm53Decoder(run)
    for rank in range(2):
        for b in _blocks(run, stored[rank], decoded, rank, sharded=True, replicated=False):
            never.receive(b)
    with pytest.raises(ConfigError, match=r"layer 0: the decode's KDA state row at position 0 arrived 0 times"):
        never.check_complete()

    twice = Glm53Decoder(run)
    for b in _blocks(run, stored[0], decoded, 0, sharded=True, replicated=True):
        twice.receive(b)
    replicated = _blocks(run, stored[1], decoded, 1, sharded=False, replicated=True)
    assert {b.part for b in replicated} == {STATE, CONV, PENDING}
    for b in replicated:
        with pytest.raises(ConfigError, match="row arrived twice"):
            twice.receive(b)


def test_a_block_of_the_wrong_width_or_beyond_the_request_is_refused() -> None:
    run = glm_run()
    decoder = Glm53Decoder(run)
    rows = torch.zeros(3, 264, dtype=torch.uint8)  # tiny's FP8 row: 256 codes and two float32 scales
    empty = torch.zeros(0)
    with pytest.raises(ConfigError, match="latent rows of 263 bytes, the decode's are 264"):
        decoder.receive(RowBlock(0, 1, torch.arange(3), rows[:, 1:], rows[:, :0], empty, LATENT))
    with pytest.raises(ConfigError, match=r"latent positions 201..203 outside the decode's \[0, 203\)"):
        decoder.receive(RowBlock(0, 1, torch.arange(201, 204), rows, rows[:, :0], empty, LATENT))
    with pytest.raises(ConfigError, match="layer 2: the decode keeps no group key rows there"):  # shares its selection
        decoder.receive(RowBlock(0, 2, torch.arange(3), rows, rows[:, :0], empty, KEYS))
    with pytest.raises(ConfigError, match=r"pending indexer positions 0..2 outside the decode's \[192, 203\)"):
        decoder.receive(RowBlock(0, 1, torch.arange(3), rows[:, :128], rows[:, :0], empty, PENDING))


def test_the_pd_command_ships_a_glm53_cache(capsys) -> None:
    # 0+96: a request with no incomplete group (its pending rows are empty)
    argv = ["pd", "--preset", "tiny-glm53", "--cp-size", "2", "--requests", "29+110,0+96", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["decode_matches_oracle"] is True and doc["transfer"] == "rows", doc["problems"]
    assert doc["decode_matches_prefill"] is True
    assert doc["decode_oracle_check"].startswith("within the family check's bounds")
    assert doc["decode_next_token_error"] is not None and doc["decode_next_token_error"] <= NEXT_TOKEN_BOUND
    assert all(r["bytes_sent"] == r["bytes_at_rest"] > 0 for r in doc["prefill_ranks"])
    assert doc["bytes_received"] == cache_bytes(glm_run(requests=(Request(29, 110), Request(0, 96))))
    assert main(["pd", "--preset", "tiny-glm53", "--transfer", "pages"]) == 2
    err = capsys.readouterr().err
    assert "tiny-glm53 ships its own cache parts as rows: use transfer='rows'" in err and err.count("\n") == 1


def test_the_flash_bytes_the_pages_quote() -> None:
    """docs/glm-5.3.md and docs/pd-transfer.md render a Flash request's bytes (FP8 rows, bf16 on CUDA) from the
    planner's results: the planner's figures are the PD payload's arithmetic."""
    import json
    from pathlib import Path

    run = RunConfig(preset="glm-5.3-flash", cp_size=8, device="cuda", requests=(Request(0, 1 << 17),))
    kda = request_bytes(run, 0)  # no token: the KDA layers' states and tails alone
    assert kda == 34 * (64 * 128 * 128 * 4 + 3 * 3 * 64 * 128 * 2) == 147_619_840
    per_token = (request_bytes(run, 16) - kda) // 16
    assert per_token * 16 == request_bytes(run, 16) - kda == 16 * 11 * (528 + 128 * 4 // 16)
    docs = Path(__file__).resolve().parent.parent / "docs"
    plan = json.loads((docs / "results" / "glm53_planner.json").read_text())
    flash = next(r for r in plan["table"] if r["model"] == "glm-5.3-flash" and r["kv_dtype"] == "fp8")
    assert flash["bytes_per_request"] == kda and flash["bytes_per_token"] == per_token
    point = next(p for p in plan["points"] if p["context"] == 1 << 17 and not p["sharded"])
    assert point["bytes_at_rest"]["fp8"]["total"] == request_bytes(run, 1 << 17) == 955_023_360
    layer = plan["bytes_per_request_per_layer"]
    assert 34 * (layer["kda_state"] + layer["kda_conv_tail"]) == kda
    page, pd_page = (docs / "glm-5.3.md").read_text(), (docs / "pd-transfer.md").read_text()
    assert ").bytes_per_request -->147,619,840<!-- /fig -->" in page and ").bytes_per_token -->6,160<" in page
    assert "bytes_at_rest.fp8.total -->955,023,360<!-- /fig -->" in page
    assert "kda_conv_tail -->4,341,760<!-- /fig -->" in pd_page


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ("never", r"layer 0: the decode's KDA state row at position 0 arrived 0 times"),
        ("twice", r"request 0 layer 0: a KDA state row arrived twice"),
        ("rank 1 keeps its rows", r"layer 1: the decode's latent row at position \d+ arrived 0 times"),
    ],
)
def test_a_whole_run_whose_ranks_ship_the_wrong_parts_fails(monkeypatch, patch: str, message: str) -> None:
    """End to end (the ranks fork, so the patch reaches them): no rank shipping the replicated parts, every
    rank shipping them, or rank 1 shipping none of its rows; each rank's bytes sent still equal its own
    (patched) count, and the decode names the row that arrived zero times or twice."""
    from reference_impl.families.glm53 import pd

    if patch == "rank 1 keeps its rows":
        owned = pd.owned_rows
        monkeypatch.setattr(
            pd,
            "owned_rows",
            lambda own, rank, cfg, locs, part: owned(own, rank, cfg, locs, part)[: 0 if rank else None],
        )
    else:
        monkeypatch.setattr(pd, "ships_replicas", lambda own, locs, rank: patch == "twice")
    with pytest.raises(ConfigError, match=message):
        run_prefill_and_decode(glm_run(), transfer="rows")


def test_glm53_pd_of_several_batches_with_a_prefix_hit() -> None:
    """A request of the second batch reuses 64 tokens of the first batch's request 0; each request ships its
    whole cache when its batch finishes it. Runs once the family runs several batches (a long-lived pool)."""
    from reference_impl.config import parse_batches

    requests, sizes = parse_batches("0+130,21+40;r0:64+20,5+9")
    try:
        run = glm_run(requests=tuple(requests), batch_sizes=sizes)  # the config asks the family (check_run)
    except ConfigError as refused:
        pytest.skip(f"GLM-5.3 refuses this run: {refused}")
    check_shipped(run, run_prefill_and_decode(run, transfer="rows"))


def test_the_decode_process_is_sized_with_its_arena() -> None:
    """The memory check counts the decode's arena: one more request adds its cache's bytes (times the margin)."""
    from reference_impl.families.glm53.family import FAMILY
    from reference_impl.footprint import SAFETY

    one, two = glm_run(requests=REQUESTS[:1]), glm_run()
    added = FAMILY.decode_bytes(two) - FAMILY.decode_bytes(one)
    assert added == pytest.approx(SAFETY * request_bytes(two, REQUESTS[1].total), abs=1)
    assert FAMILY.decode_bytes(one) > cache_bytes(one)

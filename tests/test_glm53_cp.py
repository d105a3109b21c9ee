"""GLM-5.3 through the CP engine against its oracle: every phase level (0, 2, 3 and 8 at C = 2, 3 and 4;
4 to 7 once each), unaligned requests (a cached prefix of 37 tokens, extends of 61 and 45) and chunks
(17, 23: not multiples of the 16-token group, the blocks or the pages); the KDA state hand-off measured
by its collective's tag; phase 3's materialization counted to the byte; phase 5's direct writes; and
the checks failing when the hand-off is skipped, a group key is owned by the wrong token or a direct
write lands on a rank that does not own the row."""

from __future__ import annotations

import functools

import pytest
import torch

import reference_impl as ri
from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.families.glm53 import config as glm53_config
from reference_impl.families.glm53.cp import step as glm53_step
from reference_impl.schedule import chunk_schedule

PRESET = "tiny-glm53"
REQUESTS = (Request(37, 61), Request(0, 45))
NO_PREFIX = (Request(0, 45), Request(0, 29))
# Prefix and extends on page boundaries (pages of 4): phase 5's direct writes apply to every chunk of 24.
ALIGNED = (Request(36, 60), Request(0, 48))


def _run(level: int, cp_size: int, chunk: int | None, requests: tuple[Request, ...] = REQUESTS) -> RunConfig:
    return RunConfig(
        preset=PRESET,
        cp_size=cp_size,
        phases=PhaseSet.level(level),
        page_size=4,
        chunk_size=chunk,
        kv_dtype="bf16",
        requests=requests,
        device="cpu",
    )


@functools.cache
def _report(level: int, cp_size: int, chunk: int | None, requests: tuple[Request, ...] = REQUESTS) -> dict:
    """One run's report (runs are shared between the tests that read them: the CPU is shared too)."""
    return ri.run_prefill(_run(level, cp_size, chunk, requests))


@pytest.mark.parametrize(
    ("level", "cp_size", "chunk"),
    [
        (0, 2, None),
        (0, 3, 17),
        (0, 4, 23),
        (2, 2, 23),
        (2, 3, None),
        (2, 4, 17),
        (3, 2, 17),
        (3, 3, 23),
        (3, 4, None),
        (8, 2, 23),
        (8, 3, None),
        (8, 4, 17),
        (4, 3, 23),
        (5, 2, 23),
        (6, 4, None),
        (7, 3, 17),
    ],
)
def test_cp_matches_the_oracle(level: int, cp_size: int, chunk: int | None) -> None:
    run = _run(level, cp_size, chunk)
    report = _report(level, cp_size, chunk)
    assert report["matches_oracle"], report["problems"]
    if level >= 6:  # the layer loop reads nothing from the device (the API audit, on a CPU)
        assert all(r["host_syncs_in_layer_loop"] == 0 for r in report["per_rank"])
    cfg = run.model
    tokens = sum(r.total for r in run.requests)
    latent = [r["kv_bytes"] for r in report["per_rank"]]
    keys = [r["index_bytes"] for r in report["per_rank"]]
    latent_all = tokens * cfg.count(glm53_config.DSA) * cfg.kv_lora_rank * 2
    groups = sum(r.total // cfg.index_kpool for r in run.requests)
    keys_all = groups * (cfg.count(glm53_config.DSA) - 1) * cfg.index_head_dim * 4  # one layer shares its selection
    if level >= 2:  # every latent row and every group key on exactly one rank
        assert sum(latent) == latent_all and sum(keys) == keys_all and max(latent) < latent_all
    else:
        assert latent == [latent_all] * cp_size and keys == [keys_all] * cp_size


@pytest.mark.parametrize("cp_size", [2, 3])
def test_the_state_hand_off_bytes(cp_size: int) -> None:
    """One request, one chunk: every rank receives the maps of the other ranks' two blocks per KDA layer,
    float32 ``[heads, Dk, Dk + Dv]`` each, and their convolution tails."""
    run = _run(2, cp_size, None, (Request(0, 50),))
    report = ri.run_prefill(run)
    assert report["matches_oracle"], report["problems"]
    cfg = run.model
    kda_layers = cfg.count(glm53_config.KDA)
    per_block = cfg.linear_num_heads * cfg.linear_head_dim * 2 * cfg.linear_head_dim * 4
    halo = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * 4
    for rank in report["per_rank"]:
        assert rank["kda_map_bytes_received"] == kda_layers * (cp_size - 1) * 2 * per_block
        assert rank["kda_halo_bytes_received"] == kda_layers * (cp_size - 1) * 2 * halo


def _materialized_bytes(run: RunConfig, history_only: bool) -> int:
    """What every rank's materializations bring over the run: per chunk and request, the latent rows of
    every indexed layer and the group keys of every layer with its own indexer, from position 0 up to the
    chunk's start (phase 3: the history) or its end (phase 2)."""
    cfg = run.model
    dsa = [layer for layer in range(cfg.n_layers) if not cfg.is_kda(layer)]
    own_indexer = [layer for layer in dsa if not cfg.shares_selection(layer)]
    total = 0
    for chunk in chunk_schedule(run):
        for prefix, extend in zip(chunk.prefix_lens, chunk.extend_lens):
            rows = prefix if history_only else prefix + extend
            total += rows * cfg.kv_lora_rank * 2 * len(dsa)
            total += rows // cfg.index_kpool * cfg.index_head_dim * 4 * len(own_indexer)
    return total


@pytest.mark.parametrize("cp_size", [3, 4])
def test_current_reuse_materializes_only_the_history(cp_size: int) -> None:
    """Levels 2, 3 and 8 of one run agree with the oracle; level 3 materializes the history alone (fewer
    bytes than level 2, each to the byte), and level 8 the same bytes, one layer ahead."""
    run2, run3 = _run(2, cp_size, 23), _run(3, cp_size, 23)
    full, history = _materialized_bytes(run2, False), _materialized_bytes(run3, True)
    assert 0 < history < full
    for level, want in ((2, full), (3, history), (8, history)):
        report = _report(level, cp_size, 23)
        assert report["matches_oracle"], (level, report["problems"])
        assert [r["materialized_bytes"] for r in report["per_rank"]] == [want] * cp_size, level
        # Level 8 materializes under the prefetch's tag, the others in the layer itself.
        prefetched = [r["prefetch_bytes_received"] for r in report["per_rank"]]
        in_layer = [r["view_bytes_received"] for r in report["per_rank"]]
        assert (min(prefetched) > 0 and max(in_layer) == 0) if level == 8 else (max(prefetched) == 0 < min(in_layer))


@pytest.mark.parametrize(("level", "cp_size", "chunk"), [(8, 3, None), (3, 4, 17)])
def test_without_a_cached_prefix(level: int, cp_size: int, chunk: int | None) -> None:
    """No request has a cached prefix: one chunk materializes nothing (no history); in chunks, the later
    chunks materialize what the earlier ones stored, to the byte."""
    run = _run(level, cp_size, chunk, NO_PREFIX)
    report = _report(level, cp_size, chunk, NO_PREFIX)
    assert report["matches_oracle"], report["problems"]
    want = _materialized_bytes(run, True)
    assert (want == 0) == (chunk is None)
    assert [r["materialized_bytes"] for r in report["per_rank"]] == [want] * cp_size


@pytest.mark.parametrize(("level", "chunk"), [(5, None), (8, 24)])
def test_direct_writes_match_the_oracle(level: int, chunk: int | None) -> None:
    """Page-aligned requests and chunks: each rank writes the latent rows it computes straight into its
    table (store path ``direct``), every row still on exactly one rank."""
    report = _report(level, 2, chunk, ALIGNED)
    assert report["matches_oracle"], report["problems"]
    assert "direct" in report["store_path"].split("+")


def _fork(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSACP_RANK_THREADS", "1")  # fork: the patch reaches the ranks


def test_skipping_the_state_hand_off_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block entering with the request's cached state (not the earlier blocks') is caught."""
    real = glm53_step.entering_states

    def no_hand_off(initial: torch.Tensor, maps: list) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [initial] * len(maps), real(initial, maps)[1]

    monkeypatch.setattr(glm53_step, "entering_states", no_hand_off)
    _fork(monkeypatch)
    report = ri.run_prefill(_run(2, 2, 23))
    assert not report["matches_oracle"] and any("hidden states" in p for p in report["problems"])


@pytest.mark.parametrize("level", [2, 3])
def test_a_wrong_group_owner_fails(monkeypatch: pytest.MonkeyPatch, level: int) -> None:
    """Group keys written at the group's first token instead of its last: missing keys are caught."""
    from reference_impl.families.glm53.cp.store import Glm53Store

    real = Glm53Store.write_group_keys
    P = glm53_config.PRESETS[PRESET].index_kpool
    monkeypatch.setattr(
        Glm53Store, "write_group_keys", lambda self, layer, ends, keys: real(self, layer, ends - (P - 1), keys)
    )
    _fork(monkeypatch)
    report = ri.run_prefill(_run(level, 2, None))
    assert not report["matches_oracle"]


def test_a_direct_write_the_layout_does_not_allow_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase 5 forced on chunks whose prefix ends mid-page (that page's owner was fixed before): a rank
    writes rows another rank owns, the next chunk materializes them from their owner, and the outputs
    differ."""
    monkeypatch.setattr(glm53_step, "direct_write_ok", lambda *args: True)
    _fork(monkeypatch)
    report = ri.run_prefill(_run(5, 2, 23))
    assert not report["matches_oracle"] and any("hidden states" in p for p in report["problems"])


def test_refusals_name_the_knob() -> None:
    with pytest.raises(ri.ConfigError, match="split_mode=round-robin"):
        RunConfig(preset=PRESET, split_mode="round-robin", kv_dtype="bf16", device="cpu")
    with pytest.raises(ri.ConfigError, match="kv_dtype=fp8"):
        RunConfig(preset=PRESET, device="cpu")
    for level in range(3, 9):  # every level is built
        assert RunConfig(preset=PRESET, kv_dtype="bf16", phases=PhaseSet.level(level), device="cpu").phases

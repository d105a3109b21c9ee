"""GLM-5.3 through the CP engine against its oracle, with FP8 latent rows (the default) unless a test says
bf16: levels 0, 2, 3 and 8 at C = 2, 3 and 4, levels 1 and 4 to 7 once each, the round-robin split at levels 0,
2, 3 and 8 (its KDA layers re-split into contiguous blocks); unaligned requests (a cached prefix of 37
tokens, extends of 61 and 45) and chunks (17, 23: not multiples of the 16-token group, the blocks or the
pages); the KDA state hand-off and the re-split measured by their collectives' tags; phase 3's
materialization counted to the byte and its view of the current chunk equal, bit for bit, to what a
materialization brings; phase 5's direct writes; and the checks failing when the hand-off is skipped, a
group key is owned by the wrong token, a direct write lands on a rank that does not own the row, the
re-split takes its blocks in the wrong order or the rows are quantized in another scale format than the
oracle's."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

import reference_impl as ri
from reference_impl.config import KVDtype, PhaseSet, Request, RunConfig, SplitMode
from reference_impl.families.glm53 import config as glm53_config
from reference_impl.families.glm53.config import Glm53Config
from reference_impl.families.glm53.cp import step as glm53_step
from reference_impl.schedule import chunk_schedule

PRESET = "tiny-glm53"
REQUESTS = (Request(37, 61), Request(0, 45))
NO_PREFIX = (Request(0, 45), Request(0, 29))
# Prefix and extends on page boundaries (pages of 4): phase 5's direct writes apply to every chunk of 24.
ALIGNED = (Request(36, 60), Request(0, 48))


def _run(
    level: int,
    cp_size: int,
    chunk: int | None,
    requests: tuple[Request, ...] = REQUESTS,
    kv_dtype: KVDtype = "fp8",
    split_mode: SplitMode = "in-seq",
) -> RunConfig:
    """Level ``level`` as ``split_mode`` runs it (round-robin drops phases 4 and 5, the in-seq split's own)."""
    return RunConfig(
        preset=PRESET,
        cp_size=cp_size,
        phases=PhaseSet.level(level).for_split(split_mode),
        page_size=4,
        chunk_size=chunk,
        kv_dtype=kv_dtype,
        split_mode=split_mode,
        requests=requests,
        device="cpu",
    )


@functools.cache
def _report(
    level: int,
    cp_size: int,
    chunk: int | None,
    requests: tuple[Request, ...] = REQUESTS,
    kv_dtype: KVDtype = "fp8",
    split_mode: SplitMode = "in-seq",
) -> dict:
    """One run's report (runs are shared between the tests that read them: the CPU is shared too)."""
    return ri.run_prefill(_run(level, cp_size, chunk, requests, kv_dtype, split_mode))


def _row_bytes(cfg: Glm53Config, kv_dtype: KVDtype) -> int:
    """A stored latent row: the FP8 row (codes + a float32 scale per 128 values) or bf16 values."""
    return cfg.kv_lora_rank + cfg.kv_lora_rank // 128 * 4 if kv_dtype == "fp8" else cfg.kv_lora_rank * 2


def _check_held_bytes(run: RunConfig, report: dict) -> None:
    """From phase 2 every latent row and every group key on exactly one rank; before it on every rank."""
    cfg, cp_size = run.model, run.cp_size
    tokens = sum(r.total for r in run.requests)
    latent = [r["kv_bytes"] for r in report["per_rank"]]
    keys = [r["index_bytes"] for r in report["per_rank"]]
    latent_all = tokens * cfg.count(glm53_config.DSA) * _row_bytes(cfg, run.kv_dtype)
    groups = sum(r.total // cfg.index_kpool for r in run.requests)
    keys_all = groups * (cfg.count(glm53_config.DSA) - 1) * cfg.index_head_dim * 4  # one layer shares its selection
    if run.phases.sharded_kv:
        assert sum(latent) == latent_all and sum(keys) == keys_all and max(latent) < latent_all
    else:
        assert latent == [latent_all] * cp_size and keys == [keys_all] * cp_size


# Levels 0, 2, 3 and 8 at every C of 2, 3 and 4 (the chunk rotating over one chunk, 17 and 23), levels 4 to
# 7 once each, all with FP8 rows; then bf16 rows at a few points.
MATRIX = [
    (level, cp_size, (None, 17, 23)[(n + cp_size) % 3], "fp8")
    for n, level in enumerate((0, 2, 3, 8))
    for cp_size in (2, 3, 4)
] + [(1, 2, 17, "fp8"), (4, 3, 23, "fp8"), (5, 2, 23, "fp8"), (6, 4, None, "fp8"), (7, 3, 17, "fp8")]
MATRIX += [(0, 2, None, "bf16"), (2, 3, 23, "bf16"), (8, 4, 17, "bf16")]


@pytest.mark.parametrize(("level", "cp_size", "chunk", "kv_dtype"), MATRIX)
def test_cp_matches_the_oracle(level: int, cp_size: int, chunk: int | None, kv_dtype: KVDtype) -> None:
    run = _run(level, cp_size, chunk, kv_dtype=kv_dtype)
    report = _report(level, cp_size, chunk, kv_dtype=kv_dtype)
    assert report["matches_oracle"], report["problems"]
    assert report["attention_kernel"] == "glm53-kda-torch+indexer-torch"  # a CPU run: the tables' torch paths
    if level >= 6:  # the layer loop reads nothing from the device (the API audit, on a CPU)
        assert all(r["host_syncs_in_layer_loop"] == 0 for r in report["per_rank"])
    _check_held_bytes(run, report)


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
        assert rank["kda_resplit_bytes_received"] == rank["kda_return_bytes_received"] == 0  # in-seq: no re-split


def _materialized_bytes(run: RunConfig, history_only: bool) -> int:
    """What every rank's materializations bring over the run: per chunk and request, the latent rows of
    every indexed layer (as stored: FP8 rows as their bytes) and the group keys of every layer with its own
    indexer, from position 0 up to the chunk's start (phase 3: the history) or its end (phase 2)."""
    cfg = run.model
    dsa = [layer for layer in range(cfg.n_layers) if not cfg.is_kda(layer)]
    own_indexer = [layer for layer in dsa if not cfg.shares_selection(layer)]
    total = 0
    for chunk in chunk_schedule(run):
        for prefix, extend in zip(chunk.prefix_lens, chunk.extend_lens):
            rows = prefix if history_only else prefix + extend
            total += rows * _row_bytes(cfg, run.kv_dtype) * len(dsa)
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


def test_current_reuse_views_equal_the_materialized_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase 3 assembles the current chunk's latent rows from its all-gather, encoded as the table stores
    them (FP8 bytes); level 2 materializes the same rows from their owners after the writes. Every latent
    view attention reads (per rank, chunk, layer and request, decoded) is the same, bit for bit."""
    from reference_impl.families.glm53.model.dsa import MLAttention

    real_dsa, real_attend = glm53_step.Glm53Step._dsa, MLAttention.attend
    where: list[str] = []  # a rank's (forked process's) current layer; empty outside the step (the oracle)
    calls: dict[str, int] = {}

    def dsa(self: glm53_step.Glm53Step, layer: int, attn: MLAttention, h: torch.Tensor) -> tuple:
        chunk = self.inputs.chunk.prefix_lens
        where[:] = [f"{os.environ['G53_VIEWS']}/r{self.inputs.group.rank}_p{'-'.join(map(str, chunk))}_l{layer}"]
        try:
            return real_dsa(self, layer, attn, h)
        finally:
            where.clear()

    def attend(self: MLAttention, q: torch.Tensor, latent: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
        if where:  # one file per call: the step calls attend once per request with queries on the rank
            n = calls[where[0]] = calls.get(where[0], -1) + 1
            torch.save(latent, f"{where[0]}_n{n}.pt")
        return real_attend(self, q, latent, selection)

    monkeypatch.setattr(glm53_step.Glm53Step, "_dsa", dsa)
    monkeypatch.setattr(MLAttention, "attend", attend)
    _fork(monkeypatch)
    for level in (2, 3):
        (tmp_path / str(level)).mkdir()
        monkeypatch.setenv("G53_VIEWS", str(tmp_path / str(level)))
        report = ri.run_prefill(_run(level, 3, 23))
        assert report["matches_oracle"], report["problems"]
    names = sorted(p.name for p in (tmp_path / "2").iterdir())
    assert len(names) > 10 and names == sorted(p.name for p in (tmp_path / "3").iterdir())
    for name in names:
        assert torch.equal(torch.load(tmp_path / "2" / name), torch.load(tmp_path / "3" / name)), name


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


def test_fp8_rows_are_the_default() -> None:
    run = RunConfig(preset=PRESET, device="cpu")
    assert run.kv_dtype == "fp8" and run.model.mla_scale_fmt == "ue8m0"
    assert RunConfig(preset=PRESET, mla_scale_fmt="fp32", device="cpu").model.mla_scale_fmt == "fp32"


@pytest.mark.parametrize(
    ("level", "cp_size", "chunk", "kv_dtype"),
    [
        (2, 2, 23, "fp8"),
        (0, 3, 17, "bf16"),
        (2, 4, None, "fp8"),
        (3, 3, 23, "fp8"),
        (3, 2, None, "bf16"),
        (8, 4, 17, "fp8"),
        (8, 2, 23, "fp8"),
    ],
)
def test_round_robin_matches_the_oracle(level: int, cp_size: int, chunk: int | None, kv_dtype: KVDtype) -> None:
    """Round-robin (token t on rank t % C, the KDA layers re-split into contiguous blocks and back) with a
    cached prefix of 37 tokens and unaligned chunks; levels 3 and 8 run phases 1-3 and 1-3, 6-8 (4 and 5 are
    the in-seq split's); from phase 2 each latent row on exactly one rank."""
    run = _run(level, cp_size, chunk, kv_dtype=kv_dtype, split_mode="round-robin")
    assert run.interleave == 1  # round-robin's KV ownership: token by token
    assert sorted(run.phases.enabled) == [p for p in range(1, level + 1) if p not in (4, 5)]
    report = _report(level, cp_size, chunk, kv_dtype=kv_dtype, split_mode="round-robin")
    assert report["matches_oracle"], report["problems"]
    _check_held_bytes(run, report)
    for rank in report["per_rank"]:
        assert rank["kda_resplit_bytes_received"] > 0 and rank["kda_return_bytes_received"] > 0
        if level >= 6:  # the re-split's rows are planned before the loop too
            assert rank["host_syncs_in_layer_loop"] == 0
        if level == 8:  # the history (the cached prefix) prefetched, nothing materialized in the layer
            assert rank["prefetch_bytes_received"] > 0 and rank["view_bytes_received"] == 0
    if level >= 3:
        assert [r["materialized_bytes"] for r in report["per_rank"]] == [_materialized_bytes(run, True)] * cp_size


def test_round_robin_resplit_bytes() -> None:
    """One request of 50 tokens at C = 4: round-robin gives ranks 13, 13, 12, 12 tokens and the contiguous
    re-split the same counts; per KDA layer a rank receives the other ranks' padded 13 rows of ``dim``
    float32 values twice (in, out), one map and one halo from each other rank."""
    run = _run(2, 4, None, (Request(0, 50),), split_mode="round-robin")
    assert glm53_step.kda_resplit_blocks(ri.build_split("round-robin", 4, [50])) == [
        [(0, 0, 13, 0)],
        [(0, 13, 13, 0)],
        [(0, 26, 12, 0)],
        [(0, 38, 12, 0)],
    ]
    report = ri.run_prefill(run)
    assert report["matches_oracle"], report["problems"]
    cfg = run.model
    kda_layers = cfg.count(glm53_config.KDA)
    rows = kda_layers * 3 * 13 * cfg.dim * 4
    per_block = cfg.linear_num_heads * cfg.linear_head_dim * 2 * cfg.linear_head_dim * 4
    halo = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * 4
    for rank in report["per_rank"]:
        assert rank["kda_resplit_bytes_received"] == rank["kda_return_bytes_received"] == rows
        assert rank["kda_map_bytes_received"] == kda_layers * 3 * per_block
        assert rank["kda_halo_bytes_received"] == kda_layers * 3 * halo


@pytest.mark.parametrize(
    ("level", "requests", "page_size"),
    [(2, (Request(0, 130),), 4), (3, REQUESTS, 4), (8, REQUESTS, 4), (2, REQUESTS, 64), (3, (Request(0, 130),), 64)],
)
def test_round_robin_balances_the_group_keys(level: int, requests: tuple[Request, ...], page_size: int) -> None:
    """C = 4 round-robin: a group's last token (``16k + 15``) is always on rank 3, but the keys are spread,
    each rank within one group of ``total / C`` (a single request of 8 groups: exactly 2 each), with phase 2
    alone (each owner pools its own groups) and with phase 3 (every rank pools them all); the runs still match
    the oracle, and each key is on exactly one rank."""
    run = _run(level, 4, 17, requests, split_mode="round-robin").replace(page_size=page_size)
    report = ri.run_prefill(run)
    assert report["matches_oracle"], report["problems"]
    _check_held_bytes(run, report)
    cfg = run.model
    key_bytes = (cfg.count(glm53_config.DSA) - 1) * cfg.index_head_dim * 4  # a group's keys, every indexer layer
    groups = [r["index_bytes"] / key_bytes for r in report["per_rank"]]
    total = sum(r.total // cfg.index_kpool for r in requests)
    assert sum(groups) == total and all(abs(g - total / 4) <= 1 for g in groups), groups
    if len(requests) == 1:
        assert groups == [total / 4] * 4


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


@pytest.mark.parametrize("level", [2, 3])
def test_another_scale_format_than_the_oracles_fails(monkeypatch: pytest.MonkeyPatch, level: int) -> None:
    """The store quantizing with fp32 scales while the run (and the oracle) use ue8m0: the decoded rows
    still agree within the FP8 bound, the scale-format check catches it (phase 3 reads the current rows
    through the same encoding)."""
    from reference_impl.families.glm53.cache_layout import encode_fp8_rows
    from reference_impl.families.glm53.cp.store import Glm53Store

    real = Glm53Store.stored_form

    def fp32_scales(self: Glm53Store, rows: torch.Tensor) -> torch.Tensor:
        return real(self, rows if rows.dtype == torch.uint8 else encode_fp8_rows(rows, "fp32"))

    monkeypatch.setattr(Glm53Store, "stored_form", fp32_scales)
    _fork(monkeypatch)
    report = ri.run_prefill(_run(level, 2, None))
    assert not report["matches_oracle"] and any("ue8m0 form" in p for p in report["problems"])


def test_a_wrong_resplit_order_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's re-split rows taken with its blocks in reverse order (request 1's block where request 0's is
    expected, and back the same way): the KDA layers run tokens at the wrong positions and states."""
    real = glm53_step.block_tokens

    def reversed_blocks(meta: object, blocks: list) -> list[int]:
        return [g for block in reversed(blocks) for g in real(meta, [block])]  # type: ignore[arg-type]

    monkeypatch.setattr(glm53_step, "block_tokens", reversed_blocks)
    _fork(monkeypatch)
    report = ri.run_prefill(_run(2, 2, None, split_mode="round-robin"))
    assert not report["matches_oracle"] and any("hidden states" in p for p in report["problems"])


def test_refusals_name_the_knob() -> None:
    with pytest.raises(ri.ConfigError, match="kv_design=layer-split"):
        RunConfig(preset=PRESET, kv_design="layer-split", phases=PhaseSet.parse("1"), device="cpu")
    with pytest.raises(ri.ConfigError, match="phase 4"):  # the in-seq split's own phases
        RunConfig(preset=PRESET, split_mode="round-robin", phases=PhaseSet.level(4), device="cpu")
    for level in range(9):  # every level is built, under both splits
        for split_mode in ("in-seq", "round-robin"):
            phases = PhaseSet.level(level).for_split(split_mode)
            assert RunConfig(preset=PRESET, phases=phases, split_mode=split_mode, device="cpu").phases == phases

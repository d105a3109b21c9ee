"""GLM-5.3 through the CP engine against its oracle: levels 0 and 2, C = 2 and 3, unaligned requests
(a cached prefix of 37 tokens, extends of 61 and 45) and chunks (17, 23: not multiples of the 16-token
group, the blocks or the pages), FP8 and bf16 latent rows; the KDA state hand-off measured by its
collective's tag; and the checks failing when the hand-off is skipped, a group key has the wrong owner or
the rows are quantized in another scale format than the oracle's."""

from __future__ import annotations

import pytest
import torch

import reference_impl as ri
from reference_impl.config import KVDtype, PhaseSet, Request, RunConfig, SplitMode
from reference_impl.families.glm53 import config as glm53_config
from reference_impl.families.glm53.cp import step as glm53_step

PRESET = "tiny-glm53"
REQUESTS = (Request(37, 61), Request(0, 45))


def _run(
    level: int,
    cp_size: int,
    chunk: int | None,
    requests: tuple[Request, ...] = REQUESTS,
    kv_dtype: KVDtype = "bf16",
    split_mode: SplitMode = "in-seq",
) -> RunConfig:
    return RunConfig(
        preset=PRESET,
        cp_size=cp_size,
        phases=PhaseSet.level(level),
        page_size=4,
        chunk_size=chunk,
        kv_dtype=kv_dtype,
        split_mode=split_mode,
        requests=requests,
        device="cpu",
    )


@pytest.mark.parametrize(
    ("level", "cp_size", "chunk", "kv_dtype"),
    [(0, 2, None, "bf16"), (0, 3, 17, "fp8"), (2, 2, 23, "bf16"), (2, 3, 23, "fp8"), (2, 3, None, "fp8")],
)
def test_cp_matches_the_oracle(level: int, cp_size: int, chunk: int | None, kv_dtype: KVDtype) -> None:
    run = _run(level, cp_size, chunk, kv_dtype=kv_dtype)
    report = ri.run_prefill(run)
    assert report["matches_oracle"], report["problems"]
    cfg = run.model
    tokens = sum(r.total for r in run.requests)
    latent = [r["kv_bytes"] for r in report["per_rank"]]
    keys = [r["index_bytes"] for r in report["per_rank"]]
    row_bytes = cfg.kv_lora_rank + cfg.kv_lora_rank // 128 * 4 if kv_dtype == "fp8" else cfg.kv_lora_rank * 2
    latent_all = tokens * cfg.count(glm53_config.DSA) * row_bytes
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


def test_a_wrong_group_owner_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Group keys written at the group's first token instead of its last: missing keys are caught."""
    from reference_impl.families.glm53.cp.store import Glm53Store

    real = Glm53Store.write_group_keys
    P = glm53_config.PRESETS[PRESET].index_kpool
    monkeypatch.setattr(
        Glm53Store, "write_group_keys", lambda self, layer, ends, keys: real(self, layer, ends - (P - 1), keys)
    )
    _fork(monkeypatch)
    report = ri.run_prefill(_run(2, 2, None))
    assert not report["matches_oracle"]


def test_another_scale_format_than_the_oracles_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store quantizing with fp32 scales while the run (and the oracle) use ue8m0: the decoded rows
    still agree within the FP8 bound, the scale-format check catches it."""
    from reference_impl.families.glm53.cache_layout import encode_fp8_rows
    from reference_impl.families.glm53.cp.store import Glm53Store

    real = Glm53Store.write_latent

    def fp32_scales(self: Glm53Store, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        real(self, layer, locs, rows if rows.dtype == torch.uint8 else encode_fp8_rows(rows, "fp32"))

    monkeypatch.setattr(Glm53Store, "write_latent", fp32_scales)
    _fork(monkeypatch)
    report = ri.run_prefill(_run(2, 2, None, kv_dtype="fp8"))
    assert not report["matches_oracle"] and any("ue8m0 form" in p for p in report["problems"])


def test_fp8_rows_are_the_default() -> None:
    run = RunConfig(preset=PRESET, device="cpu")
    assert run.kv_dtype == "fp8" and run.model.mla_scale_fmt == "ue8m0"
    assert RunConfig(preset=PRESET, mla_scale_fmt="fp32", device="cpu").model.mla_scale_fmt == "fp32"


@pytest.mark.parametrize(
    ("level", "cp_size", "chunk", "kv_dtype"), [(2, 2, 23, "fp8"), (0, 3, 17, "bf16"), (2, 4, None, "fp8")]
)
def test_round_robin_matches_the_oracle(level: int, cp_size: int, chunk: int | None, kv_dtype: KVDtype) -> None:
    """Round-robin (token t on rank t % C, the KDA layers re-split into contiguous blocks and back) with a
    cached prefix of 37 tokens and unaligned chunks; from phase 2 each latent row on exactly one rank."""
    run = _run(level, cp_size, chunk, kv_dtype=kv_dtype, split_mode="round-robin")
    assert run.interleave == 1  # round-robin's KV ownership: token by token
    report = ri.run_prefill(run)
    assert report["matches_oracle"], report["problems"]
    cfg = run.model
    latent = [r["kv_bytes"] for r in report["per_rank"]]
    row_bytes = cfg.kv_lora_rank + cfg.kv_lora_rank // 128 * 4 if kv_dtype == "fp8" else cfg.kv_lora_rank * 2
    latent_all = sum(r.total for r in run.requests) * cfg.count(glm53_config.DSA) * row_bytes
    if level >= 2:
        assert sum(latent) == latent_all and max(latent) < latent_all
    else:
        assert latent == [latent_all] * cp_size
    for rank in report["per_rank"]:
        assert rank["kda_resplit_bytes_received"] > 0 and rank["kda_return_bytes_received"] > 0


def test_round_robin_resplit_bytes() -> None:
    """One request of 50 tokens at C = 4: round-robin gives ranks 13, 13, 12, 12 tokens and the contiguous
    re-split the same counts; per KDA layer a rank receives the other ranks' padded 13 rows of ``dim``
    float32 values twice (in, out), one map and one halo from each other rank."""
    run = _run(2, 4, None, (Request(0, 50),), kv_dtype="fp8", split_mode="round-robin")
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


def test_a_wrong_resplit_order_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's re-split rows taken with its blocks in reverse order (request 1's block where request 0's is
    expected, and back the same way): the KDA layers run tokens at the wrong positions and states."""
    real = glm53_step.block_tokens

    def reversed_blocks(meta: object, blocks: list) -> list[int]:
        return [g for block in reversed(blocks) for g in real(meta, [block])]  # type: ignore[arg-type]

    monkeypatch.setattr(glm53_step, "block_tokens", reversed_blocks)
    _fork(monkeypatch)
    report = ri.run_prefill(_run(2, 2, None, kv_dtype="fp8", split_mode="round-robin"))
    assert not report["matches_oracle"] and any("hidden states" in p for p in report["problems"])


def test_refusals_name_the_knob() -> None:
    with pytest.raises(ri.ConfigError, match=r"phases \[3"):
        RunConfig(preset=PRESET, kv_dtype="bf16", phases=PhaseSet.level(3), device="cpu")

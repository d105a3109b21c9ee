"""IndexShare (GLM-5.2): the pattern, the model, the oracle and CP runs at every phase level.

A shared layer has no indexer: it projects, gathers, stores and materializes no indexer K and attends
with the top-k of the full layer before it. The oracle follows the same rule, so every CP check
(outputs, top-k sets, caches byte for byte) holds; the saving shows in the report's ``index_bytes``
and ``gather_bytes``. The Hugging Face cross-check is ``tests/test_hf_crosscheck.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig
from reference_impl.index_share import IndexShare, check_pattern, pattern_from_freq
from reference_impl.kvcache.layout import KVLayout
from reference_impl.kvcache.pool import PagedKVPool
from reference_impl.model.oracle import DSAModel, init_weights, run_oracle
from reference_impl.presets import get_preset
from reference_impl.runner import run_prefill

# GLM-5.2's full layers, as GlmMoeDsaConfig derives them from index_topk_freq 4, index_skip_topk_offset 3.
GLM52_FULL = (0, 1, 2, *range(6, 78, 4))


def test_glm52_pattern_from_its_config_rule() -> None:
    share = get_preset("glm-5.2").index_share
    assert share.full_layers == GLM52_FULL and share.n_full == 21 and share.n_layers == 78
    assert share.source(5) == 2 and share.source(6) == 6 and share.source(77) == 74
    assert share.index_slot(6) == 3 and share.index_slot(74) == 20
    assert get_preset("glm-5.2").with_layers(4).index_share.pattern == "FFFS"
    for preset in ("deepseek-v3.2", "glm-5", "tiny"):  # no sharing: every layer full
        assert not get_preset(preset).index_share.shares
    assert pattern_from_freq(6, 1, 0) == "FFFFFF" and pattern_from_freq(5, 2, 2) == "FFSFS"
    with pytest.raises(ConfigError, match="layer 0 is shared"):  # offset 0 would share layer 0
        IndexShare(pattern_from_freq(5, 2, 0))


def test_bad_patterns_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="layer 0 is shared"):
        check_pattern("SF", 2)
    with pytest.raises(ConfigError, match="found 'X'"):
        check_pattern("FXF", 3)
    with pytest.raises(ConfigError, match="3 letters for 4 layers"):
        check_pattern("FSF", 4)
    with pytest.raises(ConfigError, match="one letter per layer"):
        check_pattern("", 0)
    with pytest.raises(ConfigError, match="is shared"):
        IndexShare("FS").index_slot(1)
    with pytest.raises(ConfigError, match="index_topk_pattern='FSF' has 3 letters for 2 layers"):
        RunConfig(index_topk_pattern="FSF")
    with pytest.raises(ConfigError, match="index_topk_pattern=3"):
        RunConfig(index_topk_pattern=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="upper case; found 'f', 's'"):
        RunConfig(index_topk_pattern="fs")  # exact case, as every enumerated knob
    assert RunConfig(preset="glm-5.2", n_layers=8).model.index_share.pattern == "FFFSSSFS"


def test_the_pool_keeps_index_k_on_full_layers_only() -> None:
    layout = KVLayout.from_config(
        dataclasses.replace(get_preset("tiny"), n_layers=4, index_topk_pattern="FSFS"), "fp8", 16
    )
    assert layout.index_layers == (0, 2) and layout.has_index(2) and not layout.has_index(1)
    pool = PagedKVPool(4, 3, 16, layout)
    assert pool.index.shape == (2, 3, 16 * 132) and pool.index_bytes_total == 2 * 3 * 16 * 132
    assert pool.index_of(2).data_ptr() == pool.index[1].data_ptr()
    with pytest.raises(ConfigError, match="layer 1 keeps no indexer K"):
        pool.read_index(1, torch.tensor([0]))
    assert KVLayout.from_config(get_preset("tiny"), "fp8", 16).index_layers is None  # no sharing: every layer


def test_the_oracle_reuses_the_full_layers_top_k() -> None:
    cfg = dataclasses.replace(get_preset("tiny"), n_layers=3, index_topk_pattern="FSS")
    model = init_weights(DSAModel(cfg, torch.float32), 0)
    assert [b.attn.indexer is None for b in model.layers] == [False, True, True]
    assert not any("layers.1.attn.indexer" in name for name, _ in model.named_parameters())
    x = torch.randn(70, cfg.dim, generator=torch.Generator().manual_seed(1))
    result = run_oracle(model, [20], [x], "fp8", 16)
    assert torch.equal(result.topk[1][0], result.topk[0][0]) and torch.equal(result.topk[2][0], result.topk[0][0])
    assert result.caches[1][0].index_fp8.shape == (0, 128) and len(result.caches[1][0]) == 70
    assert result.caches[0][0].index_fp8.shape == (70, 128)
    assert torch.equal(result.index_scores(2, 0, 5), result.index_scores(0, 0, 5))
    # Not the same computation as three full layers: the shared layers' own indexers would pick other keys.
    full = init_weights(DSAModel(dataclasses.replace(cfg, index_topk_pattern=None), torch.float32), 0)
    assert not torch.equal(run_oracle(full, [20], [x], "fp8", 16).topk[1][0], result.topk[1][0])
    proj = model.layers[1].attn.project(x[:4], torch.arange(4))
    assert proj.index_k is None and proj.index_q_fp8 is None
    with pytest.raises(ValueError, match="reuse_topk"):
        model.layers[1].attn(x[:4])


def _report(run: RunConfig) -> dict:
    report = run_prefill(run)
    assert report["matches_oracle"] is True, report["problems"]
    assert report["cache_equal"] is True and report["collectives_identical"] is True
    return report


@pytest.mark.parametrize("level", [0, 2, 3, 5, 8])
def test_cp_runs_at_every_level_match_the_oracle_and_move_less_index_k(level: int) -> None:
    """Shared layers store and gather no index K; the top-k they reuse and the caches match the oracle."""
    base = RunConfig(
        cp_size=2,
        n_layers=4,
        requests=(Request(0, 80), Request(24, 40)),
        page_size=16,
        phases=PhaseSet.level(level),
        device="cpu",
    )
    shared = _report(base.replace(index_topk_pattern="FSFS"))
    full = _report(base)
    assert shared["config"]["index_topk_pattern"] == "FSFS" and full["config"]["index_topk_pattern"] == "FFFF"
    for s, f in zip(shared["per_rank"], full["per_rank"]):
        assert s["kv_bytes"] == f["kv_bytes"] and 2 * s["index_bytes"] == f["index_bytes"]
        assert s["gather_bytes"] < f["gather_bytes"] and s["collectives"] < f["collectives"]


@pytest.mark.parametrize("split_mode,level", [("round-robin", 2), ("in-seq", 7)])
def test_round_robin_and_chunked_runs_with_index_share(split_mode: str, level: int) -> None:
    _report(
        RunConfig(
            cp_size=2,
            n_layers=3,
            index_topk_pattern="FSF",
            requests=(Request(16, 48),),
            page_size=16,
            phases=PhaseSet.level(level),
            split_mode=split_mode,
            chunk_size=24,
            device="cpu",
        )
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("level", [0, 8])
def test_glm5_and_glm52_presets_match_the_oracle_at_cpu_widths(level: int) -> None:
    """The real presets' semantics, head dims and 656-byte rows (``cpu_widths``), as ``run --preset
    glm-5.2 --n-layers 4 --cpu-widths`` runs them; GLM-5.2 (FFFS) keeps less index K per rank than GLM-5."""
    run = RunConfig(
        cp_size=2,
        n_layers=4,
        requests=(Request(0, 64), Request(16, 32)),
        page_size=16,
        phases=PhaseSet.level(level),
        cpu_widths=True,
        device="cpu",
    )
    glm5, glm52 = _report(run.replace(preset="glm-5")), _report(run.replace(preset="glm-5.2"))
    assert glm52["config"]["index_topk_pattern"] == "FFFS" and glm5["config"]["index_topk_pattern"] == "FFFF"
    for a, b in zip(glm52["per_rank"], glm5["per_rank"]):
        assert 4 * a["index_bytes"] == 3 * b["index_bytes"] and a["kv_bytes"] == b["kv_bytes"]
    cfg = run.replace(preset="glm-5.2").model
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.dim, cfg.norm_eps) == (512, 192, 256, 256, 1e-5)
    assert cfg.index_rope_interleaved and KVLayout.from_config(cfg, "fp8", 64).mla_bytes == 656


# ---- the planner ------------------------------------------------------------------------------


def test_the_planner_counts_index_share() -> None:
    from reference_impl.cp.capacity import index_bytes_per_rank, kv_bytes_per_rank
    from reference_impl.planner import PlannerConfig, load_rates, plan_capacity
    from reference_impl.planner.model import layer_terms

    rates = load_rates(None)
    glm5, glm52 = get_preset("glm-5"), get_preset("glm-5.2")
    for sharded in (False, True):
        i5, i52 = (index_bytes_per_rank(c, 131072, 8, sharded) for c in (glm5, glm52))
        assert 78 * i52 == 21 * i5
        assert kv_bytes_per_rank(glm5, 131072, 8, sharded) - kv_bytes_per_rank(glm52, 131072, 8, sharded) == i5 - i52
    shared = layer_terms(glm52, rates, 8, 131072, 8, 0, indexer=False)
    full = layer_terms(glm52, rates, 8, 131072, 8, 0)
    assert shared["indexer_logits"] == shared["indexer_topk"] == 0 < full["indexer_logits"]
    assert shared["allgather1"] < full["allgather1"] and shared["store"] < full["store"]
    assert shared["attention"] == full["attention"]
    plans = {p: plan_capacity(PlannerConfig(preset=p, contexts=(131072,)), rates) for p in ("glm-5", "glm-5.2")}
    assert plans["glm-5.2"]["inputs"]["index_layers"] == 21 and plans["glm-5"]["inputs"]["index_layers"] == 78
    for a, b in zip(plans["glm-5.2"]["levels"], plans["glm-5"]["levels"]):
        pa, pb = a["contexts"][0], b["contexts"][0]
        assert pa["index_bytes_per_rank"] < pb["index_bytes_per_rank"] and pa["layer_ms"] < pb["layer_ms"]
        assert a["max_context"] > b["max_context"]
        by_kind = pa["layer_ms_by_kind"]
        assert abs(pa["layer_ms"] - (21 * by_kind["full"] + 57 * by_kind["shared"]) / 78) < 1e-9
    # The pattern is a planner knob too: GLM-5 with GLM-5.2's pattern plans as GLM-5.2.
    as52 = plan_capacity(
        PlannerConfig(preset="glm-5", contexts=(131072,), index_topk_pattern=glm52.index_share.pattern), rates
    )
    assert (
        as52["levels"][8]["contexts"][0]["index_bytes_per_rank"]
        == plans["glm-5.2"]["levels"][8]["contexts"][0]["index_bytes_per_rank"]
    )
    with pytest.raises(ConfigError, match="2 letters for 78 layers"):
        PlannerConfig(preset="glm-5", index_topk_pattern="FS")


def test_the_index_share_results_are_what_the_script_writes(tmp_path) -> None:
    """``docs/results/index_share_plan.json`` (rendered on docs/concepts/index-share.md) is the
    planner's output for today's formulas and rates; re-run ``python3 scripts/index_share_plan.py``."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "plan.json"
    subprocess.run(
        [sys.executable, str(root / "scripts" / "index_share_plan.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    committed = json.loads((root / "docs" / "results" / "index_share_plan.json").read_text())
    from reference_impl.figures import same_up_to_rounding

    assert same_up_to_rounding(json.loads(out.read_text()), committed), (
        "stale: re-run python3 scripts/index_share_plan.py"
    )

"""GLM-5.3's capacity planner: the arithmetic on small hand-checked cases, and its refusals."""

from __future__ import annotations

import json

import pytest

from reference_impl.cp.capacity import max_context_per_rank
from reference_impl.errors import ConfigError
from reference_impl.families.glm53 import planner
from reference_impl.families.glm53.config import GLM53_PRESETS
from reference_impl.presets import get_preset

TINY, FLASH = GLM53_PRESETS["tiny-glm53"], GLM53_PRESETS["glm-5.3-flash"]


def test_owned_tokens_and_groups_by_hand():
    # 130 tokens, pages of 64: pages 0, 1, 2 (2 tokens); C = 2: rank 0 owns pages 0 and 2, rank 1 page 1
    assert planner.owned_tokens(130, 2, 0) == 66 and planner.owned_tokens(130, 2, 1) == 64
    # 100 tokens: 6 complete groups of 16; page 0 holds groups 0-3 (rank 0), page 1 groups 4 and 5 (rank 1)
    assert planner.owned_groups(100, 2, 16, 0) == 4 and planner.owned_groups(100, 2, 16, 1) == 2
    # 200 tokens, C = 3: pages 0, 1, 2, 3 (8 tokens); rank 0 owns 0 and 3: 72 tokens, 4 groups
    assert planner.owned_tokens(200, 3, 0) == 72 and planner.owned_groups(200, 3, 16, 0) == 4
    for tokens in (1, 15, 16, 63, 64, 65, 1000, 4097):
        for c in (1, 2, 3, 8):
            assert sum(planner.owned_tokens(tokens, c, r) for r in range(c)) == tokens
            assert sum(planner.owned_groups(tokens, c, 16, r) for r in range(c)) == tokens // 16
    with pytest.raises(ConfigError, match="page_size=40"):
        planner.owned_groups(100, 2, 16, 0, page_size=40)


def test_tiny_bytes_by_hand():
    # tiny-glm53: KDA, indexed, indexed sharing, KDA; 2 heads of 16; latent 256; index dim 16; conv 4
    assert planner.layer_counts(TINY) == {"kda": 2, "indexed": 2, "indexers": 1}
    assert planner.map_bytes(TINY) == 2 * 16 * 32 * 4 == 4096
    assert planner.conv_tail_bytes(TINY) == 3 * (3 * 2 * 16) * 2 == 576
    assert planner.latent_row_bytes(TINY, "bf16") == 512 and planner.latent_row_bytes(TINY, "fp8") == 256 + 2 * 4
    rest = planner.at_rest(TINY, 100, 2, sharded=False)
    assert rest["kda_state"] == 2 * (2 * 16 * 16 * 4 + 576)
    assert rest["latent"] == 2 * 100 * 512  # both indexed layers keep latent rows
    assert rest["group_keys"] == 1 * 6 * 16 * 4  # only the layer with its own indexer keeps keys
    assert rest["pending"] == 1 * 4 * 2 * 16 * 2  # 100 % 16 = 4 rows of key and gate, bf16
    assert rest["total"] == sum(v for k, v in rest.items() if k != "total")
    sharded = planner.at_rest(TINY, 100, 2, sharded=True)
    assert sharded["latent"] == 2 * 64 * 512 and sharded["group_keys"] == 4 * 64  # rank 0: page 0
    assert sharded["kda_state"] == rest["kda_state"] and sharded["pending"] == rest["pending"]  # replicated


def test_flash_terms_and_exchange():
    assert planner.map_bytes(FLASH) == 8 << 20  # 64 x 128 x 256 x 4: 8 MiB per block
    per_token = planner.bytes_per_token(FLASH, "bf16")
    assert per_token == {"kda": 0.0, "indexed": 1024 + 512 / 16, "indexed_shared": 1024.0}
    assert planner.bytes_per_token(FLASH, "fp8")["indexed_shared"] == 528
    ex = planner.exchange_bytes(FLASH, 131072, 131072, 8)
    assert ex["kda_maps"] == 14 * (8 << 20)  # 112 MiB: 2C - 2 maps, whatever the chunk
    assert ex["kda_maps"] == planner.exchange_bytes(FLASH, 8192, 1 << 20, 8)["kda_maps"]
    assert planner.exchange_bytes(FLASH, 4096, 4096, 1)["kda_maps"] == 0
    assert ex["indexed_current"] == (131072 - 16384) * (1024 + 512)


def test_largest_fitting():
    assert planner.largest_fitting(lambda s: 10 * s, 1000) == 100
    assert planner.largest_fitting(lambda s: 10 * s + 5, 1000) == 99
    assert planner.largest_fitting(lambda s: 10 * s, 1000, step=7) == 98
    assert planner.largest_fitting(lambda s: 10 * s, 5) == 0


def test_plan_table_is_consistent():
    doc = planner.plan_glm53("glm-5.3-flash", 8, 48.0)
    budget = 48 << 30
    rows = {(r["model"], r["kv_dtype"]): r for r in doc["table"]}
    assert set(rows) == {
        ("glm-5.3-flash", "bf16"),
        ("glm-5.3-flash", "fp8"),
        ("glm-5.2", "bf16"),
        ("glm-5.2", "fp8"),
        ("deepseek-v4-flash", "fp8"),
    }
    g = rows[("glm-5.3-flash", "bf16")]
    assert g["bytes_per_token"] == 11 * 1056
    for kind in ("replicated", "sharded"):
        longest = g[kind]["max_context"]
        sharded = kind == "sharded"
        assert planner.at_rest(FLASH, longest, 8, sharded)["total"] <= budget
        assert planner.at_rest(FLASH, longest + 1, 8, sharded)["total"] > budget
    # the KDA state is fixed per request: it caps how many requests fit, not their length
    fixed = g["bytes_per_request"]
    assert fixed == 34 * (4 << 20) + 34 * planner.conv_tail_bytes(FLASH)
    assert g["sharded"]["requests_at_1m"] == budget // planner.at_rest(FLASH, 1 << 20, 8, True)["total"]
    assert rows[("glm-5.2", "fp8")]["sharded"]["max_context"] == max_context_per_rank(
        get_preset("glm-5.2"), budget, 8, True, "fp8"
    )
    assert g["sharded"]["max_context"] > rows[("glm-5.2", "fp8")]["sharded"]["max_context"]
    assert doc["table_markdown"].count("\n") == 2 + len(doc["table"])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"preset": "glm-5.2"}, "preset='glm-5.2'"),
        ({"cp_size": 0}, "cp_size=0"),
        ({"kv_budget_gib": -1.0}, "kv_budget_gib=-1.0"),
        ({"contexts": [0]}, "contexts=[0]"),
    ],
)
def test_plan_refuses_by_name(kwargs, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        planner.plan_glm53(**kwargs)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--preset", "glm-5.2"], "argument --preset: unknown GLM-5.3 preset 'glm-5.2'"),
        (["--cp-size", "0"], "argument --cp-size: 0 is below 1"),
        (["--kv-budget-gib", "0"], "argument --kv-budget-gib: 0 is not positive"),
        (["--contexts", "1x"], "--contexts '1x'"),
    ],
)
def test_cli_refuses_bad_flags(argv, words, capsys):
    try:
        code = planner.main(argv)
    except SystemExit as exc:  # a parse error exits 2, as argparse's do
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err


def test_cli_writes_json_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert planner.main(["--out", str(out), "--preset", "tiny-glm53", "--cp-size", "2"]) == 0
    doc = json.loads(out.read_text())
    assert doc["preset"] == "tiny-glm53" and doc["cp_size"] == 2
    assert capsys.readouterr().out == doc["table_markdown"]


def test_the_committed_plan_is_what_the_planner_says():
    """``docs/results/glm53_planner.json`` is arithmetic: the planner at its defaults writes it again."""
    from pathlib import Path

    from reference_impl.figures import same_up_to_rounding

    path = Path(__file__).resolve().parent.parent / "docs" / "results" / "glm53_planner.json"
    committed = json.loads(path.read_text())
    fresh = planner.plan_glm53(committed["preset"], committed["cp_size"], committed["kv_budget_gib"])
    committed.pop("command")
    assert same_up_to_rounding(committed, fresh), "rerun: python -m reference_impl.planner.glm53 --out " + str(path)

"""GLM-5.3's benchmark: its CPU dry run (the JSON's shape and arithmetic) and its layers against the oracle's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from reference_impl.bench.layer import Workload
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.families.glm53 import bench, planner
from reference_impl.families.glm53.config import GLM53_PRESETS
from reference_impl.families.glm53.model.kda import span_map
from reference_impl.families.glm53.model.oracle import DSACache, KDACache, build_glm53_model, dsa_span, kda_span

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import results_tables  # noqa: E402

TINY = GLM53_PRESETS["tiny-glm53"]


@pytest.fixture(scope="module")
def model():
    return build_glm53_model(TINY.with_layers(2), torch.float32, 0, "cpu")


def test_dry_run_json_shape_and_arithmetic(tmp_path):
    out = tmp_path / "g.json"
    argv = ["--out", str(out), "--device", "cpu", "--preset", "tiny-glm53", "--cp-size", "2"]
    argv += ["--workloads", "a:0+160,b:128+32", "--levels", "0,2", "--repeats", "2", "--span", "16"]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["one_device_models_cp"] is True and "LoopbackGroup" in doc["how_cp_runs"]
    assert "modeled" in doc["how_cp_runs"] and doc["layers"] == {"kda": 0, "indexed": 1}
    assert [w["context"] for w in doc["workloads"]] == [160, 160]
    H, Dk, C = TINY.linear_num_heads, TINY.linear_head_dim, 2
    for w in doc["workloads"]:
        base, top = w["levels"]
        assert (base["level"], top["level"]) == (0, 2)
        for point in (base, top):
            ex = point["kda_state_exchange"]
            assert ex["gathered_bytes"] == C * 2 * H * Dk * (Dk + Dk) * 4
            assert ex["received_bytes"] == (2 * C - 2) * planner.map_bytes(TINY)
            assert ex["modeled_wire_ms"] == pytest.approx(ex["received_bytes"] / 450e9 * 1e3)
            for kind in ("kda", "indexed"):
                t = point["layer_ms"][kind]
                assert len(t["runs_ms"]) == 2 and t["min_ms"] <= t["median_ms"] <= t["max_ms"]
            assert point["bytes_at_rest_per_layer"] == point["planner_bytes_at_rest_per_layer"]
            got = point["bytes_received_by_tag"]
            assert got["kda"]["glm53_kda_state"] == ex["received_bytes"]
            assert got["kda"]["glm53_kda_halo"] == (C - 1) * 2 * 3 * TINY.conv_dim * 4  # float32 on a CPU
            assert ("glm53_kv_view" in got["indexed"]) == (point["level"] == 2)
            assert got["indexed"]["glm53_current"] > 0
            assert sum(b["tokens"] for b in point["blocks"]) == point["local_tokens"]
        # the KDA state is replicated; the latent rows and group keys are sharded from level 2
        assert top["bytes_at_rest_per_layer"]["kda"] == base["bytes_at_rest_per_layer"]["kda"]
        assert top["bytes_at_rest_per_layer"]["indexed"] < base["bytes_at_rest_per_layer"]["indexed"]
    table = results_tables.glm53(doc).splitlines()
    assert len(table) == 4 + 4 and table[-1].startswith("| b (128 + 32) | 2 | ")  # 2 workloads x 2 levels
    first = doc["workloads"][0]["levels"][0]["blocks"]
    assert first == [{"first": 0, "tokens": 40}, {"first": 120, "tokens": 40}]  # blocks 0 and 2C - 1 of 160


@pytest.mark.parametrize(("prefix", "extend", "span"), [(0, 100, 16), (0, 24, 2), (40, 100, 7)])
def test_kda_layer_on_one_rank_equals_the_oracle(model, prefix, extend, span):
    """C = 1: rank 0 holds both blocks; spans, halos, maps and compose must give the sequential layer."""
    attn = model.layers[0].attn
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(prefix + extend, TINY.dim, generator=gen)
    cache = KDACache.empty(TINY, torch.float32, "cpu")
    if prefix:
        kda_span(attn, x[:prefix], cache)
    state, conv = cache.state.clone(), cache.conv.clone()
    expected = kda_span(attn, x[prefix:], cache)
    w = Workload("t", prefix, extend)
    blocks = bench.rank0_blocks(w, 1)
    assert sum(n for _, n in blocks) == extend
    got = bench.kda_layer(attn, x[prefix:], blocks, LoopbackGroup(0, 1, "cpu"), state, conv, span)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_indexed_layer_on_one_rank_equals_the_oracle(model):
    attn = model.layers[1].attn
    x = torch.randn(100, TINY.dim, generator=torch.Generator().manual_seed(4))
    expected, _ = dsa_span(attn, x, 0, DSACache.empty(TINY, 1, torch.float32, torch.bfloat16, "cpu"), None)
    rank = bench.IndexedRank(attn, Workload("t", 0, 100), 1, 0)
    got = rank.layer(x, torch.arange(100), LoopbackGroup(0, 1, "cpu"), tile=7)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert rank.at_rest_bytes() == planner.per_layer_at_rest(TINY, 100, 1, False)["indexed"]


def test_absorbed_attention_equals_the_reference(model):
    attn = model.layers[1].attn
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(9, TINY.n_heads, TINY.qk_nope_head_dim, generator=gen)
    latent = torch.randn(60, TINY.kv_lora_rank, generator=gen)
    width = TINY.selection_width  # distinct positions per row, as a selection holds
    selection = torch.stack([torch.randperm(60, generator=gen)[:width] for _ in range(9)]).sort(dim=1).values
    selection[:, -5:] = -1
    rank = bench.IndexedRank(attn, Workload("t", 0, 64), 1, 0)
    torch.testing.assert_close(rank.attend(q, latent, selection), attn.attend(q, latent, selection))


def test_query_tile_bounds_the_scores():
    flash = GLM53_PRESETS["glm-5.3-flash"]
    tile = bench.query_tile(flash, 1 << 20, 256)
    assert tile * flash.index_n_heads * (1 << 16) * 4 <= bench.SCORE_TILE_BYTES and tile >= 1
    assert bench.query_tile(TINY, 128, 256) == 256


class _AllRanks:
    """A group of ``size`` ranks whose two all-gathers return every rank's true rows (rank-major), so rank 0's
    halos, map order and compose are checked against the sequential layer."""

    def __init__(self, size, tails, maps):
        self.size, self._rows = size, {"glm53_kda_halo": tails, "glm53_kda_state": maps}

    def all_gather_padded(self, local, lengths, tag):
        assert list(lengths) == [2] * self.size and local.shape[1:] == self._rows[tag].shape[1:]
        return self._rows[tag]


@pytest.mark.parametrize("cp_size", [2, 3])
def test_kda_layer_of_rank_0_with_every_ranks_rows_equals_the_oracle(model, cp_size):
    attn, T, span = model.layers[0].attn, 130, 8
    x = torch.randn(T, TINY.dim, generator=torch.Generator().manual_seed(6))
    expected = kda_span(attn, x, KDACache.empty(TINY, torch.float32, "cpu"))
    sizes = bench.zigzag_blocks(T, cp_size, bench.PAGE, page_aligned=False)
    starts = [sum(sizes[:b]) for b in range(2 * cp_size)]
    mixed = attn.mixed(x)
    q, k, v = attn.qkv(attn.conv(mixed, torch.zeros(attn.halo, TINY.conv_dim)))
    g, beta = attn.gates(x)
    tails, maps = [], []
    for r in range(cp_size):
        for b in (r, 2 * cp_size - 1 - r):
            s, e = starts[b], starts[b] + sizes[b]
            tails.append(mixed[e - attn.halo : e])
            A, B = span_map(k[s:e], v[s:e], g[s:e], beta[s:e])
            maps.append(torch.cat([A, B], dim=-1))
    group = _AllRanks(cp_size, torch.stack(tails), torch.stack(maps))
    blocks = bench.rank0_blocks(Workload("t", 0, T), cp_size)
    assert [p for p, _ in blocks] == [0, starts[-1]]
    h = torch.cat([x[p : p + n] for p, n in blocks])
    zeros = KDACache.empty(TINY, torch.float32, "cpu")
    got = bench.kda_layer(attn, h, blocks, group, zeros.state, zeros.conv, span)
    want = torch.cat([expected[p : p + n] for p, n in blocks])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

"""GLM-5.3 per-layer benchmark: rank 0 of ``C`` alone on one device, a KDA layer and an indexed layer.

Usage::

    python -m reference_impl.bench.glm53 --out docs/results/glm53_bench.json          # one GPU
    python -m reference_impl.bench.glm53 --out dry.json --device cpu --preset tiny-glm53 --cp-size 2 \\
        --workloads 128k:0+512,1m:2048+256 --repeats 2                             # CPU dry run

**How CP runs here**: one process plays rank 0 of ``--cp-size`` through
:class:`~reference_impl.cp.loopback.LoopbackGroup`: every all-gather is a local copy of the rank's own
rows into ``C`` slots (the bytes a real gather writes, no wire); the interconnect is modeled apart,
``bytes received / --wire-gbps``, and never added to a measured time. The results say so.

**Workloads** (``name:prefix+extend``, one request): ``128k`` is 131,072 tokens in one chunk; ``1m`` is
the last 8,192-token chunk of a 1,048,576-token request whose prefix is installed as random rows of the
right shapes (computing it would take hours; no time or byte count depends on the values).

**The layers** are the family's torch modules (:mod:`~reference_impl.families.glm53.model`: no
kernels) with rank 0's share of the work as :class:`~reference_impl.families.glm53.cp.step.Glm53Step`
does it, for one request, with two changes that keep the memory bounded at these lengths and leave the
math as it is:

* KDA: each block runs in spans of ``--span`` tokens, their state maps composed (``A2 A1, A2 B1 + B2``)
  and their recurrences chained; halo all-gather, map all-gather (tag ``glm53_kda_state``,
  ``C x 2 x H x Dk x (Dk + Dv) x 4`` B), compose of the ``2C`` maps, the rank's blocks from their
  entering states;
* indexed: the chunk's rows all-gathered, the owned latent rows and group keys stored, the groups whose
  last token is owned pooled, from level 2 the request's rows gathered from their owners, then per tile
  of ``--query-tile`` queries the group scores, the selection and attention on the selected rows only
  (MLA in its absorbed form over the latent rows; the reference's ``attend`` masks a dense score
  matrix, ``T x S`` per head, which does not fit at these lengths; the test checks the two agree).

**Per workload and level** (levels 0-2; level 1 changes only the output tail, not a layer): each layer
type's time (CUDA events; median, min and max over ``--repeats`` runs after a warm-up run); the map
all-gather and the compose timed alone, with the modeled wire time beside; the bytes each layer's
collectives received, per tag (a loopback gather pads the other ranks' slots to rank 0's rows); bytes at
rest per layer type counted from the bench's tensors; the planner's figures
(:mod:`~reference_impl.families.glm53.planner`) beside both.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from reference_impl import footprint
from reference_impl.bench.layer import Workload, parse_workloads
from reference_impl.bench.record import loopback_cp, run_record
from reference_impl.config import MAX_PLAN_CP, ConfigError
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.cp.ownership import Ownership
from reference_impl.families.glm53 import planner
from reference_impl.families.glm53.config import DSA, GLM53_PRESETS, KDA, Glm53Config
from reference_impl.families.glm53.cp.step import entering_states
from reference_impl.families.glm53.model.dsa import MLAttention, group_scores, select
from reference_impl.families.glm53.model.kda import KDAttention, kda_chunked, span_map
from reference_impl.families.glm53.model.oracle import Glm53Model, build_glm53_model
from reference_impl.planner.model import zigzag_blocks
from reference_impl.tool_args import (
    GIB,
    MAX_REPEATS,
    ToolParser,
    choice_arg,
    device_arg,
    float_arg,
    int_arg,
    int_list,
    output_file,
    refusing,
    require_cuda,
)

PROG = "python -m reference_impl.bench.glm53"
PAGE = planner.PAGE_SIZE
SCORE_TILE_BYTES = 1 << 30  # a query tile's group scores [tile, index heads, groups] float32 stay under this


# ---- the split ----------------------------------------------------------------------------------------


def rank0_blocks(w: Workload, cp_size: int) -> list[tuple[int, int]]:
    """Rank 0's two blocks of the chunk, ``(first position, length)``: blocks ``0`` and ``2C - 1``."""
    sizes = zigzag_blocks(w.prefix + w.extend, cp_size, PAGE, page_aligned=False, prefix=w.prefix)
    return [(w.prefix, sizes[0]), (w.prefix + sum(sizes[:-1]), sizes[-1])]


# ---- the KDA layer ------------------------------------------------------------------------------------


def block_map(
    attn: KDAttention, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, halo: torch.Tensor, span: int
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """One block's state map ``(A, B)``, composed over spans of ``span`` tokens, and each span's ``q, k, v``."""
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    parts = []
    for s in range(0, len(mixed), span):
        e = min(s + span, len(mixed))
        before = halo if s == 0 else mixed[max(0, s - attn.halo) : s]
        if len(before) < attn.halo:  # a block shorter than the halo: the halo's rows, then the block's
            before = torch.cat([halo, mixed[:s]])[-attn.halo :]
        q, k, v = attn.qkv(attn.conv(mixed[s:e], before))
        a, b = span_map(k, v, g[s:e], beta[s:e])
        A, B = (a, b) if A is None or B is None else (a @ A, a @ B + b)
        parts.append((q, k, v))
    assert A is not None and B is not None
    return A, B, parts


def kda_layer(
    attn: KDAttention,
    h: torch.Tensor,
    blocks: list[tuple[int, int]],
    group: LoopbackGroup,
    state: torch.Tensor,
    conv: torch.Tensor,
    span: int,
) -> torch.Tensor:
    """Rank 0's KDA layer on its local rows ``h`` (its two blocks, in order), from the request's cached
    ``state`` and convolution tail ``conv`` (see the module docstring)."""
    cfg, c, halo = attn.cfg, group.size, attn.halo
    mixed = attn.mixed(h)
    g, beta = attn.gates(h)
    local = [(sum(n for _, n in blocks[:i]), n) for i, (_, n) in enumerate(blocks)]
    tails = mixed.new_zeros(2, halo, cfg.conv_dim)
    for i, (start, n) in enumerate(local):
        take = min(n, halo)
        tails[i, halo - take :] = mixed[start + n - take : start + n]
    all_tails = group.all_gather_padded(tails, [2] * c, "glm53_kda_halo")  # rank-major: rank r's blocks 2r, 2r+1
    # block 0 follows the request's cached tail; block 2C-1 follows block 2C-2 (rank 1's second block)
    halos = [conv.to(mixed.dtype), all_tails[3 if c > 1 else 0]]
    maps, qkv = [], []
    for (start, n), before in zip(local, halos):
        A, B, parts = block_map(
            attn, mixed[start : start + n], g[start : start + n], beta[start : start + n], before, span
        )
        maps.append(torch.cat([A, B], dim=-1))
        qkv.append(parts)
    Dk = cfg.linear_head_dim
    all_maps = group.all_gather_padded(torch.stack(maps), [2] * c, "glm53_kda_state")
    order = [2 * b if b < c else 2 * (2 * c - 1 - b) + 1 for b in range(2 * c)]  # sequence block -> slot
    entering, _ = entering_states(state, [(all_maps[i, ..., :Dk], all_maps[i, ..., Dk:]) for i in order])
    core = h.new_zeros(len(h), cfg.linear_num_heads, Dk, dtype=torch.float32)
    for (start, n), parts, s in zip(local, qkv, (entering[0], entering[-1])):
        for j, (q, k, v) in enumerate(parts):
            a, e = start + j * span, start + min((j + 1) * span, n)
            core[a:e], s = kda_chunked(q, k, v, g[a:e], beta[a:e], s)
    return attn.finish(h, core)


# ---- the indexed layer --------------------------------------------------------------------------------


class IndexedRank:
    """What rank 0 keeps of one indexed layer with its own indexer, and its layer (see the module docstring)."""

    def __init__(self, attn: MLAttention, w: Workload, cp_size: int, level: int) -> None:
        cfg, dev = attn.cfg, attn.q_a_proj.weight.device
        self.attn, self.cfg, self.c, self.w = attn, cfg, cp_size, w
        self.sharded = level >= 2 and cp_size > 1
        self.context = w.prefix + w.extend
        own = Ownership(cp_size, PAGE, PAGE)
        positions = torch.arange(self.context, device=dev)
        owner = own.owner(positions) if self.sharded else torch.zeros_like(positions)
        self.mine = owner == 0
        self.slot = own.physical(positions) if self.sharded else positions  # a position's row in the pool
        n_rows = int(self.mine.sum())
        P = cfg.index_kpool
        ends = positions[P - 1 :: P][: self.context // P]
        self.group_mine = self.mine[ends]
        self.group_slot = self.slot[ends] // P  # a group's row in the key pool (a page holds whole groups)
        n_groups = int(self.group_mine.sum())
        gen = torch.Generator(device="cpu").manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dev)

        # the cached prefix's rows, random: the owned latent rows and group keys, the pending rows
        self.latent = torch.zeros(n_rows, cfg.kv_lora_rank, dtype=torch.bfloat16, device=dev)
        held = self.mine[: w.prefix]
        self.latent[self.slot[: w.prefix][held]] = rand(int(held.sum()), cfg.kv_lora_rank).to(torch.bfloat16)
        self.keys = torch.zeros(n_groups, cfg.index_head_dim, device=dev)
        gheld = self.group_mine[: w.prefix // P]
        self.keys[self.group_slot[: w.prefix // P][gheld]] = rand(int(gheld.sum()), cfg.index_head_dim)
        self.pending = rand(w.prefix % P, 2 * cfg.index_head_dim).to(torch.bfloat16)  # as the GPU store keeps them
        # the view's order: position -> its row in the gathered [C x owner rows] buffer (a loopback gather
        # holds rank 0's rows in every slot; the positions of other ranks read the same count of bytes)
        self.view_order = (
            torch.where(self.mine, self.slot, n_rows + self.slot % max(n_rows, 1)) if self.sharded else None
        )
        self.key_order = (
            torch.where(self.group_mine, self.group_slot, n_groups + self.group_slot % max(n_groups, 1))
            if self.sharded
            else None
        )
        wkv = attn.kv_b_proj.weight.view(cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        self.w_uk, self.w_uv = wkv[:, : cfg.qk_nope_head_dim], wkv[:, cfg.qk_nope_head_dim :]

    def at_rest_bytes(self) -> int:
        """The latent rows and group keys this rank holds once the chunk is stored, and the pending rows."""
        P = self.cfg.index_kpool
        return (
            self.latent.numel() * self.latent.element_size()
            + self.keys.numel() * self.keys.element_size()
            + (self.context % P) * 2 * self.cfg.index_head_dim * self.pending.element_size()
        )

    def attend(self, q: torch.Tensor, latent: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
        """``attn.attend`` on the selected rows only: MLA in its absorbed form (``q W_uk`` against the
        latent rows, the weighted latent rows through ``W_uv``) -> ``[T, dim]``."""
        cfg = self.cfg
        q_lat = torch.einsum("thd,hdr->thr", q, self.w_uk.to(q.dtype))
        rows = latent[selection.clamp(min=0).long()].to(q.dtype)  # [T, K, R]
        scores = torch.einsum("thr,tkr->thk", q_lat, rows) * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        scores = scores.masked_fill((selection < 0)[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.einsum("thk,tkr->thr", probs, rows)
        out = torch.einsum("thr,hvr->thv", out, self.w_uv.to(q.dtype)).reshape(len(q), -1)
        return self.attn.o_proj(out)

    def layer(self, h: torch.Tensor, positions: torch.Tensor, group: LoopbackGroup, tile: int) -> torch.Tensor:
        attn, cfg, w, P = self.attn, self.cfg, self.w, self.cfg.index_kpool
        R, Di = cfg.kv_lora_rank, cfg.index_head_dim
        proj = attn.project(h)
        assert proj.index_k is not None and proj.index_gate is not None
        assert proj.index_q is not None and proj.index_w is not None
        rows = torch.cat([proj.latent, proj.index_k, proj.index_gate], dim=-1)
        gathered = group.all_gather_padded(rows, [len(h)] * self.c, "glm53_current")  # [C x T_local, W]
        current = gathered[torch.arange(w.extend, device=h.device) % len(gathered)]  # to sequence order
        chunk = torch.arange(w.prefix, self.context, device=h.device)
        keep = self.mine[chunk]
        self.latent[self.slot[chunk][keep]] = current[keep, :R].to(self.latent.dtype)
        raw = torch.cat([self.pending.to(current.dtype), current[:, R:]])
        first = w.prefix - len(self.pending)  # a group boundary
        full = len(raw) // P * P
        if full:
            groups = torch.arange(first // P, (first + full) // P, device=h.device)
            mine = self.group_mine[groups]
            grouped = raw[:full].view(-1, P, 2 * Di)[mine]
            self.keys[self.group_slot[groups][mine]] = attn.pool(grouped[..., :Di], grouped[..., Di:]).float()
        if self.sharded:
            assert self.view_order is not None and self.key_order is not None
            latent = group.all_gather_padded(self.latent, [len(self.latent)] * self.c, "glm53_kv_view")[self.view_order]
            keys = group.all_gather_padded(self.keys, [len(self.keys)] * self.c, "glm53_index_view")[self.key_order]
        else:
            latent, keys = self.latent, self.keys
        out = h.new_zeros(len(h), cfg.dim)
        for s in range(0, len(h), tile):
            e = min(s + tile, len(h))
            scores = group_scores(proj.index_q[s:e], proj.index_w[s:e], keys, Di)
            out[s:e] = self.attend(proj.q[s:e], latent, select(cfg, scores, positions[s:e]))
        return out


# ---- timing -------------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> list[float]:
    """Milliseconds of ``fn()`` per run, ``repeats`` runs after a warm-up run (CUDA events; the host clock on a CPU)."""
    fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            out.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def received_by_tag(group: LoopbackGroup, run: Callable[[], Any]) -> dict[str, int]:
    """Bytes ``run()`` received per collective tag (what a real gather brings from the ``C - 1`` others)."""
    group.stats = []
    run()
    out: dict[str, int] = {}
    for stat in group.stats:
        out[stat.tag] = out.get(stat.tag, 0) + stat.bytes_received
    group.stats = []
    return out


def summary(ms: list[float]) -> dict[str, Any]:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "runs_ms": ms}


# ---- one workload -------------------------------------------------------------------------------------


def layers_of(cfg: Glm53Config) -> tuple[int, int]:
    """The first KDA layer and the first indexed layer with its own indexer."""
    kda = cfg.layer_types.index(KDA)
    indexed = next(i for i, t in enumerate(cfg.layer_types) if t == DSA and not cfg.shares_selection(i))
    return kda, indexed


def estimate_bytes(cfg: Glm53Config, w: Workload, cp_size: int, span: int, tile: int, dtype_bytes: int) -> int:
    """A bound on the bench's peak on one device: two layers' weights, the pools and views, the KDA
    working set and a query tile's scores and rows."""
    t_local = sum(n for _, n in rank0_blocks(w, cp_size))
    context = w.prefix + w.extend
    H, Dk = cfg.linear_num_heads, cfg.linear_head_dim
    weights = 2 * (4 * cfg.dim * cfg.qkv_dim + cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank)
    weights = weights * dtype_bytes + (cfg.q_lora_rank + cfg.dim) * cfg.n_heads * cfg.qk_nope_head_dim * dtype_bytes
    kda = t_local * (cfg.conv_dim * 2 + 4 * H * Dk * 3) * 4 + 4 * H * min(span, t_local) * 64 * Dk * 4
    pools = 3 * context * (cfg.kv_lora_rank * 2 + cfg.index_head_dim * 4 // cfg.index_kpool)
    chunk = cp_size * t_local * (cfg.kv_lora_rank + 2 * cfg.index_head_dim) * 4
    query = tile * (cfg.selection_width * (cfg.kv_lora_rank + 2 * cfg.n_heads) * 4) + SCORE_TILE_BYTES
    return int(1.2 * (weights + kda + pools + chunk + query)) + (1 << 28)


def query_tile(cfg: Glm53Config, context: int, wanted: int) -> int:
    """``wanted``, or fewer so that a tile's group scores stay under :data:`SCORE_TILE_BYTES`."""
    per_query = cfg.index_n_heads * max(1, context // cfg.index_kpool) * 4
    return max(1, min(wanted, SCORE_TILE_BYTES // per_query))


@torch.no_grad()
def measure(
    model: Glm53Model, cfg: Glm53Config, w: Workload, level: int, cp_size: int, args: Any, device: torch.device
) -> dict[str, Any]:
    """One level of one workload (see the module docstring)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kda_i, idx_i = layers_of(cfg)
    kda_attn, idx_attn = model.layers[kda_i].attn, model.layers[idx_i].attn
    assert isinstance(kda_attn, KDAttention) and isinstance(idx_attn, MLAttention)
    blocks = rank0_blocks(w, cp_size)
    t_local = sum(n for _, n in blocks)
    gen = torch.Generator(device="cpu").manual_seed(1)
    h = (torch.randn(t_local, cfg.dim, generator=gen) * 0.1).to(device=device, dtype=dtype)
    positions = torch.cat([torch.arange(p, p + n) for p, n in blocks]).to(device)
    group = LoopbackGroup(0, cp_size, device)
    H, Dk = cfg.linear_num_heads, cfg.linear_head_dim
    state = (
        (torch.randn(H, Dk, Dk, generator=gen) * 0.01).to(device) if w.prefix else torch.zeros(H, Dk, Dk, device=device)
    )
    conv = (torch.randn(kda_attn.halo, cfg.conv_dim, generator=gen) * 0.1).to(device=device, dtype=torch.bfloat16)
    if not w.prefix:
        conv.zero_()
    span = args.span
    kda = timed(lambda: kda_layer(kda_attn, h, blocks, group, state, conv, span), device, args.repeats)
    maps = torch.randn(2, H, Dk, 2 * Dk, generator=gen).to(device) * 0.01
    gather = timed(lambda: group.all_gather_padded(maps, [2] * cp_size, "glm53_kda_state"), device, args.repeats)
    all_maps = group.all_gather_padded(maps, [2] * cp_size, "glm53_kda_state")
    pairs = [(all_maps[i, ..., :Dk], all_maps[i, ..., Dk:]) for i in range(len(all_maps))]
    compose = timed(lambda: entering_states(state, pairs), device, args.repeats)
    tile = query_tile(cfg, w.prefix + w.extend, args.query_tile)
    rank = IndexedRank(idx_attn, w, cp_size, level)
    indexed = timed(lambda: rank.layer(h, positions, group, tile), device, args.repeats)
    received = {
        "kda": received_by_tag(group, lambda: kda_layer(kda_attn, h, blocks, group, state, conv, span)),
        "indexed": received_by_tag(group, lambda: rank.layer(h, positions, group, tile)),
    }
    maps_received = (2 * cp_size - 2) * planner.map_bytes(cfg)
    sharded = level >= 2 and cp_size > 1
    plan = planner.per_layer_at_rest(cfg, w.prefix + w.extend, cp_size, sharded)
    return {
        "level": level,
        "sharded_at_rest": sharded,
        "local_tokens": t_local,
        "blocks": [{"first": p, "tokens": n} for p, n in blocks],
        "query_tile": tile,
        "layer_ms": {"kda": summary(kda), "indexed": summary(indexed)},
        "kda_state_exchange": {
            "map_bytes": planner.map_bytes(cfg),
            "gathered_bytes": cp_size * 2 * H * Dk * 2 * Dk * 4,
            "received_bytes": maps_received,
            "all_gather_local_copy": summary(gather),
            "compose": summary(compose),
            "modeled_wire_ms": maps_received / args.wire_gbps / 1e6,
            "wire_gbps": args.wire_gbps,
        },
        "bytes_received_by_tag": received,
        "planner_exchange_bytes": planner.exchange_bytes(cfg, w.extend, w.prefix + w.extend, cp_size),
        "bytes_at_rest_per_layer": {
            "kda": state.numel() * state.element_size() + conv.numel() * conv.element_size(),
            "indexed": rank.at_rest_bytes(),
        },
        "planner_bytes_at_rest_per_layer": {"kda": plan["kda"], "indexed": plan["indexed"]},
    }


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write (rewritten after each workload)")
    parser.add_argument(
        "--preset",
        type=choice_arg(tuple(GLM53_PRESETS), "GLM-5.3 preset", "other families: python -m reference_impl.bench.layer"),
        default="glm-5.3-flash",
        help=", ".join(GLM53_PRESETS),
    )
    parser.add_argument("--cp-size", type=int_arg(1, MAX_PLAN_CP), default=8, help="CP ranks C (rank 0 is played)")
    parser.add_argument("--levels", default="0,2", help="phase levels among 0, 1, 2, comma separated")
    parser.add_argument(
        "--workloads", default="128k:0+131072,1m:1040384+8192", help="name:prefix+extend, comma separated"
    )
    parser.add_argument("--repeats", type=int_arg(1, MAX_REPEATS), default=5, help="timed runs per point")
    parser.add_argument("--span", type=int_arg(1), default=2048, help="KDA tokens per span within a block")
    parser.add_argument("--query-tile", type=int_arg(1), default=256, help="queries per tile on the indexed layer")
    parser.add_argument(
        "--wire-gbps", type=float_arg(), default=450.0, help="the modeled interconnect for the map all-gather, GB/s"
    )
    parser.add_argument("--device", type=device_arg, default="cuda", help="cuda, or cpu: a dry run")
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    output_file(args.out)
    levels = sorted(set(int_list(args.levels, "--levels", 0, 2)))
    workloads = parse_workloads(args.workloads)
    cfg = GLM53_PRESETS[args.preset]
    for w in workloads:
        what = f"--workloads {w.name}:{w.prefix}+{w.extend}"
        if w.extend < 2 * args.cp_size:
            raise ConfigError(
                f"{what}: {w.extend} new tokens; the in-seq split needs 2C = {2 * args.cp_size} (two blocks per rank)"
            )
        if w.prefix + w.extend > cfg.max_position_embeddings:
            raise ConfigError(
                f"{what}: {w.prefix + w.extend:,} tokens is past {args.preset}'s {cfg.max_position_embeddings:,}"
            )
    require_cuda(args.device)
    device = torch.device(args.device)
    free = footprint.free_bytes(device.type)
    dtype_bytes = 2 if device.type == "cuda" else 4
    for w in workloads:
        need = estimate_bytes(cfg, w, args.cp_size, args.span, args.query_tile, dtype_bytes)
        if free is not None and need > free:
            raise ConfigError(
                f"--workloads / --span / --query-tile: rank 0 of C={args.cp_size} at {w.prefix + w.extend:,} tokens "
                f"({args.preset}) needs up to {need / GIB:.1f} GiB on {device.type}, "
                f"which has {free / GIB:.1f} GiB free"
            )
    kda_i, idx_i = layers_of(cfg)
    model = build_glm53_model(
        cfg.with_layers(max(kda_i, idx_i) + 1), torch.bfloat16 if device.type == "cuda" else torch.float32, 0, device
    )
    doc: dict[str, Any] = {
        **run_record("glm53", argv, args.device),
        "preset": args.preset,
        "cp_size": args.cp_size,
        "rank": 0,
        "how_cp_runs": loopback_cp(0, args.cp_size, None)
        + f"; the map all-gather's wire is modeled at {args.wire_gbps:g} GB/s (modeled_wire_ms), never measured",
        "one_device_models_cp": True,
        "layers": {"kda": kda_i, "indexed": idx_i},
        "kernels": "none: the family's torch modules (the reference path)",
        "timing": f"CUDA events per layer, median, min and max of {args.repeats} runs after a warm-up run"
        if device.type == "cuda"
        else "perf_counter per layer (CPU dry run: the times mean nothing)",
        "span": args.span,
        "workloads": [],
    }
    for w in workloads:
        print(f"{w.name} {w.prefix}+{w.extend}: levels {levels}", file=sys.stderr, flush=True)
        points = [measure(model, cfg, w, level, args.cp_size, args, device) for level in levels]
        doc["workloads"].append({"workload": w.__dict__, "context": w.prefix + w.extend, "levels": points})
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")  # a run cut short keeps what finished
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def kda_tokens_per_second(
    tokens: int,
    heads: int,
    head_dim: int,
    *,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    kernel: str = "triton",
    seed: int = 0,
) -> float:
    """Tokens per second of one KDA layer's recurrence (``kernel``: ``"triton"`` or ``"torch"``, the
    reference) over ``tokens`` tokens of ``heads`` heads of ``head_dim``, inputs drawn as the layer makes
    them (unit ``q``, ``k``; ``g`` in ``(-5, 0)``). Timed by :func:`reference_impl.bench.timing.median_ms_timer`
    (``do_bench`` on a GPU, one call on a CPU). A measuring entry for a benchmark: it claims nothing."""
    from reference_impl.bench.timing import median_ms_timer
    from reference_impl.families.glm53.kernels.kda_triton import kda_chunked_triton
    from reference_impl.families.glm53.model.kda import kda_chunked

    if kernel not in ("triton", "torch"):
        raise ValueError(f"kernel={kernel!r}: 'triton' or 'torch'")
    if tokens < 1 or heads < 1 or head_dim < 1:
        raise ValueError(f"tokens={tokens}, heads={heads}, head_dim={head_dim}: all must be positive")
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q = torch.nn.functional.normalize(draw(tokens, heads, head_dim), dim=-1) * head_dim**-0.5
    k = torch.nn.functional.normalize(draw(tokens, heads, head_dim), dim=-1)
    v, g = draw(tokens, heads, head_dim), -5.0 * torch.sigmoid(draw(tokens, heads, head_dim))
    beta, state = torch.sigmoid(draw(tokens, heads)), draw(heads, head_dim, head_dim)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    run = kda_chunked_triton if kernel == "triton" else kda_chunked
    on_gpu = torch.device(device).type == "cuda"
    ms = median_ms_timer(on_gpu, warmup_ms=25, rep_ms=100)(lambda: run(q, k, v, g, beta, state))
    return tokens / (ms * 1e-3)

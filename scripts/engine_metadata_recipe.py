"""From an engine's batch metadata to the reference's calls: SGLang's forward batch and vLLM's attention metadata.

A port holds its engine's metadata, not this package's request list. This recipe builds both engines'
metadata for one small synthetic extend batch, with the engines' own field names, turns each into the
reference's calls (``ri.build_split``, ``physical_locs``, ``PageGather.build``) and checks, with assertions,
that both give the split, the physical locations and the gather plan the reference derives on its own.

    python3 scripts/engine_metadata_recipe.py                     # C = 2, pages of 4 tokens
    python3 scripts/engine_metadata_recipe.py --cp-size 4 --page-size 8 --shuffle 7 --json

The field names, as read in the engines' sources (the porting guide lists the revisions read):

* SGLang ``ForwardBatch``: ``req_pool_indices``, ``seq_lens`` (prefix + extend), ``extend_seq_lens``,
  ``extend_prefix_lens``, ``extend_start_loc``, ``out_cache_loc``, ``positions`` and the host copies
  ``extend_seq_lens_cpu`` / ``extend_prefix_lens_cpu``. The token table is ``ReqToTokenPool.req_to_token``
  (``[rows, max_context]`` int32, row 0 left for padding), its rows picked by ``req_pool_indices``.
* vLLM ``CommonAttentionMetadata``: ``query_start_loc`` (``[B + 1]``), ``seq_lens`` (computed plus scheduled
  tokens), ``block_table_tensor`` (``[B, max_blocks]`` int32) and ``slot_mapping``; ``BlockTable.
  compute_slot_mapping`` fills the slot mapping from the block table and the token positions.

What is checked: the split built from either engine's lengths is the reference's (and SGLang's published
zigzag rule; vLLM's DualChunkSwap gives each rank the same tokens in another order when every extend is a
multiple of ``2C``); the locations read from ``req_to_token`` / ``out_cache_loc`` and from the block table /
``slot_mapping`` are the reference allocator's; the owner and physical row of every loc match SGLang's
kv-shard placement formulas; every rank's ``PageGather`` plan is the reference's and rebuilds every view row;
and vLLM's DCP at an interleave of one page agrees with the reference's page ownership exactly for the
requests whose pages follow their positions. ``--shuffle SEED`` hands out pages in a shuffled order: the
comparisons with the reference's own allocator are skipped, every other check still runs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reference_impl as ri  # noqa: E402
from reference_impl.config import validate_page_size  # noqa: E402
from reference_impl.cp.batch import BatchLocs  # noqa: E402
from reference_impl.cp.ownership import Ownership, page_owner, physical_locs  # noqa: E402
from reference_impl.cp.page_gather import PageGather  # noqa: E402
from reference_impl.cp.split import SplitMetadata  # noqa: E402
from reference_impl.errors import ConfigError  # noqa: E402
from reference_impl.tool_args import refusing  # noqa: E402

MAX_CP_SIZE = 64  # the batch grows with C (extends of 6C and 4C tokens); past this the recipe is no longer small
PAD_SLOT = -1  # vLLM's slot-mapping value for a token another DCP rank stores (its PAD_SLOT_ID)
SGLANG_FIRST_ROW = 1  # SGLang keeps req_to_token's row 0 for padded batches; real requests start at row 1


# --------------------------------------------------------------------------------- the engines' metadata


@dataclass(frozen=True)
class SGLangForwardBatch:
    """The ``ForwardBatch`` fields an extend batch's split and cache locations come from (CPU tensors here)."""

    req_pool_indices: torch.Tensor  # [B] rows of req_to_token
    seq_lens: torch.Tensor  # [B] prefix + extend tokens
    extend_seq_lens: torch.Tensor  # [B]
    extend_prefix_lens: torch.Tensor  # [B]
    extend_start_loc: torch.Tensor  # [B] first batch row of each request's extend tokens
    out_cache_loc: torch.Tensor  # [T] the cache slot each extend token is written to
    positions: torch.Tensor  # [T] absolute position of each extend token
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]


@dataclass(frozen=True)
class VLLMAttentionMetadata:
    """The ``CommonAttentionMetadata`` fields of the same batch, plus the positions the slot mapping is built from."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] computed + scheduled tokens
    block_table_tensor: torch.Tensor  # [B, max_blocks] int32 block ids
    slot_mapping: torch.Tensor  # [T] int64 cache slot of each scheduled token
    positions: torch.Tensor  # [T]


@dataclass(frozen=True)
class EngineBatch:
    """What the reference needs from either engine: lengths and logical locs (the engines' slots are these)."""

    extend_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    request_locs: tuple[torch.Tensor, ...]  # per request: the slots of its prefix and extend tokens, in order
    extend_locs: torch.Tensor  # [T] the slots the extend tokens are written to, batch order


def request_pages(
    prefix_lens: list[int], extend_lens: list[int], page_size: int, shuffle: int | None
) -> list[list[int]]:
    """Page ids per request: the lowest free pages, request after request (what the reference's allocator
    hands out), or the same ids shuffled with seed ``shuffle``."""
    counts = [-(-(p + e) // page_size) for p, e in zip(prefix_lens, extend_lens)]
    ids = list(range(sum(counts)))
    if shuffle is not None:
        random.Random(shuffle).shuffle(ids)
    pages, start = [], 0
    for n in counts:
        pages.append(ids[start : start + n])
        start += n
    return pages


def token_slots(pages: list[int], n_tokens: int, page_size: int) -> torch.Tensor:
    """Slot of each token ``t < n_tokens`` of a request holding ``pages``: ``pages[t // P] * P + t % P``."""
    t = torch.arange(n_tokens)
    return torch.tensor(pages, dtype=torch.long)[t // page_size] * page_size + t % page_size


def sglang_batch(
    pages: list[list[int]], prefix_lens: list[int], extend_lens: list[int], page_size: int
) -> tuple[SGLangForwardBatch, torch.Tensor]:
    """The forward batch and ``req_to_token`` an SGLang scheduler would build for this allocation."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    rows = [SGLANG_FIRST_ROW + i for i in range(len(seq_lens))]
    req_to_token = torch.zeros((SGLANG_FIRST_ROW + len(seq_lens), max(seq_lens)), dtype=torch.int32)
    for row, request_page_ids, n in zip(rows, pages, seq_lens):
        req_to_token[row, :n] = token_slots(request_page_ids, n, page_size).to(torch.int32)
    out_cache_loc = torch.cat([req_to_token[row, p:n].long() for row, p, n in zip(rows, prefix_lens, seq_lens)])
    positions = torch.cat([torch.arange(p, n) for p, n in zip(prefix_lens, seq_lens)])
    starts = [0]
    for e in extend_lens[:-1]:
        starts.append(starts[-1] + e)
    batch = SGLangForwardBatch(
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32),
        out_cache_loc=out_cache_loc,
        positions=positions,
        extend_seq_lens_cpu=list(extend_lens),
        extend_prefix_lens_cpu=list(prefix_lens),
    )
    return batch, req_to_token


def vllm_slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> torch.Tensor:
    """vLLM's slot mapping, written from the arithmetic of ``BlockTable.compute_slot_mapping``: a virtual block
    spans ``P * dcp_size`` positions; position offset ``o`` in it is this rank's when ``(o // I) % dcp_size ==
    dcp_rank`` and then sits at ``(o // (dcp_size * I)) * I + o % I`` of the block; other ranks' tokens get -1."""
    request = torch.repeat_interleave(torch.arange(block_table.shape[0]), query_start_loc.diff().long())
    virtual_block = page_size * dcp_size
    block = block_table[request, positions // virtual_block].long()
    offset = positions % virtual_block
    local = (offset // interleave) % dcp_size == dcp_rank
    local_offset = (offset // (dcp_size * interleave)) * interleave + offset % interleave
    return torch.where(local, block * page_size + local_offset, torch.full_like(block, PAD_SLOT))


def vllm_metadata(
    pages: list[list[int]], prefix_lens: list[int], extend_lens: list[int], page_size: int
) -> VLLMAttentionMetadata:
    """The common attention metadata a vLLM worker would build for this allocation (no DCP)."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    block_table = torch.zeros((len(pages), max(len(p) for p in pages)), dtype=torch.int32)
    for i, request_page_ids in enumerate(pages):
        block_table[i, : len(request_page_ids)] = torch.tensor(request_page_ids, dtype=torch.int32)
    query_start_loc = torch.tensor([0, *torch.tensor(extend_lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(p, n) for p, n in zip(prefix_lens, seq_lens)])
    return VLLMAttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table_tensor=block_table,
        slot_mapping=vllm_slot_mapping(block_table, query_start_loc, positions, page_size),
        positions=positions,
    )


# ------------------------------------------------------------------------------- engine -> reference


def from_sglang(batch: SGLangForwardBatch, req_to_token: torch.Tensor) -> EngineBatch:
    """Lengths from the host copies, each request's slots from its ``req_to_token`` row; ``out_cache_loc``
    must be those rows' extend slots, in batch order."""
    extend_lens, prefix_lens = tuple(batch.extend_seq_lens_cpu), tuple(batch.extend_prefix_lens_cpu)
    if [p + e for p, e in zip(prefix_lens, extend_lens)] != batch.seq_lens.tolist():
        raise ConfigError("seq_lens: not extend_prefix_lens_cpu + extend_seq_lens_cpu per request")
    rows_and_lens = zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist())
    locs = tuple(req_to_token[row, :n].long() for row, n in rows_and_lens)
    extend_locs = torch.cat([request[p:] for request, p in zip(locs, prefix_lens)])
    if not torch.equal(batch.out_cache_loc.long(), extend_locs):
        raise ConfigError("out_cache_loc: not the req_to_token slots of the extend tokens, in batch order")
    return EngineBatch(extend_lens, prefix_lens, locs, extend_locs)


def from_vllm(md: VLLMAttentionMetadata, page_size: int) -> EngineBatch:
    """Lengths from ``query_start_loc`` and ``seq_lens``, each request's slots from its block-table row;
    ``slot_mapping`` must be the block table's slots at ``positions``."""
    extend = md.query_start_loc.diff().long()
    prefix = md.seq_lens.long() - extend
    if bool((prefix < 0).any()):
        raise ConfigError("seq_lens: shorter than the scheduled tokens of query_start_loc")
    locs = tuple(token_slots(md.block_table_tensor[i].tolist(), int(n), page_size) for i, n in enumerate(md.seq_lens))
    expected = vllm_slot_mapping(md.block_table_tensor, md.query_start_loc, md.positions, page_size)
    if not torch.equal(md.slot_mapping.long(), expected):
        raise ConfigError("slot_mapping: not the block table's slots at the scheduled positions")
    extend_locs = torch.cat([request[p:] for request, p in zip(locs, prefix.tolist())])
    return EngineBatch(tuple(extend.tolist()), tuple(prefix.tolist()), locs, extend_locs)


def batch_from_locs(meta: SplitMetadata, request_locs: tuple[torch.Tensor, ...]) -> BatchLocs:
    """The reference's batch coordinates over an engine's slots: the full view is every request's whole
    sequence, request after request (what ``BatchLocs.build`` derives, with the engine's locs instead of
    the reference allocator's)."""
    totals = [p + e for p, e in zip(meta.prefix_lens, meta.extend_lens)]
    offsets = [0]
    for n in totals[:-1]:
        offsets.append(offsets[-1] + n)
    starts = torch.tensor(offsets, dtype=torch.long)[torch.tensor(meta.token_request, dtype=torch.long)]
    view_rows = starts + torch.tensor(meta.token_position, dtype=torch.long)
    return BatchLocs(
        meta=meta,
        page_size=meta.page_size,
        n_pages=max(int(locs.max()) // meta.page_size for locs in request_locs) + 1,
        request_locs=request_locs,
        view_offsets=tuple(offsets),
        view_len=sum(totals),
        view_locs=torch.cat(request_locs),
        extend_locs=torch.cat([r[p:] for r, p in zip(request_locs, meta.prefix_lens)]),
        extend_view_rows=view_rows,
        key_start=starts,
        key_end=view_rows + 1,
    )


@dataclass(frozen=True)
class ReferenceView:
    """The reference's calls on one engine's batch: the split, every rank's physical locs and gather plan."""

    meta: SplitMetadata
    batch: BatchLocs
    physical: tuple[torch.Tensor, ...]  # per rank: physical locs of the view rows it owns, view order
    gathers: tuple[PageGather, ...]  # per rank: the materialization plan of the whole view


def reference_view(engine: EngineBatch, cp_size: int, page_size: int) -> ReferenceView:
    meta = ri.build_split("in-seq", cp_size, engine.extend_lens, engine.prefix_lens, page_size)
    batch = batch_from_locs(meta, engine.request_locs)
    owner = page_owner(batch.view_locs // page_size, cp_size)
    physical = tuple(physical_locs(batch.view_locs[owner == rank], page_size, cp_size) for rank in range(cp_size))
    ownership = Ownership(cp_size=cp_size, interleave=page_size, page_size=page_size)
    rows = torch.arange(batch.view_len)
    gathers = tuple(PageGather.build(batch, rows, rank, ownership) for rank in range(cp_size))
    return ReferenceView(meta, batch, physical, gathers)


# ------------------------------------------------------------------------ the engines' own rules (facts)


def sglang_zigzag_rank_tokens(extend_lens: tuple[int, ...], cp_size: int) -> tuple[tuple[int, ...], ...]:
    """SGLang's zigzag split as its strategy documents it: each request's extend cut into ``2C`` blocks of
    ``L // 2C`` tokens, the remainder one token each to the first blocks; rank ``r`` computes blocks ``r`` and
    ``2C - 1 - r``; its local order is its first block of every request, then its second block of every request."""
    firsts: list[list[int]] = [[] for _ in range(cp_size)]
    seconds: list[list[int]] = [[] for _ in range(cp_size)]
    offset = 0
    for length in extend_lens:
        base, rem = divmod(length, 2 * cp_size)
        sizes = [base + 1 if b < rem else base for b in range(2 * cp_size)]
        starts = [offset + sum(sizes[:b]) for b in range(2 * cp_size)]
        for rank in range(cp_size):
            first, second = rank, 2 * cp_size - 1 - rank
            firsts[rank] += range(starts[first], starts[first] + sizes[first])
            seconds[rank] += range(starts[second], starts[second] + sizes[second])
        offset += length
    return tuple(tuple(firsts[r] + seconds[r]) for r in range(cp_size))


def vllm_dual_chunk_swap_rank_tokens(extend_lens: tuple[int, ...], cp_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's PCP split (DualChunkSwap) as ``PCPManager.compute_rank_indices`` documents it: each prefill padded
    up to a multiple of ``2C`` and cut into ``2C`` equal chunks; rank ``r`` takes chunks ``r`` (head) and
    ``2C - 1 - r`` (tail), request after request, padding dropped."""
    ranks: list[list[int]] = [[] for _ in range(cp_size)]
    offset = 0
    for length in extend_lens:
        chunk = -(-length // (2 * cp_size))
        for rank in range(cp_size):
            for c in (rank, 2 * cp_size - 1 - rank):
                ranks[rank] += [offset + t for t in range(c * chunk, (c + 1) * chunk) if t < length]
        offset += length
    return tuple(tuple(tokens) for tokens in ranks)


def sglang_kv_shard_owner(locs: torch.Tensor, page_size: int, shard_size: int) -> torch.Tensor:
    """SGLang kv-shard placement (``PageInterleavePlacement.owner_of``): ``(loc % (N * ps)) // ps``."""
    return (locs % (shard_size * page_size)) // page_size


def sglang_kv_shard_local_index(locs: torch.Tensor, page_size: int, shard_size: int) -> torch.Tensor:
    """SGLang kv-shard placement (``PageInterleavePlacement.local_index``): ``(loc // (N * ps)) * ps + loc % ps``."""
    return (locs // (shard_size * page_size)) * page_size + locs % page_size


# ----------------------------------------------------------------------------------------- the checks


def _same_gather(a: PageGather, b: PageGather) -> bool:
    return (
        a.counts == b.counts
        and torch.equal(a.pages, b.pages)
        and torch.equal(a.send_physical, b.send_physical)
        and torch.equal(a.row_source, b.row_source)
        and torch.equal(a.view_rows, b.view_rows)
    )


def _gather_rebuilds_view(view: ReferenceView, cp_size: int, page_size: int) -> bool:
    """Every rank sends its ``send_physical`` pages, rank after rank; logical page = physical * C + owner, so
    ``row_source`` must lead every view row back to its own logical loc."""
    gathered = torch.cat([g.send_physical * cp_size + rank for rank, g in enumerate(view.gathers)])
    rows = view.gathers[0]
    rebuilt = gathered[rows.row_source // page_size] * page_size + rows.row_source % page_size
    return torch.equal(rebuilt, view.batch.view_locs[rows.view_rows])


def run_checks(cp_size: int, page_size: int, shuffle: int | None = None) -> dict[str, Any]:
    """Build both engines' metadata for the synthetic batch, run the reference's calls on each, assert they agree
    (with the reference's own derivation where the pages are the reference allocator's); a summary dict."""
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or not 1 <= cp_size <= MAX_CP_SIZE:
        raise ConfigError(f"cp_size={cp_size!r}: need an int in [1, {MAX_CP_SIZE}]")
    if not isinstance(page_size, int) or isinstance(page_size, bool):
        raise ConfigError(f"page_size={page_size!r}: need an int")
    validate_page_size(page_size)
    # A prefix that ends two tokens into a page, and extends that are multiples of 2C (so that vLLM's
    # DualChunkSwap and the zigzag give every rank the same tokens).
    prefix_lens, extend_lens = [page_size + 2, 0], [6 * cp_size, 4 * cp_size]
    pages = request_pages(prefix_lens, extend_lens, page_size, shuffle)
    fb, req_to_token = sglang_batch(pages, prefix_lens, extend_lens, page_size)
    md = vllm_metadata(pages, prefix_lens, extend_lens, page_size)
    engines = {"sglang": from_sglang(fb, req_to_token), "vllm": from_vllm(md, page_size)}
    views = {name: reference_view(engine, cp_size, page_size) for name, engine in engines.items()}
    checks: dict[str, bool] = {}

    sg, vl = views["sglang"], views["vllm"]
    checks["split: SGLang fields == vLLM fields"] = sg.meta == vl.meta
    checks["split: == SGLang's zigzag rule"] = sg.meta.rank_tokens == sglang_zigzag_rank_tokens(
        sg.meta.extend_lens, cp_size
    )
    dcs = vllm_dual_chunk_swap_rank_tokens(vl.meta.extend_lens, cp_size)
    checks["split: vLLM DualChunkSwap, same tokens per rank"] = all(
        sorted(a) == sorted(b) for a, b in zip(dcs, vl.meta.rank_tokens)
    )
    # Two requests, C >= 1: DualChunkSwap keeps a request's head and tail together, the zigzag puts every
    # request's first block before any second block, so the local orders differ; the rerange must follow.
    checks["split: vLLM local order differs (rerange needed)"] = dcs != vl.meta.rank_tokens
    checks["locs: SGLang == vLLM"] = all(
        torch.equal(a, b) for a, b in zip(sg.batch.request_locs, vl.batch.request_locs)
    )
    for name, view in views.items():
        locs = view.batch.view_locs
        checks[f"{name}: kv-shard owner == page_owner"] = torch.equal(
            sglang_kv_shard_owner(locs, page_size, cp_size), page_owner(locs // page_size, cp_size)
        )
        owner = page_owner(locs // page_size, cp_size)
        checks[f"{name}: kv-shard local index == physical_locs"] = all(
            torch.equal(sglang_kv_shard_local_index(locs[owner == r], page_size, cp_size), view.physical[r])
            for r in range(cp_size)
        )
        checks[f"{name}: gather rebuilds every view row"] = _gather_rebuilds_view(view, cp_size, page_size)
    checks["gather: SGLang == vLLM, every rank"] = all(_same_gather(a, b) for a, b in zip(sg.gathers, vl.gathers))

    if shuffle is None:  # the pages are the reference allocator's: compare with its own derivation
        own_meta = ri.build_split("in-seq", cp_size, extend_lens, prefix_lens, page_size)
        own = BatchLocs.build(own_meta)
        own_view = reference_view(
            EngineBatch(tuple(extend_lens), tuple(prefix_lens), own.request_locs, own.extend_locs), cp_size, page_size
        )
        ownership = Ownership(cp_size=cp_size, interleave=page_size, page_size=page_size)
        own_gathers = [PageGather.build(own, torch.arange(own.view_len), r, ownership) for r in range(cp_size)]
        checks["reference: split"] = sg.meta == own_meta
        checks["reference: batch coordinates"] = all(
            torch.equal(getattr(own_view.batch, f), getattr(own, f))
            for f in ("view_locs", "extend_locs", "extend_view_rows", "key_start", "key_end")
        )
        for name, view in views.items():
            checks[f"reference: {name} extend locs"] = torch.equal(engines[name].extend_locs, own.extend_locs)
            checks[f"reference: {name} gathers"] = all(_same_gather(a, b) for a, b in zip(view.gathers, own_gathers))

    # vLLM's DCP at an interleave of one page stores position t on rank (t // P) % C; the reference puts a
    # token on the owner of its allocator page. They agree on a request exactly where page k of it has an
    # id congruent to k mod C.
    agreement = []
    for i, request_page_ids in enumerate(pages):
        seq_len = prefix_lens[i] + extend_lens[i]
        by_position = (torch.arange(seq_len) // page_size) % cp_size
        by_page = page_owner(engines["vllm"].request_locs[i] // page_size, cp_size)
        follows = all(p % cp_size == k % cp_size for k, p in enumerate(request_page_ids))
        agreement.append(bool(torch.equal(by_position, by_page)) == follows)
    checks["vLLM DCP owner == page owner iff pages follow positions"] = all(agreement)

    failed = [name for name, ok in checks.items() if not ok]
    assert not failed, f"engine metadata and the reference disagree: {failed}"
    return {
        "cp_size": cp_size,
        "page_size": page_size,
        "shuffle": shuffle,
        "prefix_lens": prefix_lens,
        "extend_lens": extend_lens,
        "pages": pages,
        "rank_tokens": [list(t) for t in sg.meta.rank_tokens],
        "vllm_rank_tokens": [list(t) for t in dcs],
        "checks": checks,
    }


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp-size", type=int, default=2, help=f"CP ranks, 1 to {MAX_CP_SIZE} (default 2)")
    parser.add_argument("--page-size", type=int, default=4, help="tokens per page, a power of two in [4, 4096]")
    parser.add_argument("--shuffle", type=int, default=None, metavar="SEED", help="hand out pages in a shuffled order")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.cp_size <= MAX_CP_SIZE:
        raise ConfigError(f"--cp-size {args.cp_size}: need 1 to {MAX_CP_SIZE} ranks")
    try:
        validate_page_size(args.page_size)
    except ConfigError as exc:
        raise ConfigError(f"--page-size {args.page_size}: {exc}") from None
    summary = run_checks(args.cp_size, args.page_size, args.shuffle)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(
        f"C={summary['cp_size']} P={summary['page_size']} prefixes {summary['prefix_lens']} "
        f"extends {summary['extend_lens']} pages {summary['pages']}"
    )
    for rank, tokens in enumerate(summary["rank_tokens"]):
        print(f"  rank {rank}: zigzag {tokens}  vLLM order {summary['vllm_rank_tokens'][rank]}")
    for name in summary["checks"]:
        print(f"  ok  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

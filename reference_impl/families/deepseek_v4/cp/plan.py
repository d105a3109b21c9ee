"""The V4 chunk plan: which rows each rank sends and reads per layer, from the split alone.

Built once per chunk on every rank from the shared split metadata (pure host integers, then one
set of device index tensors), so the layer loop runs no host logic. Three kinds of rows cross
ranks, and a **halo** is what a rank needs from tokens it does not compute:

* **raw rows** (the encoded raw entries of current tokens, every layer): a query's sliding window
  reaches ``window - 1`` tokens back, into the previous block's rank (the *window halo*); and every
  rank keeps the window tail of each request (its last ``window - 1`` tokens) for the next chunk;
* **pre-pool rows** (float32 compressor values and scores, CSA and HCA layers): an entry is
  computed by the rank holding its **last** token (its *compute owner*), which reads the pre-pool
  rows of all its tokens: up to ``2m - 1`` earlier ones (CSA's 8-token overlapping window) or
  ``m - 1`` (HCA) may sit on the previous rank (the *compressor halo*); every rank keeps the
  compressor state (the incomplete windows' rows) of each request;
* **entries** (encoded compressed entries and CSA indexer keys): each rank computes the entries
  it is compute owner of; one all-gather gives every rank the chunk's new entries.

Positions before a request's chunk (its prefix) are never sent: the window tail, the compressor
state and the entries of the prefix are in every rank's store (:mod:`reference_impl.families.deepseek_v4.cp.store`).

A rank's **window table** is ``[window tails of the chunk's requests | its own raw rows | raw
halo rows]``; its **pool table** for ratio ``m`` is ``[compressor states | own pre-pool rows |
pre-pool halo rows]``. The plan maps every position a rank reads to a row of these tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from reference_impl.cp.split import SplitMetadata
from reference_impl.families.deepseek_v4.config import V4ModelConfig
from reference_impl.families.deepseek_v4.model.compressor import overlaps, state_start

Key = tuple[int, int]  # (chunk request index, absolute position) of a token, or (request, entry) of an entry


@dataclass
class Transfer:
    """One all-gather of rows: what each rank sends, and where this rank's needs land in the padded result.

    ``send[s]``: rank ``s``'s local rows it sends (indices into its own local order), every rank's list
    known to every rank; ``rows``: for each needed key of this rank, in need order, its row in the
    padded gather result (``sender * max(lengths) + slot``).
    """

    send: list[list[int]]
    need: list[Key]
    rows: list[int]

    @property
    def lengths(self) -> list[int]:
        return [len(s) for s in self.send]


def _transfer(
    needs: Sequence[set[Key]], holder: dict[Key, tuple[int, int]], rank: int, order: Callable[[Key], tuple[int, ...]]
) -> Transfer:
    """Send lists for every rank's ``needs`` (keys held elsewhere: ``holder[key] = (rank, local index)``)."""
    c = len(needs)
    wanted: list[set[Key]] = [set() for _ in range(c)]
    for r, keys in enumerate(needs):
        for key in keys:
            src, _ = holder[key]
            if src != r:
                wanted[src].add(key)
    send_keys = [sorted(keys, key=order) for keys in wanted]
    slot = {key: (s, k) for s, keys in enumerate(send_keys) for k, key in enumerate(keys)}
    width = max(1, max(len(k) for k in send_keys))
    mine = sorted((key for key in needs[rank] if holder[key][0] != rank), key=order)
    return Transfer(
        send=[[holder[key][1] for key in keys] for keys in send_keys],
        need=mine,
        rows=[slot[key][0] * width + slot[key][1] for key in mine],
    )


@dataclass
class RatioPlan:
    """What a rank does on the layers of one compress ratio ``m`` (4 or 128)."""

    ratio: int
    entries: list[Key]  # the chunk's new entries (request, w), in request then entry order
    entry_owner: list[int]  # compute owner of each (the rank of its last token)
    owned: list[int]  # indices into ``entries`` this rank computes, in order
    entry_rows: list[int]  # per chunk entry: its row in the padded entry all-gather
    entry_lengths: list[int]  # entries each rank computes
    state_rows: list[tuple[int, int]]  # per request: (first position, rows) of its compressor state
    pool: Transfer  # the pre-pool halo and state rows this rank reads from others
    slot_rows: list[list[int]]  # per owned entry: pool-table row of each slot (-1: absent)
    new_state_rows: list[list[int]]  # per request: pool-table rows of its next compressor state
    checkpoint_state_rows: dict[tuple[int, int], list[int]]  # (request, hit point Q) -> its state's rows at Q
    view_offsets: list[int]  # per request: first row of its entries in the entry view
    n_entries: list[int]  # per request: entries after the chunk (history + new)


@dataclass
class V4ChunkPlan:
    """A rank's plan for one chunk (see the module docstring)."""

    rank: int
    cp_size: int
    window: int
    local: list[int]  # global token ids in local order
    positions: list[int]  # their absolute positions
    requests: list[int]  # their chunk request index
    prefix_lens: list[int]
    extend_lens: list[int]
    tail_rows: list[tuple[int, int]]  # per request: (first position, rows) of its window tail in the store
    raw: Transfer
    window_rows: list[list[int]]  # per local query: window-table row of positions t - W + 1 .. t (-1: none)
    new_tail_rows: list[list[int]]  # per request: window-table rows of its next window tail
    ratios: dict[int, RatioPlan] = field(default_factory=dict)
    # (request, hit point Q) -> window-table rows of its window tail at Q (a later request hits it there)
    checkpoint_tail_rows: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @property
    def n_local(self) -> int:
        return len(self.local)

    def window_table_len(self) -> int:
        return sum(n for _, n in self.tail_rows) + self.n_local + len(self.raw.need)


def _positions(meta: SplitMetadata) -> tuple[dict[Key, int], dict[Key, tuple[int, int]]]:
    """``(key -> global id, key -> (compute rank, local index))`` for every current token."""
    gid, holder = {}, {}
    for r in range(meta.cp_size):
        for k, g in enumerate(meta.local_tokens(r)):
            key = (meta.token_request[g], meta.token_position[g])
            gid[key] = g
            holder[key] = (r, k)
    return gid, holder


def build_plan(
    meta: SplitMetadata, cfg: V4ModelConfig, rank: int, hit_points: Sequence[Sequence[int]] | None = None
) -> V4ChunkPlan:
    """The plan of ``rank`` for the chunk ``meta`` (every rank builds every rank's sends alike).

    ``hit_points[i]``: positions ``Q`` of chunk request ``i`` where a later request hits its prefix;
    those this chunk reaches (``prefix < Q <= end``) get a **checkpoint**: every rank keeps the window
    tail and the compressor states at ``Q`` (replicated, like the state at a request's end)."""
    c, w = meta.cp_size, cfg.window_size
    prefix, extend = list(meta.prefix_lens), list(meta.extend_lens)
    ends = [p + e for p, e in zip(prefix, extend)]
    n_req = len(prefix)
    _, holder = _positions(meta)
    order = lambda key: key  # noqa: E731 - (request, position) sorts in sequence order

    def current(i: int, p: int) -> bool:
        return prefix[i] <= p < ends[i]

    tails = [(max(0, p - (w - 1)), min(w - 1, p)) for p in prefix]
    new_tails = [range(max(0, e - (w - 1)), e) for e in ends]
    checkpoints = [
        sorted(q for q in set(hit_points[i]) if prefix[i] < q <= ends[i]) if hit_points else [] for i in range(n_req)
    ]
    checkpoint_tails = {(i, q): range(max(0, q - (w - 1)), q) for i in range(n_req) for q in checkpoints[i]}
    # Raw rows: every rank needs its queries' windows and every request's next window tail (and checkpoints').
    tail_keys = {(i, p) for i, span in enumerate(new_tails) for p in span if current(i, p)}
    tail_keys |= {(i, p) for (i, _), span in checkpoint_tails.items() for p in span if current(i, p)}
    raw_needs: list[set[Key]] = []
    for r in range(c):
        keys = set(tail_keys)
        for seg in meta.segments[r]:  # a run of consecutive positions: only its start looks back
            i = seg.request
            keys.update((i, q) for q in range(max(prefix[i], seg.q_abs_start - w + 1), seg.q_abs_start))
        raw_needs.append(keys)
    raw = _transfer(raw_needs, holder, rank, order)

    local = list(meta.local_tokens(rank))
    positions = [meta.token_position[g] for g in local]
    requests = [meta.token_request[g] for g in local]
    tail_base = [sum(n for _, n in tails[:i]) for i in range(n_req)]
    n_tail = sum(n for _, n in tails)
    local_row = {(requests[k], positions[k]): n_tail + k for k in range(len(local))}
    halo_row = {key: n_tail + len(local) + k for k, key in enumerate(raw.need)}

    def window_row(i: int, p: int) -> int:
        if p < prefix[i]:
            first, _ = tails[i]
            return tail_base[i] + p - first
        key = (i, p)
        return local_row[key] if key in local_row else halo_row[key]

    window_rows = [
        [window_row(i, q) if q >= 0 else -1 for q in range(t - w + 1, t + 1)] for i, t in zip(requests, positions)
    ]
    new_tail_rows = [[window_row(i, q) for q in new_tails[i]] for i in range(n_req)]
    plan = V4ChunkPlan(rank, c, w, local, positions, requests, prefix, extend, tails, raw, window_rows, new_tail_rows)
    plan.checkpoint_tail_rows = {key: [window_row(key[0], q) for q in span] for key, span in checkpoint_tails.items()}
    for ratio in sorted({r for r in cfg.compress_ratios[: cfg.n_layers] if r}):
        plan.ratios[ratio] = _ratio_plan(
            meta, ratio, rank, prefix, ends, holder, local, requests, positions, checkpoints
        )
    return plan


def _ratio_plan(
    meta: SplitMetadata,
    m: int,
    rank: int,
    prefix: list[int],
    ends: list[int],
    holder: dict[Key, tuple[int, int]],
    local: list[int],
    requests: list[int],
    positions: list[int],
    checkpoints: list[list[int]],
) -> RatioPlan:
    c, n_req = meta.cp_size, len(prefix)
    entries = [(i, e) for i in range(n_req) for e in range(prefix[i] // m, ends[i] // m)]
    owner = [holder[(i, (e + 1) * m - 1)][0] for i, e in entries]
    lengths = [owner.count(r) for r in range(c)]
    width = max(1, max(lengths))
    slot_in_rank: list[int] = []
    seen = [0] * c
    for r in owner:
        slot_in_rank.append(seen[r])
        seen[r] += 1
    entry_rows = [r * width + k for r, k in zip(owner, slot_in_rank)]
    states = [(state_start(p, m), p - state_start(p, m)) for p in prefix]
    new_states = [range(state_start(e, m), e) for e in ends]
    checkpoint_states = {(i, q): range(state_start(q, m), q) for i in range(n_req) for q in checkpoints[i]}

    def slots(i: int, e: int) -> list[int]:
        own = [e * m + j for j in range(m)]
        return [p - m for p in own] + own if overlaps(m) else own

    pool_needs: list[set[Key]] = []
    for r in range(c):
        keys = {(i, p) for i, span in enumerate(new_states) for p in span if p >= prefix[i]}
        keys |= {(i, p) for (i, _), span in checkpoint_states.items() for p in span if p >= prefix[i]}
        for (i, e), o in zip(entries, owner):
            if o == r:
                keys.update((i, p) for p in slots(i, e) if p >= prefix[i])
        pool_needs.append(keys)
    pool = _transfer(pool_needs, holder, rank, lambda key: key)
    state_base = [sum(n for _, n in states[:i]) for i in range(n_req)]
    n_state = sum(n for _, n in states)
    local_row = {(requests[k], positions[k]): n_state + k for k in range(len(local))}
    halo_row = {key: n_state + len(local) + k for k, key in enumerate(pool.need)}

    def pool_row(i: int, p: int) -> int:
        if p < 0:
            return -1
        if p < prefix[i]:
            first, _ = states[i]
            assert p >= first, f"position {p} of request {i} is older than its compressor state ({first})"
            return state_base[i] + p - first
        key = (i, p)
        return local_row[key] if key in local_row else halo_row[key]

    owned = [k for k, o in enumerate(owner) if o == rank]
    counts = [ends[i] // m for i in range(n_req)]
    return RatioPlan(
        ratio=m,
        entries=entries,
        entry_owner=owner,
        owned=owned,
        entry_rows=entry_rows,
        entry_lengths=lengths,
        state_rows=states,
        pool=pool,
        slot_rows=[[pool_row(entries[k][0], p) for p in slots(*entries[k])] for k in owned],
        new_state_rows=[[pool_row(i, p) for p in new_states[i]] for i in range(n_req)],
        checkpoint_state_rows={key: [pool_row(key[0], p) for p in span] for key, span in checkpoint_states.items()},
        view_offsets=[sum(counts[:i]) for i in range(n_req)],
        n_entries=counts,
    )

"""Agreement of a DeepSeek-V4 CP run with the V4 oracle (the V3.2 rules of :mod:`reference_impl.check`).

* **outputs**: every token's final hidden state, and every rank's output rows and logits, within
  the compute dtype's tolerance;
* **top-k** (CSA layers): per query, the selected entry sets equal the oracle's, a differing
  element accepted only where its oracle index score ties the k-th (exact arithmetic) or ranks
  within the boundary band (rounding-tolerant). Rounding-tolerant only: where the oracle's scores
  rank it outside the band, the ranks' own indexer keys score the row again. Those keys may differ
  from the oracle's by one e2m1 step per element (the cache rule below accepts that: FP4 turns a
  last-bit GEMM difference into a code flip), and a flipped key moves its entry's score for
  every query; the ranks selected from their keys, so the band is judged on those (with the
  oracle's indexer query: a rank's FP4 query can flip a code too, which this reading does not
  follow; ranks do not return their queries);
* **cache**, per layer and request, rebuilt from every rank's store and compared byte for byte
  (by value where the arithmetic is not reproducible): the window tail (last ``window - 1`` raw
  entries), the compressor state (float32 pre-pool rows), the compressed entries and indexer keys
  (every entry on at least one rank, every copy equal).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from reference_impl.check import (
    EXACT_TOLERANCE,
    ROUNDING_TOLERANCE,
    Agreement,
    _assemble,
    _topk_rows_agree,
    compare_outputs,
    exact_arithmetic,
)
from reference_impl.config import RunConfig
from reference_impl.cp.split import SplitMetadata
from reference_impl.engine import RankResult
from reference_impl.families.deepseek_v4.cache_layout import decode_index, decode_main
from reference_impl.families.deepseek_v4.cp.store import pack_pool
from reference_impl.families.deepseek_v4.model.oracle import V4Model, V4OracleResult
from reference_impl.workload import resolve_device


def compare_v4(
    run: RunConfig,
    meta: SplitMetadata,
    model: V4Model,
    oracle: V4OracleResult,
    results: list[RankResult],
    dtype: torch.dtype,
) -> Agreement:
    """Compare every rank's results with the V4 oracle; see the module docstring."""
    exact = exact_arithmetic(resolve_device(run), dtype)
    tol = EXACT_TOLERANCE if exact else ROUNDING_TOLERANCE
    problems: list[str] = []
    err, logits_err = compare_outputs(meta, model, torch.cat(oracle.hidden).float().cpu(), results, tol, problems)

    rows_total = rows_equal = ties = 0
    held: dict[tuple[int, int], torch.Tensor | None] = {}
    for layer, per_request in enumerate(oracle.topk):
        if per_request[0].shape[1] == 0:
            continue  # sliding and HCA layers select nothing
        got_all = _assemble(results, [r.local_topk[layer] for r in results], meta.total_tokens)
        for g in range(meta.total_tokens):
            req, pos = meta.token_request[g], meta.token_position[g]
            j = pos - run.requests[req].prefix
            got, ref = got_all[g], per_request[req][j].cpu()
            rows_total += 1
            if set(got[got >= 0].tolist()) == set(ref[ref >= 0].tolist()):
                rows_equal += 1
                continue
            scores = oracle.index_scores(layer, req, j)
            visible = (pos + 1) // 4
            if scores is not None and _topk_rows_agree(got, ref, scores[:visible].cpu(), exact):
                ties += 1
                continue
            if not exact:  # the band on the scores of the keys the ranks hold (module docstring)
                if (layer, req) not in held:
                    held[layer, req] = rank_held_keys(results, layer, req, oracle.caches[layer][req])
                keys = held[layer, req]
                scores = oracle.index_scores(layer, req, j, keys) if keys is not None else None
                if scores is not None and _topk_rows_agree(got, ref, scores[:visible].cpu(), exact):
                    ties += 1
                    continue
            problems.append(f"layer {layer} token {g}: top-k sets differ beyond boundary ties")

    cache_equal, cache_err = _compare_caches(oracle, results, run.model.window_size, tol, problems)  # type: ignore[union-attr]
    return Agreement(
        matches_oracle=not problems,
        max_abs_err=err,
        logits_max_abs_err=logits_err,
        topk_agreement=rows_equal / max(rows_total, 1),
        topk_ties=ties,
        cache_equal=cache_equal,
        cache_max_abs_err=cache_err,
        problems=problems[:20],
    )


def rank_held_keys(results: list[RankResult], layer: int, req: int, cache) -> torch.Tensor | None:  # noqa: ANN001
    """The indexer keys of request ``req`` at ``layer`` as the ranks hold them, decoded, in entry
    order ``[entries, Di]`` float32 (``None`` when some entry is on no rank: the cache check says so)."""
    n_entries = cache.index_keys.shape[0]
    keys = torch.zeros(n_entries, cache.index_head_dim)
    covered = torch.zeros(n_entries, dtype=torch.bool)
    for r in results:
        if req in r.stored[layer]:
            ids, index = _v4_rows(r.stored[layer][req])[3], _v4_rows(r.stored[layer][req])[5]
            keys[ids] = decode_index(index.cpu(), cache.codec, cache.index_head_dim).float()
            covered[ids] = True
    return keys if bool(covered.all()) else None


def _v4_rows(rows: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, ...]:
    """A rank's stored rows of one request and layer: every field a tensor (``V4Store.stored_rows``)."""
    tensors = tuple(t for t in rows if t is not None)
    assert len(tensors) == len(rows), "a V4 rank's stored rows hold no None"
    return tensors


def _compare_caches(
    oracle: V4OracleResult, results: list[RankResult], window: int, tol: float, problems: list[str]
) -> tuple[bool, float]:
    """Every layer's rebuilt cache against the oracle's (module docstring) -> ``(byte-equal, max error)``.

    Bytes can differ only where the values before quantization differ in their last bits (a rank's
    GEMM over its rows rounding differently from the oracle's, on a GPU); those parts are compared by
    value: within ``tol`` of the largest reference value, FP4 indexer keys within one e2m1 step
    (a third of their block's largest value).
    """
    equal, worst = True, 0.0
    for layer, caches in enumerate(oracle.caches):
        for req, cache in enumerate(caches):
            covered = torch.zeros(cache.entries.shape[0], dtype=torch.bool)
            codec = cache.codec
            for r in results:
                if req not in r.stored[layer]:
                    continue
                n_tokens, tail, pool, ids, main, index = _v4_rows(r.stored[layer][req])
                if int(n_tokens) != cache.n_tokens:
                    equal = False
                    problems.append(
                        f"layer {layer} request {req}: rank {r.rank} holds {int(n_tokens)} tokens, not {cache.n_tokens}"
                    )
                    continue
                parts: dict[str, tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor], float]] = {
                    "window tail": (
                        tail,
                        cache.window_tail(window).cpu(),
                        partial(decode_main, codec=codec),
                        tol,
                    ),
                    "compressor state": (pool, pack_pool(cache).cpu(), lambda b: b, tol),
                    "entries": (main, cache.entries[ids].cpu(), partial(decode_main, codec=codec), tol),
                }
                if cache.ratio == 4:
                    fp4 = 0.34 if codec == "fp8" else tol
                    parts["indexer keys"] = (
                        index,
                        cache.index_keys[ids].cpu(),
                        partial(decode_index, codec=codec, index_head_dim=cache.index_head_dim),
                        fp4,
                    )
                for what, (got, ref, values, bound) in parts.items():
                    if got.shape == ref.shape and torch.equal(got, ref):
                        continue
                    equal = False
                    if got.shape != ref.shape:
                        problems.append(
                            f"layer {layer} request {req}: rank {r.rank}'s {what} has shape {tuple(got.shape)}, "
                            f"not {tuple(ref.shape)}"
                        )
                        continue
                    a, b = values(got).float(), values(ref).float()
                    err = (a - b).abs().max().item() if a.numel() else 0.0
                    worst = max(worst, err)
                    if not err <= bound * max(1.0, b.abs().max().item() if b.numel() else 1.0):
                        problems.append(
                            f"layer {layer} request {req}: rank {r.rank}'s {what} differs (max abs err {err:.3g})"
                        )
                covered[ids] = True
            if not bool(covered.all()):
                equal = False
                problems.append(f"layer {layer} request {req}: {int((~covered).sum())} entries stored on no rank")
    return equal, worst

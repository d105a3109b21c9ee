"""Agreement of a DeepSeek-V4 CP run with the V4 oracle (the V3.2 rules of :mod:`reference_impl.check`).

* **outputs**: every token's final hidden state, and every rank's output rows and logits, within
  the compute dtype's tolerance;
* **top-k** (CSA layers): per query, the selected entry sets equal the oracle's, a differing
  element accepted only where its oracle index score ties the k-th (exact arithmetic) or ranks
  within the boundary band (rounding-tolerant);
* **cache**, per layer and request, rebuilt from every rank's store and compared byte for byte:
  the window tail (last ``window - 1`` raw entries), the compressor state (float32 pre-pool rows),
  the compressed entries and indexer keys (every entry on at least one rank, every copy equal).
"""

from __future__ import annotations

import torch

from reference_impl.check import (
    EXACT_TOLERANCE, ROUNDING_TOLERANCE, Agreement, _assemble, _topk_rows_agree, compare_outputs, exact_arithmetic,
)
from reference_impl.config import RunConfig
from reference_impl.cp.split import SplitMetadata
from reference_impl.cp.v4.store import pack_pool
from reference_impl.engine import RankResult
from reference_impl.model.v4.oracle import V4Model, V4OracleResult
from reference_impl.workload import resolve_device


def compare_v4(
    run: RunConfig, meta: SplitMetadata, model: V4Model, oracle: V4OracleResult, results: list[RankResult], dtype: torch.dtype
) -> Agreement:
    """Compare every rank's results with the V4 oracle; see the module docstring."""
    exact = exact_arithmetic(resolve_device(run), dtype)
    tol = EXACT_TOLERANCE if exact else ROUNDING_TOLERANCE
    problems: list[str] = []
    err, logits_err = compare_outputs(meta, model, torch.cat(oracle.hidden).float().cpu(), results, tol, problems)

    rows_total = rows_equal = ties = 0
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
            else:
                problems.append(f"layer {layer} token {g}: top-k sets differ beyond boundary ties")

    cache_equal = _compare_caches(oracle, results, run.model.window_size, problems)  # type: ignore[union-attr]
    return Agreement(
        matches_oracle=not problems, max_abs_err=err, logits_max_abs_err=logits_err,
        topk_agreement=rows_equal / max(rows_total, 1), topk_ties=ties, cache_equal=cache_equal,
        cache_max_abs_err=0.0 if cache_equal else float("nan"), problems=problems[:20],
    )


def _compare_caches(oracle: V4OracleResult, results: list[RankResult], window: int, problems: list[str]) -> bool:
    """Byte-for-byte comparison of every layer's rebuilt cache with the oracle's (module docstring)."""
    equal = True
    for layer, caches in enumerate(oracle.caches):
        for req, cache in enumerate(caches):
            covered = torch.zeros(cache.entries.shape[0], dtype=torch.bool)
            for r in results:
                if req not in r.stored[layer]:
                    continue
                n_tokens, tail, pool, ids, main, index = r.stored[layer][req]
                parts = {
                    "token count": int(n_tokens) == cache.n_tokens,
                    "window tail": torch.equal(tail, cache.window_tail(window).cpu()),
                    "compressor state": torch.equal(pool, pack_pool(cache).cpu()),
                    "entries": torch.equal(main, cache.entries[ids].cpu()),
                    "indexer keys": torch.equal(index, cache.index_keys[ids].cpu()) if cache.ratio == 4 else index.numel() == 0,
                }
                for what, same in parts.items():
                    if not same:
                        equal = False
                        problems.append(f"layer {layer} request {req}: rank {r.rank}'s {what} differs from the oracle's")
                covered[ids] = True
            if not bool(covered.all()):
                equal = False
                problems.append(f"layer {layer} request {req}: {int((~covered).sum())} entries stored on no rank")
    return equal

"""A GLM-5.3 CP run against its oracle: outputs, selections and caches.

* **outputs**: every token's final hidden state, every rank's output rows and logits
  (:func:`reference_impl.check.compare_outputs`), within the exact tolerance on a CPU in float32;
* **selections**: per indexed layer and query, the selected positions equal the oracle's, as sets
  (float32 index scores of random weights do not tie; a tie rule is not built);
* **caches**: every KDA layer's state and convolution tail on every rank equal the oracle's (the state
  within :data:`STATE_TOL`: the blocks' maps compose it in another order than the sequential
  recurrence); every latent row and every pooled group key is held (exactly once with phase 2) and
  equals the oracle's within :data:`ROW_TOL` (bf16 rows: a rank's GEMM over other rows may round the
  last bit the other way).
"""

from __future__ import annotations

from typing import Any

import torch

from reference_impl.check import EXACT_TOLERANCE, ROUNDING_TOLERANCE, Agreement, compare_outputs, exact_arithmetic
from reference_impl.config import RunConfig
from reference_impl.cp.split import SplitMetadata
from reference_impl.families.glm53.model.oracle import DSACache, Glm53OracleResult, KDACache
from reference_impl.workload import resolve_device

STATE_TOL = 1e-4  # relative to max(1, max |state|), float32
ROW_TOL = 1e-2  # relative to max(1, max |row|): one bf16 rounding step


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(1.0, float(want.float().abs().max())) if want.numel() else 1.0
    return float((got.float() - want.float()).abs().max()) / scale if want.numel() else 0.0


def compare_glm53(
    run: RunConfig,
    meta: SplitMetadata,
    model: torch.nn.Module,
    oracle: Glm53OracleResult,
    results: list[Any],
    compute_dtype: torch.dtype,
) -> Agreement:
    problems: list[str] = []
    exact = exact_arithmetic(resolve_device(run), compute_dtype)
    tol = EXACT_TOLERANCE if exact else ROUNDING_TOLERANCE
    err, logits_err = compare_outputs(meta, model, torch.cat(oracle.hidden), results, tol, problems)
    cfg = run.model
    order = torch.tensor([g for r in results for g in r.token_ids], dtype=torch.long)
    rows_total = rows_equal = 0
    for layer in range(cfg.n_layers):
        if cfg.is_kda(layer):
            continue
        got = torch.empty(len(order), cfg.selection_width, dtype=torch.int32)
        got[order] = torch.cat([r.local_topk[layer] for r in results]).to(torch.int32)
        want = torch.cat(oracle.selections[layer]).to(torch.int32)
        same = (got == want).all(dim=1)
        rows_total, rows_equal = rows_total + len(same), rows_equal + int(same.sum())
        if not bool(same.all()):
            problems.append(f"layer {layer}: {int((~same).sum())} selection rows differ from the oracle's")
    cache_err, sharded = 0.0, run.phases.sharded_kv and run.cp_size > 1
    before_caches = len(problems)
    for layer in range(cfg.n_layers):
        for req in range(len(run.requests)):
            ref = oracle.caches[layer][req]
            held = [r.stored[layer][req] for r in results]
            if isinstance(ref, KDACache):
                for rank, (state, conv) in enumerate(held):
                    if state is None:
                        problems.append(f"layer {layer} request {req}: rank {rank} has no KDA state")
                        continue
                    e = _err(state, ref.state)
                    cache_err = max(cache_err, e, _err(conv, ref.conv))
                    if not e <= STATE_TOL or not _err(conv, ref.conv) <= STATE_TOL:
                        problems.append(f"layer {layer} request {req}: rank {rank}'s KDA state differs ({e:.3g})")
                continue
            assert isinstance(ref, DSACache)
            for what, ref_rows, pick in (("latent rows", ref.latent, (0, 1)), ("group keys", ref.group_keys, (2, 3))):
                if ref_rows is None:
                    continue
                got_rows = torch.full(ref_rows.shape, float("nan"))
                copies = torch.zeros(len(ref_rows), dtype=torch.long)
                for entry in held:
                    ids, rows = entry[pick[0]], entry[pick[1]]
                    ids = ids[ids < len(ref_rows)]
                    got_rows[ids] = rows[: len(ids)].float()
                    copies[ids] += 1
                e = _err(got_rows, ref_rows)
                cache_err = max(cache_err, e)
                if not e <= ROW_TOL:  # NaN (a row no rank holds) fails too
                    problems.append(f"layer {layer} request {req}: {what} differ or are missing ({e:.3g})")
                if sharded and bool((copies > 1).any()):
                    problems.append(f"layer {layer} request {req}: {what} held by several ranks under phase 2")
    cache_ok = len(problems) == before_caches
    return Agreement(not problems, err, logits_err, rows_equal / max(1, rows_total), 0, cache_ok, cache_err, problems)

"""A GLM-5.3 CP run against its oracle: outputs, selections and caches.

* **outputs**: every token's final hidden state, every rank's output rows and logits
  (:func:`reference_impl.check.compare_outputs`), within the exact tolerance on a CPU in float32;
* **selections**: per indexed layer and query, the selected positions equal the oracle's, as sets
  (among tied scores, which the ReLU makes common, the lower group id: :func:`~.model.dsa.select`);
* **caches**: every KDA layer's state and convolution tail on every rank equal the oracle's (the state
  within :data:`STATE_TOL`: the blocks' maps compose it in another order than the sequential
  recurrence; the tail, rows of the layer's input projection, within the hidden states' tolerance, as
  close as the layer's input is: after a layer of bf16 latent rows a last-bit flip reaches it; so is a
  state after an indexed layer, whose input an FP8 code moved by one step (an e4m3 step is 6-12% of the
  value) reaches, within the larger of the two); every
  latent row and every pooled group key is held (exactly once with phase 2) and
  equals the oracle's within :data:`ROW_TOL` (bf16 rows: a rank's GEMM over other rows may round the
  last bit the other way). FP8 latent rows (:mod:`.cache_layout`) are decoded and compared per 128-value
  tile within :data:`FP8_ROW_BOUND` of the tile's amax, plus :data:`ROW_TOL`: a last-bit difference before
  quantization may move a code by one step or a ue8m0 scale by a binade. That bound cannot tell the
  scale formats apart, so every held FP8 row, the run's and the oracle's, must also be in the run's
  ``mla_scale_fmt`` form (:func:`~.cache_layout.fp8_rows_in_format`, from the row's own bytes).

``cache_equal`` in the report: the caches agree as above **and** every stored latent row equals the
oracle's byte for byte (both encode with the run's :class:`~.cache_layout.LatentRows`; on a CPU in
float32 the bytes agree where a rank's projection GEMM spans enough rows to take the oracle's code path,
and a GEMM over a few rows may round a last bit the other way and flip one code, so ``cache_equal`` is
reported, not required). KDA states are never bit-equal (another order of sums) and are not part of it.
"""

from __future__ import annotations

from typing import Any

import torch

from reference_impl.check import EXACT_TOLERANCE, ROUNDING_TOLERANCE, Agreement, compare_outputs, exact_arithmetic
from reference_impl.config import RunConfig
from reference_impl.cp.split import SplitMetadata
from reference_impl.families.glm53.cache_layout import FP8_TILE, LatentRows
from reference_impl.families.glm53.model.oracle import DSACache, Glm53OracleResult, KDACache
from reference_impl.workload import resolve_device

STATE_TOL = 1e-4  # relative to max(1, max |state|), float32
ROW_TOL = 1e-2  # relative to max(1, max |row|): one bf16 rounding step
FP8_ROW_BOUND = 1 / 8  # of a tile's amax: two e4m3 roundings (the run's and the oracle's) of amax / 16 each


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()  # the ranks' rows come back on the host, the oracle's may not
    scale = max(1.0, float(want.float().abs().max())) if want.numel() else 1.0
    return float((got.float() - want.float()).abs().max()) / scale if want.numel() else 0.0


def _rows_agree(fmt: LatentRows, got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    """Stored latent rows ``got`` against the oracle's ``want`` (the same format): ``(error, within bound)``,
    the error of the decoded values relative to ``max(1, max |want|)``."""
    got_values, want_values = fmt.decode(got).float(), fmt.decode(want).float()
    err = _err(got_values, want_values)
    if not fmt.fp8:
        return err, err <= ROW_TOL
    want_tiles = want_values.unflatten(-1, (-1, FP8_TILE))
    bound = want_tiles.abs().amax(-1, keepdim=True) * FP8_ROW_BOUND + ROW_TOL * max(1.0, float(want_values.abs().max()))
    diff = (got_values.unflatten(-1, (-1, FP8_TILE)) - want_tiles).abs()
    return err, bool((diff <= bound).all())


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
    rows_bytes_equal = True
    before_caches = len(problems)
    for layer in range(cfg.n_layers):
        # A KDA layer's input is the oracle's up to the composed states' order of sums until an indexed layer
        # has run; after one, as close as the hidden states are (module docstring).
        after_indexed = any(not cfg.is_kda(earlier) for earlier in range(layer))
        state_tol = max(STATE_TOL, tol) if after_indexed else STATE_TOL
        for req in range(len(run.requests)):
            ref = oracle.caches[layer][req]
            held = [r.stored[layer][req] for r in results]
            if isinstance(ref, KDACache):
                for rank, (state, conv) in enumerate(held):
                    if state is None:
                        problems.append(f"layer {layer} request {req}: rank {rank} has no KDA state")
                        continue
                    e = _err(state, ref.state)
                    conv_err = _err(conv, ref.conv)
                    cache_err = max(cache_err, e, conv_err)
                    if not e <= state_tol or not conv_err <= tol:
                        problems.append(
                            f"layer {layer} request {req}: rank {rank}'s KDA state ({e:.3g}) or tail ({conv_err:.3g}) "
                            "differs"
                        )
                continue
            assert isinstance(ref, DSACache)
            for what, ref_rows, pick in (("latent rows", ref.latent, (0, 1)), ("group keys", ref.group_keys, (2, 3))):
                if ref_rows is None:
                    continue
                ref_rows = ref_rows.cpu()
                got_rows = torch.zeros_like(ref_rows)  # as stored: uint8 FP8 rows, bf16 rows, float32 keys
                copies = torch.zeros(len(ref_rows), dtype=torch.long)
                for entry in held:
                    ids, rows = entry[pick[0]], entry[pick[1]]
                    ids = ids[ids < len(ref_rows)]
                    got_rows[ids] = rows[: len(ids)].to(got_rows)
                    copies[ids] += 1
                missing = int((copies == 0).sum())
                if what == "latent rows":
                    e, ok = _rows_agree(ref.rows, got_rows, ref_rows)
                    held_rows = copies > 0
                    if not bool(ref.rows.in_format(got_rows[held_rows]).all() and ref.rows.in_format(ref_rows).all()):
                        problems.append(f"layer {layer} request {req}: latent rows not in {run.mla_scale_fmt} form")
                    rows_bytes_equal &= torch.equal(got_rows, ref_rows)
                else:
                    e = _err(got_rows, ref_rows)
                    ok = e <= ROW_TOL
                cache_err = max(cache_err, e)
                if missing or not ok:
                    problems.append(f"layer {layer} request {req}: {what} differ ({e:.3g}) or are missing ({missing})")
                if sharded and bool((copies > 1).any()):
                    problems.append(f"layer {layer} request {req}: {what} held by several ranks under phase 2")
    cache_equal = len(problems) == before_caches and rows_bytes_equal
    return Agreement(
        not problems, err, logits_err, rows_equal / max(1, rows_total), 0, cache_equal, cache_err, problems
    )


def decode_cache_mismatches(run: RunConfig, decoded: list[list[Any]], oracle: Glm53OracleResult) -> list[str]:
    """A PD decode's caches (``[layer][request]``, the oracle's types, :mod:`.pd`) against the oracle's, within
    the bounds :func:`compare_glm53` holds the ranks' caches to (the decode's are the ranks' bytes, which the
    transfer's own check compares byte for byte); the pending indexer rows, projection outputs like the group
    keys' inputs, within :data:`ROW_TOL`. On a CPU in float32 (the PD check's device)."""
    problems: list[str] = []
    cfg, tol = run.model, EXACT_TOLERANCE
    for layer, per_request in enumerate(oracle.caches):
        state_tol = max(STATE_TOL, tol) if any(not cfg.is_kda(e) for e in range(layer)) else STATE_TOL
        for req, ref in enumerate(per_request):
            got = decoded[layer][req]
            where = f"layer {layer} request {req}"
            if isinstance(ref, KDACache):
                e, conv_err = _err(got.state, ref.state), _err(got.conv, ref.conv)
                if not e <= state_tol or not conv_err <= tol:
                    problems.append(f"{where}: the decode's KDA state ({e:.3g}) or tail ({conv_err:.3g}) differs")
                continue
            assert isinstance(ref, DSACache) and isinstance(got, DSACache)
            if got.latent.shape != ref.latent.shape:
                problems.append(
                    f"{where}: the decode holds {len(got.latent)} latent rows, the oracle {len(ref.latent)}"
                )
                continue
            e, ok = _rows_agree(ref.rows, got.latent.cpu(), ref.latent.cpu())
            if not ok or not bool(ref.rows.in_format(got.latent.cpu()).all()):
                problems.append(f"{where}: the decode's latent rows differ ({e:.3g}) or are not in their format")
            for what, a, b in (
                ("group keys", got.group_keys, ref.group_keys),
                ("pending keys", got.pending_k, ref.pending_k),
                ("pending gates", got.pending_gate, ref.pending_gate),
            ):
                if b is None:
                    continue
                if a is None or a.shape != b.shape or not _err(a, b) <= ROW_TOL:
                    problems.append(f"{where}: the decode's {what} differ from the oracle's")
    return problems

"""Agreement of a CP run with the single-device oracle.

Three checks, each of which can fail on its own:

* **outputs**: every token's final hidden state (reassembled from the ranks' local outputs) and
  every rank's collected output rows and logits, within the compute dtype's tolerance;
* **top-k**: per layer and query, the index **sets** equal the oracle's; a differing element is
  accepted only at the selection boundary, and a selected key the oracle cannot see (outside the
  causal range) always fails. Two rules, by how reproducible the arithmetic is:

  - *exact* (float32 on a CPU, where a rank's GEMMs give the oracle's bits): a differing
    element's oracle score must tie the k-th within :data:`TIE_RTOL`;
  - *rounding-tolerant* (a GPU, or bf16): a rank's GEMMs batch other rows than the oracle's, the
    last bits of the projections differ, FP8 codes of indexer q / k flip, scores move by a few
    percent and keys near the k-th trade places, more in later layers. A differing element must
    rank within :data:`BOUNDARY_BAND` x k of k in the oracle's order, and outputs get the bf16
    tolerance. Calibrated on an H200 (``docs/results/check_calibration.json``, from
    ``scripts/calibrate_check.py``): swaps reached 6% of k and output errors 2% of the largest
    value, in bf16 and float32 alike;
* **cache**: the KV and indexer K bytes rebuilt from every rank equal the oracle's dense cache
  byte for byte (where several ranks hold a token, every copy must be equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reference_impl.config import RunConfig
from reference_impl.cp.split import SplitMetadata
from reference_impl.engine import RankResult
from reference_impl.model.oracle import DSAModel, OracleResult
from reference_impl.workload import resolve_device

# Max abs error allowed, relative to max(1, max |reference|): exact, and rounding-tolerant.
EXACT_TOLERANCE, ROUNDING_TOLERANCE = 2e-3, 6e-2
TIE_RTOL = 2e-2  # exact: an FP8 rounding flip moves an index score by a few percent at most
BOUNDARY_BAND = 0.10  # rounding-tolerant: swaps only among the oracle's ranks k(1 +- 10%) (6% seen)


def exact_arithmetic(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a rank reproduces the oracle's bits: float32 on a CPU (GEMMs over >= 16 rows)."""
    return device.type == "cpu" and dtype == torch.float32


@dataclass
class Agreement:
    matches_oracle: bool
    max_abs_err: float
    logits_max_abs_err: float
    topk_agreement: float  # fraction of (layer, query) rows whose top-k sets are exactly equal
    topk_ties: int  # rows that differ only by boundary ties
    cache_equal: bool  # byte for byte
    cache_max_abs_err: float  # dequantized MLA and index K values
    problems: list[str] = field(default_factory=list)


def _scaled_err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(max |out - ref|, max(1, max |ref|))``; NaN anywhere in ``out`` gives a NaN error, which fails."""
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    return err, max(1.0, ref.float().abs().max().item() if ref.numel() else 1.0)


def _assemble(results: list[RankResult], per_rank: list[torch.Tensor], total: int) -> torch.Tensor:
    """Every rank's rows (in its ``token_ids`` order) -> run-global token order; each token exactly once."""
    order = torch.tensor([g for r in results for g in r.token_ids], dtype=torch.long)
    if sorted(order.tolist()) != list(range(total)):
        raise AssertionError("the ranks' token ids do not cover every token exactly once")
    full = torch.empty((total, *per_rank[0].shape[1:]), dtype=per_rank[0].dtype)
    full[order] = torch.cat(per_rank)
    return full


def _topk_rows_agree(got: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor | None, exact: bool) -> bool:
    """Sets equal, or every differing element sits at the boundary (see the module docstring).

    ``scores``: the oracle's index scores of the row's visible keys (request positions).
    """
    a, b = set(got[got >= 0].tolist()), set(ref[ref >= 0].tolist())
    if a == b:
        return True
    if scores is None or len(a) != len(b) or max(a | b) >= scores.shape[0]:
        return False
    diff = torch.tensor(sorted(a ^ b), dtype=torch.long)
    if exact:
        kth = scores[ref[ref >= 0].long()].min()
        return bool(((scores[diff] - kth).abs() <= TIE_RTOL * kth.abs() + 1e-6).all())
    k = len(b)
    rank = torch.empty_like(scores, dtype=torch.long)
    rank[scores.argsort(descending=True)] = torch.arange(scores.shape[0])
    band = max(1, round(BOUNDARY_BAND * k))
    return bool(((rank[diff] >= k - band) & (rank[diff] < k + band)).all())


def compare_outputs(
    meta: SplitMetadata,
    model: torch.nn.Module,
    ref_hidden: torch.Tensor,
    results: list[RankResult],
    tol: float,
    problems: list[str],
) -> tuple[float, float]:
    """Every token's final hidden state and every rank's output rows and logits against the oracle's
    ``ref_hidden`` (float32, run-global token order); appends to ``problems``, returns
    ``(max abs err, logits max abs err)``. Shared by the DSA and the V4 checks."""
    hidden = _assemble(results, [r.local_hidden for r in results if r.local_hidden is not None], meta.total_tokens)
    err, scale = _scaled_err(hidden, ref_hidden)
    if not err <= tol * scale:  # NaN fails too
        problems.append(f"hidden states differ: max abs err {err:.3g} > {tol * scale:.3g}")

    logits_err = 0.0
    for r in results:
        ref_rows = ref_hidden[list(r.row_ids)]
        row_err, row_scale = _scaled_err(r.rows, ref_rows)
        ref_logits = model.logits(ref_rows.to(model.head.weight)).cpu()  # type: ignore[operator]
        l_err, l_scale = _scaled_err(r.logits, ref_logits)
        logits_err = max(logits_err, l_err)
        err = max(err, row_err)
        if not row_err <= tol * row_scale:
            problems.append(f"rank {r.rank}: output rows differ (max abs err {row_err:.3g})")
        if not l_err <= tol * l_scale:
            problems.append(f"rank {r.rank}: logits differ (max abs err {l_err:.3g})")
    return err, logits_err


def compare(
    run: RunConfig,
    meta: SplitMetadata,
    model: DSAModel,
    oracle: OracleResult,
    results: list[RankResult],
    dtype: torch.dtype,
) -> Agreement:
    """Compare every rank's results with the oracle; see the module docstring."""
    exact = exact_arithmetic(resolve_device(run), dtype)
    tol = EXACT_TOLERANCE if exact else ROUNDING_TOLERANCE
    problems: list[str] = []

    ref_hidden = torch.cat(oracle.hidden).float().cpu()
    err, logits_err = compare_outputs(meta, model, ref_hidden, results, tol, problems)

    rows_total = rows_equal = ties = 0
    n_layers = len(oracle.topk)
    per_layer = [
        _assemble(results, [r.local_topk[layer] for r in results], meta.total_tokens) for layer in range(n_layers)
    ]
    for layer in range(n_layers):
        for g in range(meta.total_tokens):
            req, j = meta.token_request[g], meta.token_position[g] - meta.prefix_lens[meta.token_request[g]]
            got, ref = per_layer[layer][g], oracle.topk[layer][req][j].cpu()
            rows_total += 1
            if set(got[got >= 0].tolist()) == set(ref[ref >= 0].tolist()):
                rows_equal += 1
            elif _topk_rows_agree(
                got, ref, oracle.index_scores(layer, req, j)[: meta.token_position[g] + 1].cpu(), exact
            ):
                ties += 1
            else:
                problems.append(f"layer {layer} token {g}: top-k sets differ beyond boundary ties")

    cache_equal, cache_err = _compare_caches(oracle, results, tol, problems)
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


def _compare_caches(
    oracle: OracleResult, results: list[RankResult], tol: float, problems: list[str]
) -> tuple[bool, float]:
    """Rebuild each request's cache from every rank's stored rows and compare with the oracle's.

    Returns (byte-for-byte equal, max abs error of the dequantized values). Bytes can differ only
    where the pre-quantization values differ in their last bits (a matmul of T/C rows rounding
    differently from one of T rows, e.g. on a GPU); values beyond ``tol`` are a problem.
    """
    equal, worst = True, 0.0
    for layer, caches in enumerate(oracle.caches):
        for req, cache in enumerate(caches):
            covered = torch.zeros(len(cache), dtype=torch.bool)
            ref_kv = cache.layout.dequantize_mla(cache.mla_rows).cpu()
            ref_k = cache.index_fp8.float().cpu() * cache.index_scale.cpu()[:, None]
            for r in results:
                if req not in r.stored[layer]:
                    continue
                pos, rows, k_bytes, k_scale = r.stored[layer][req]
                if (k_bytes is not None) != cache.with_index:  # IndexShare: index K on full layers only
                    equal = False
                    problems.append(
                        f"layer {layer} request {req}: rank {r.rank} keeps index K where the oracle "
                        f"{'keeps' if cache.with_index else 'keeps none'}"
                    )
                    continue
                same = torch.equal(rows, cache.mla_rows[pos].cpu()) and (
                    k_bytes is None
                    or k_scale is None
                    or (
                        torch.equal(k_bytes, cache.index_fp8[pos].cpu().view(torch.uint8))
                        and torch.equal(k_scale, cache.index_scale[pos].cpu())
                    )
                )
                equal &= same
                if not same:
                    kv = cache.layout.dequantize_mla(rows)
                    err = (kv - ref_kv[pos]).abs().max().item()
                    if k_bytes is not None and k_scale is not None:
                        k = k_bytes.view(torch.float8_e4m3fn).float() * k_scale[:, None]
                        err = max(err, (k - ref_k[pos]).abs().max().item())
                    worst = max(worst, err)
                    if not err <= tol * max(1.0, ref_kv.abs().max().item()):
                        problems.append(
                            f"layer {layer} request {req}: rank {r.rank}'s cache differs (max abs err {err:.3g})"
                        )
                covered[pos] = True
            if not bool(covered.all()):
                equal = False
                problems.append(f"layer {layer} request {req}: {int((~covered).sum())} tokens stored on no rank")
    return equal, worst

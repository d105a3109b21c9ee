"""How far a CP run's top-k and outputs drift from the oracle's on a GPU, per compute dtype: the data
behind the rounding-tolerant rule of :mod:`reference_impl.check`.

One rank alone (C = 1), so the run differs from the oracle only in how rows are batched into GEMMs
(the oracle projects each request on its own, the engine the whole batch). On a GPU that changes
the last bits of the projections, the FP8 codes of some indexer q / k flip, index scores move by a
few percent and keys near the k-th trade places; the next layer inherits the drift.

    PYTHONPATH=. python3 scripts/calibrate_check.py --out docs/results/check_calibration.json   # CUDA
"""

from __future__ import annotations

import json
import shlex
import sys

import torch

from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.errors import ConfigError
from reference_impl.runner import run_prefill
from reference_impl.tool_args import ToolParser, output_file, refusing

PROG = "python3 scripts/calibrate_check.py"

REQUESTS = (Request(1000, 2100), Request(64, 900))


def _p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * len(values))] if values else 0.0


def drift(dtype: str) -> dict:
    run = RunConfig(
        preset="deepseek-v3.2",
        n_layers=2,
        cp_size=1,
        requests=REQUESTS,
        device="cuda",
        compute_dtype=dtype,
        phases=PhaseSet(),
    )
    result = run_prefill(run, tensors=True)
    oracle, rank = result.oracle, result.ranks[0]
    stats: dict = {"matches": result.report["matches_oracle"], "topk_agreement": result.report["topk_agreement"]}
    for layer in range(run.model.n_layers):
        differ, rank_off, gaps, sizes = 0, [], [], []
        for row, g in enumerate(rank.token_ids):
            req = 0 if g < REQUESTS[0].extend else 1
            j = g - (0 if req == 0 else REQUESTS[0].extend)
            got, ref = rank.local_topk[layer][row], oracle.topk[layer][req][j].cpu()
            a, b = set(got[got >= 0].tolist()), set(ref[ref >= 0].tolist())
            if a == b:
                continue
            differ += 1
            scores = oracle.index_scores(layer, req, j)[: REQUESTS[req].prefix + j + 1].float().cpu()
            order = scores.argsort(descending=True)
            ranks = torch.empty_like(order)
            ranks[order] = torch.arange(len(order))
            swapped = torch.tensor(sorted(a ^ b))
            rank_off.append(int((ranks[swapped] - len(b)).abs().max()))
            gaps.append(float(((scores[swapped] - scores[order[len(b) - 1]]).abs() / scores[order[0]].abs()).max()))
            sizes.append(len(a ^ b))
        stats[f"layer{layer}"] = {
            "rows": len(rank.token_ids),
            "rows_differ": differ,
            "rank_off_max": max(rank_off, default=0),
            "rank_off_p99": _p99(rank_off),
            "elements_differ_max": max(sizes, default=0),
            "score_gap_over_max_score_max": max(gaps, default=0.0),
            "score_gap_p99": _p99(gaps),
        }
    ref_rows = torch.cat([h.float().cpu() for h in oracle.hidden])[list(rank.token_ids)]
    err = (rank.local_hidden.float() - ref_rows).abs()
    stats.update(
        {
            "hidden_max_abs_err": float(err.max()),
            "hidden_max_abs": float(ref_rows.abs().max()),
            "hidden_rel_norm_err": float(err.norm() / ref_rows.norm()),
        }
    )
    return stats


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(PROG, __doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    out = output_file(args.out)
    if not torch.cuda.is_available():
        raise ConfigError("needs a CUDA device (a CPU run is bitwise equal to the oracle)")
    doc = {
        "command": "PYTHONPATH=. python3 scripts/calibrate_check.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "device": f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})",
        "by_compute_dtype": {dtype: drift(dtype) for dtype in ("fp32", "bf16")},
    }
    out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The planner's elementwise term: device time per local token of the work no other term counts.

The other terms cover the matrix products (sparse MLA, indexer logits, projection GEMMs), the
top-k and the CP data movement. What is left in a layer is memory-bound elementwise work on the
rank's own tokens: RMSNorm, RoPE, the Hadamard rotation and FP8 quantization of the indexer q,
dtype casts, the copies around the absorbed products, the residual add. It grows with the local
tokens, so it is modeled as ``elementwise_us_per_token x T_local``.

The rate is measured, not fitted to layer times: ``scripts/profile_layer.py --json`` records every
kernel's device time (torch.profiler) of one rank's prefill at two sizes; :func:`per_layer_ms`
sorts the kernels into the terms' categories by name, and :func:`elementwise_rate` takes the slope
of the elementwise category against ``T_local`` between the sizes. The slope drops what does not
grow with the tokens (the weights' initialization kernels of the profiled run, for example).

    python -m reference_impl.planner.elementwise docs/results/profile_layer_32k.json \\
        docs/results/profile_layer_128k.json --out docs/results/elementwise_rate.json
"""

from __future__ import annotations

import json
from typing import Any

from reference_impl.config import MAX_BATCH_TOKENS, MAX_PLAN_CP
from reference_impl.errors import ConfigError
from reference_impl.planner.model import local_queries
from reference_impl.tool_args import (
    NUMBER,
    TEXT,
    ToolParser,
    input_json,
    int_field,
    output_file,
    rank_of,
    refusing,
    stored_fields,
)

PROG = "python -m reference_impl.planner.elementwise"
# What elementwise_rate reads from a ``profile_layer.py --json`` document.
PROFILE_FIELDS = {
    "args": {
        "layers": int_field(1),
        "extend": int_field(1, MAX_BATCH_TOKENS),
        "cp_size": int_field(1, MAX_PLAN_CP),
        "level": int_field(0, 8),
        "rank": int_field(0),
        "prefix?": int_field(0),
    },
    "ops": [{"name": TEXT, "device_ms": NUMBER}],
}

# Kernel-name fragments of each modeled category, first match wins; everything else is elementwise.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("sparse_mla",)),
    ("indexer_logits", ("indexer_logits",)),
    ("indexer_topk", ("mbtopk", "radixSort", "sort", "topk_select")),
    ("projections", ("nvjet", "gemm", "xmma", "cutlass")),
    ("init", ("distribution_",)),  # random weights and inputs of the profiled run: not layer work
    ("data_movement", ("_rerange", "_store_", "_materialize", "_fill_current", "Memcpy")),
)


def categorize(kernel: str) -> str:
    """The category of a kernel name (``"elementwise"`` when no fragment matches)."""
    for category, fragments in CATEGORIES:
        if any(f in kernel for f in fragments):
            return category
    return "elementwise"


def per_layer_ms(profile: dict[str, Any]) -> dict[str, float]:
    """Device ms per layer of each category in a ``profile_layer.py --json`` document."""
    layers = profile["args"]["layers"]
    out: dict[str, float] = {}
    for op in profile["ops"]:
        category = categorize(op["name"])
        out[category] = out.get(category, 0.0) + op["device_ms"] / layers
    return out


def profile_local_tokens(profile: dict[str, Any], page_size: int = 64) -> int:
    """``T_local`` of the profiled rank (one request, no prefix, as the planner's scenario)."""
    args = profile["args"]
    if args.get("prefix", 0):
        raise ValueError("the elementwise rate needs current-only profiles (prefix 0)")
    return local_queries(args["extend"], args["cp_size"], page_size, args["level"], args["rank"])


def elementwise_rate(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """Slope of per-layer elementwise ms against ``T_local`` between the smallest and largest profile."""
    points = sorted((profile_local_tokens(p), per_layer_ms(p).get("elementwise", 0.0)) for p in profiles)
    if len(points) < 2 or points[0][0] == points[-1][0]:
        raise ValueError("need profiles at two different local token counts")
    (t0, ms0), (t1, ms1) = points[0], points[-1]
    return {
        "elementwise_us_per_token": (ms1 - ms0) / (t1 - t0) * 1e3,
        "points": [{"T_local": t, "elementwise_ms_per_layer": ms} for t, ms in points],
        "method": "slope of the per-layer device ms of kernels outside every modeled category "
        "(planner.elementwise.CATEGORIES) between two torch.profiler runs of one rank",
    }


def build_parser() -> ToolParser:
    parser = ToolParser(PROG, "elementwise us per local token from two layer profiles")
    parser.add_argument("profiles", nargs="+", help="profile_layer.py --json files (current-only, two sizes)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    return parser


@refusing
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = output_file(args.out)
    profiles = []
    for path in args.profiles:
        profile = input_json(path, "profile")
        stored_fields(profile, PROFILE_FIELDS, f"profile {path!r}")
        rank_of(profile["args"]["rank"], profile["args"]["cp_size"], f"profile {path!r}: field args.rank", "cp_size")
        profiles.append(profile)
    try:
        rate = elementwise_rate(profiles)
    except ValueError as exc:  # one size only, or a profile with a prefix
        raise ConfigError(f"profiles {' '.join(args.profiles)}: {exc}") from None
    rate["profiles"] = args.profiles
    out.write_text(json.dumps(rate, indent=1))
    print(f"elementwise: {rate['elementwise_us_per_token']:.3f} us per local token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The run report as text: the table the CLI prints for each run (``python -m reference_impl run``)."""

from __future__ import annotations

from typing import Any


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def format_table(reports: list[dict[str, Any]]) -> str:
    """A readable table: one block per report, one row per rank."""
    lines = []
    for rep in reports:
        cfg = rep["config"]
        verdict = {True: "MATCHES oracle", False: "DIFFERS from oracle", None: "not checked"}[rep["matches_oracle"]]
        lines.append(
            (f"kv design {cfg['kv_design']} | " if cfg.get("kv_design", "phases") != "phases" else "")
            + f"phases {rep['phases'] or '[0]'} | cp={rep['cp_size']} {cfg['split_mode']} | store {rep['store_path']}"
            + (f" (KV interleave {cfg['kv_interleave']})" if cfg.get("kv_interleave") else "")
            + f" | {cfg['preset']} "
            f"{cfg['kv_dtype']} | requests {cfg['requests']} | {rep['device']} / {rep['backend']}"
            f" / attention {rep.get('attention_kernel', '?')}"
            + (" (ranks share one device)" if rep["ranks_share_device"] else "")
        )
        if rep["matches_oracle"] is not None:
            topk = (
                ""
                if rep["topk_agreement"] is None
                # no layer selects keys (DeepSeek-V4, sliding only)
                else (f", top-k agreement {rep['topk_agreement']:.4f} (+{rep['topk_boundary_ties']} boundary ties)")
            )
            lines.append(
                f"  {verdict}: max abs err {rep['max_abs_err']:.2e}{topk}, cache equal {rep['cache_equal']}, "
                f"tail {rep['tail_mode']}"
            )
        header = [
            "rank",
            "tokens",
            "kv",
            "index",
            "transient peak",
            "gather",
            "materialized",
            "tail gather",
            "colls",
            "layer ms",
        ]
        rows = [
            [
                str(p["rank"]),
                str(p["tokens"]),
                _human_bytes(p["kv_bytes"]),
                _human_bytes(p["index_bytes"]),
                _human_bytes(p["transient_peak_bytes"]),
                _human_bytes(p["gather_bytes"]),
                _human_bytes(p["materialized_bytes"]),
                _human_bytes(p["output_gather_bytes"]),
                str(p["collectives"]),
                f"{p['layer_ms_median']:.2f}",
            ]
            for p in rep["per_rank"]
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines.append("  " + "  ".join(h.rjust(w) for h, w in zip(header, widths)))
        lines.extend("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
        occupancy = rep.get("pool_occupancy") or []
        if len(occupancy) > 1:  # several batches on one pool
            lines.append(
                "  pool pages in use per batch (of "
                + str(occupancy[0]["pool_pages"])
                + "): "
                + "; ".join(
                    f"batch {o['batch']}: {o['pages_in_use']}"
                    + (
                        f", {o['pages_in_use_after_frees']} after freeing {o['requests_freed']} request(s)"
                        if o["requests_freed"]
                        else ""
                    )
                    for o in occupancy
                )
            )
        for problem in rep["problems"]:
            lines.append(f"  ! {problem}")
        for kernel, error in rep.get("kernel_fallbacks", {}).items():
            lines.append(f"  ! {kernel} failed and fell back ({error})")
        lines.append("")
    return "\n".join(lines)

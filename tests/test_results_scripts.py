"""The scripts that turn docs/results into the benchmarks page's figures."""

from __future__ import annotations

from pathlib import Path

from reference_impl.planner.rates import RESULTS_DIR


def test_results_plots_render_from_the_committed_json_and_repeat_byte_for_byte(tmp_path: Path) -> None:
    """``scripts/plot_results.py`` draws the benchmarks page's two SVGs from ``docs/results`` and
    writes identical bytes when run twice (no date, fixed ids), so a rerun only shows real changes."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "plot_results.py"
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run
        subprocess.run([sys.executable, str(script), "--results", str(RESULTS_DIR), "--out", str(out)], check=True,
                       capture_output=True)
        outputs.append({name: (out / name).read_bytes() for name in ("layer_bench.svg", "prefetch.svg")})
    assert outputs[0] == outputs[1]
    assert all(svg.startswith(b"<?xml") and b"<svg" in svg for svg in outputs[0].values())

"""The CPU side of the benchmarks' timers: the median wall-clock time of a call (GPU timers use
``triton.testing.do_bench`` or CUDA events where they are defined)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def cpu_median_ms(fn: Callable[[], object], repeats: int) -> float:
    """One warm-up call, then the median of ``repeats`` timed calls, in milliseconds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)

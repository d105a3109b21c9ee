"""The benchmarks' timers and device check: the median wall-clock time of a call on the CPU,
``triton.testing.do_bench`` on a GPU (:func:`median_ms_timer`), and whether a kernel benchmark can
run where it was asked to (:func:`ready_for`)."""

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


def ready_for(device: str) -> bool:
    """Whether a kernel benchmark can run on ``device`` (``"cuda"`` or ``"cpu"``), said before
    Triton is imported. ``"cpu"`` is a dry run of the script's logic at toy sizes: Triton's
    interpreter is switched on. ``"cuda"`` without a CUDA device prints the error -> ``False``."""
    import os
    import sys

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return False
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return True


def median_ms_timer(on_gpu: bool, warmup_ms: int, rep_ms: int) -> Callable[[Callable[[], object]], float]:
    """The benchmarks' timer: the median of ``triton.testing.do_bench`` on a GPU, one timed call
    (:func:`cpu_median_ms`) in a CPU dry run."""
    import triton.testing

    def timer(fn: Callable[[], object]) -> float:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms)) if on_gpu else cpu_median_ms(fn, 1)

    return timer

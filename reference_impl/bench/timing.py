"""The benchmarks' timers and device check: the median wall-clock time of a call on the CPU,
``triton.testing.do_bench`` on a GPU (:func:`median_ms_timer`), the device time of a call whose
host-side launch work must stay out of the figure (:func:`queued_median_ms`), and whether a kernel
benchmark can run where it was asked to (:func:`ready_for`)."""

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

    from reference_impl.errors import ConfigError
    from reference_impl.tool_args import require_cuda

    try:
        require_cuda(device)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
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


FLUSH_BYTES = 256 << 20  # what triton.testing.do_bench zeroes between calls to empty the L2
LEAD_CYCLES = 400_000  # about 0.2 ms of GPU sleep at the H200's 1.98 GHz (longer at lower clocks)


def queued_median_ms(fn: Callable[[], object], reps: int = 100, warmup: int = 3) -> float:
    """The median device time of ``fn()`` over ``reps`` calls, each after an L2 flush, with its
    launches queued behind work the GPU is still doing.

    ``triton.testing.do_bench`` records its start event and calls ``fn`` while the GPU zeroes its
    flush buffer (about 0.08 ms on an H200): when ``fn``'s host side (Python argument checks, the
    launcher) takes longer than that, the GPU waits between the start event and the kernel, and
    the wait is timed. For a kernel of a few microseconds that is most of the figure, and it varies
    with the host's speed from run to run. Here each call is preceded by the same flush and then
    :data:`LEAD_CYCLES` of ``torch.cuda._sleep``, so the host has enqueued the call before the GPU
    reaches the start event: what is timed is the device's work (and the gaps between queued
    launches), as in the engine, where the GPU runs ahead of the host. The host's work per call must
    stay under the flush and the sleep together (about 0.28 ms), or the queue drains. Needs CUDA.
    """
    import torch

    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.zero_()
        torch.cuda._sleep(LEAD_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))

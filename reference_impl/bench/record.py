"""What every benchmark's results file records about its run: the device, torch, the command line
(:func:`run_record`), and how one rank stands in for a CP group (:func:`loopback_cp`)."""

from __future__ import annotations

import platform
import shlex
import sys
from typing import Any

import torch


def run_record(module: str, argv: list[str] | None, device: str) -> dict[str, Any]:
    """``device`` (the GPU's name, or the CPU's for a dry run), ``torch`` and the ``command`` that ran
    ``python -m reference_impl.bench.<module>`` with ``argv`` (default: this process's arguments)."""
    return {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "command": f"python -m reference_impl.bench.{module} " + shlex.join(argv if argv is not None else sys.argv[1:]),
    }


def loopback_cp(rank: int, cp_size: int, wire_gbps: float | None, moved: str = "all-gathers") -> str:
    """One rank of ``C`` alone in one process (a ``LoopbackGroup``): its ``moved`` collectives are local
    copies, plus a modeled wire when ``wire_gbps`` is given."""
    wire = f"local copies plus a modeled wire of {wire_gbps:g} GB/s" if wire_gbps else "local copies (no wire time)"
    return f"rank {rank} of C={cp_size} alone in one process (LoopbackGroup): {moved} are {wire}"

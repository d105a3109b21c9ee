"""Before any rank starts: does the run fit the machine? An upper bound of its memory, by arithmetic.

:func:`estimate` asks the run's model family for what each process holds at its peak (the DSA
family's model: :mod:`reference_impl.families.dsa.footprint`; DeepSeek-V4's:
:mod:`reference_impl.families.deepseek_v4.footprint`); :func:`check_fits` compares that with what the
machine has free and refuses with the numbers, instead of letting a rank die of an allocation after
minutes. Nothing here is proportional to the run's size: a run of 10^11 tokens is refused as fast as
one of 10^3.

What every family's model shares is here: a process's cost before any tensor (:data:`PROCESS_BASE`,
:data:`CUDA_CONTEXT`), the host metadata per token, the safety factor :data:`SAFETY` (1.25) over
everything (allocator slack and temporaries too small to list), and the answer's shape
(:class:`Footprint`).

What is compared (:func:`free_bytes`): on CPU the host's available memory (``MemAvailable``, within
the cgroup's limit when one is set), against the sum over every process; on CUDA each device's
free memory against the ranks sharing it plus the oracle (on device 0), and the host against the
processes' host side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from reference_impl.config import ConfigError, RunConfig
from reference_impl.families import family_of
from reference_impl.machine import available_host_bytes

GIB = 1 << 30
MIB = 1 << 20
SAFETY = 1.25  # over the sum of the terms below
# A process's own memory before its tensors: a forked CPU rank (gloo, its threads, the interpreter's
# pages it dirties), a spawned process (imports torch again), the launching process's working set,
# and on CUDA a context per process on its device.
PROCESS_BASE = {"fork": 64 * MIB, "forkserver": 64 * MIB, "spawn": 640 * MIB, "inline": 0, "parent": 128 * MIB}
CUDA_CONTEXT = 640 * MIB
METADATA_PER_TOKEN = 160  # host bytes per token of the chunk schedule and split metadata (tuples of ints)
CHUNK_CAP = 512 * MIB  # the torch references' chunk budget (model/sparse_attention.py)


@dataclass(frozen=True)
class Footprint:
    """:func:`estimate`'s answer: each process's peak bytes (with :data:`SAFETY`), and the terms.

    The ranks run at once, beside the parent holding their results as they arrive; the parent's
    oracle runs after the ranks have exited.
    """

    ranks: tuple[int, ...]  # per rank process, on its device
    parent_during: int  # the launching process while the ranks run (results as they arrive)
    parent_after: int  # the launching process after them (oracle and comparison, results held)
    host: int  # every process's host side (CUDA runs; equals per_device on CPU)
    device_type: str
    ranks_per_device: int
    terms: dict[str, int] = field(default_factory=dict)  # rank 0's and the parent's terms, unscaled

    @property
    def per_device(self) -> int:
        """The most one device holds at once: on CPU every process; on CUDA the ranks sharing device 0
        (and the parent), or the oracle after them."""
        ranks = self.ranks if self.device_type == "cpu" else sorted(self.ranks, reverse=True)[: self.ranks_per_device]
        return max(sum(ranks) + self.parent_during, self.parent_after)


def local_queries(run: RunConfig, extends: list[int]) -> int:
    """An upper bound of one rank's queries in one chunk: zigzag blocks (page-aligned ones hold up to
    a page more each), or round-robin's share of every request."""
    c = run.cp_size
    if run.split_mode == "round-robin":
        return sum(-(-e // c) + 1 for e in extends)
    pad = run.page_size if run.phases.page_aligned else 1
    return min(sum(extends), sum(2 * (-(-e // (2 * c)) + pad) for e in extends))


def weight_bytes(cfg: Any, dtype_bytes: int) -> tuple[int, int]:
    """``(the parameters in the compute dtype, the transient of their initialization)`` of ``cfg``'s model."""
    return family_of(cfg).weight_bytes(cfg, dtype_bytes)


def estimate(
    run: RunConfig,
    device_type: str,
    start_method: str = "fork",
    cuda_devices: int = 1,
    extra_process: int = 0,
) -> Footprint:
    """The run's peak memory per process, from its family's model. Arithmetic only.

    ``start_method`` is how the ranks start (:class:`~reference_impl.launch.LaunchSpec`);
    ``extra_process``: the bytes of one more process that runs beside the ranks (a PD decode).
    """
    b = 2 if run.compute_dtype == "bf16" or (run.compute_dtype == "auto" and device_type == "cuda") else 4
    return family_of(run.model).estimate(run, device_type, start_method, cuda_devices, extra_process, b)


def decode_bytes(run: RunConfig) -> int:
    """A PD decode process beside the ranks (:mod:`reference_impl.prefill_decode`), from the run's family."""
    return family_of(run.model).decode_bytes(run)


def free_bytes(device_type: str) -> int | None:
    """Free memory of one device of this type, or ``None`` where it cannot be read: CUDA's free
    bytes on the current device; the host's available memory
    (:func:`~reference_impl.machine.available_host_bytes`: ``MemAvailable`` within the cgroup's limit)."""
    if device_type == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    return available_host_bytes()


def check_fits(
    run: RunConfig,
    device_type: str,
    start_method: str = "fork",
    cuda_devices: int = 1,
    extra_process: int = 0,
) -> Footprint:
    """Raise :class:`~reference_impl.config.ConfigError` when the run cannot fit (see the module
    docstring); return the estimate otherwise."""
    foot = estimate(run, device_type, start_method, cuda_devices, extra_process)
    checks = [(device_type, foot.per_device, free_bytes(device_type))]
    if device_type == "cuda":
        checks.append(("the host", foot.host, free_bytes("cpu")))
    for where, need, free in checks:
        if free is not None and need > free:
            tokens = sum(r.total for r in run.requests)
            biggest = max(foot.terms, key=lambda k: foot.terms[k])
            raise ConfigError(
                f"a run of {tokens:,} tokens ({run.preset}, {run.model.n_layers} layers, C={run.cp_size}) needs up to "
                f"{need / GIB:,.1f} GiB on {where}, which has {free / GIB:,.1f} GiB free (largest part: {biggest}, "
                f"{foot.terms[biggest] / GIB:,.1f} GiB): use fewer tokens, layers or ranks"
            )
    return foot

"""Shared fixtures: small CP runs on CPU (gloo, forked ranks) cached per configuration."""

from __future__ import annotations

import functools
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run under the interpreter on CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from reference_impl.config import PhaseSet, Request, RunConfig  # noqa: E402
from reference_impl.runner import run_prefill  # noqa: E402


@functools.lru_cache(maxsize=None)
def cached_report(run: RunConfig) -> dict:
    return run_prefill(run, timeout_s=120)


@pytest.fixture
def report_of():
    return cached_report


def tiny(**changes) -> RunConfig:
    base = RunConfig(preset="tiny", cp_size=2, requests=(Request(0, 96), Request(40, 70)), phases=PhaseSet())
    return base.replace(**changes)


def interpreted(module_name: str) -> object:
    """Import a Triton kernel module so that its kernels run under the interpreter.

    ``triton.jit`` picks interpreter or compiler when the module is imported; if another test
    module imported it first without ``TRITON_INTERPRET=1``, import it again now.
    """
    module = importlib.import_module(module_name)
    kernel = next(v for k, v in vars(module).items() if k.startswith("_") and k.endswith("_kernel"))
    if type(kernel).__name__ != "InterpretedFunction":
        module = importlib.reload(module)
    return module


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (uint8), to compare packed outputs byte for byte."""
    return t.contiguous().view(torch.uint8)


# The fused-kernel modules, imported so that their kernels run under the interpreter. fused_materialize
# shares conversion helpers with fused_store: if fused_store was reloaded, reload it too.


@pytest.fixture(scope="module")
def fs() -> object:
    return interpreted("reference_impl.kernels.fused_store")


@pytest.fixture(scope="module")
def fr() -> object:
    return interpreted("reference_impl.kernels.fused_rerange")


@pytest.fixture(scope="module")
def fm(fs: object) -> object:
    module = interpreted("reference_impl.kernels.fused_materialize")
    if module._bf16_bits is not fs._bf16_bits:  # type: ignore[attr-defined]
        module = importlib.reload(module)
    return module

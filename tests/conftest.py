"""Shared fixtures: small CP runs on CPU (gloo, forked ranks) cached per configuration."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run under the interpreter on CPU

import pytest  # noqa: E402

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

"""The one fallback rule every kernel dispatch follows.

A dispatch runs its Triton (or Gluon) kernel when :func:`use_kernels` says so for the tensors'
device, and the plain-torch path otherwise. The kernels run when

* the tensors are on CUDA and Triton imports (:func:`device_runs_kernels`),
* ``debug`` is off (debug mode takes the torch paths, whose checks read values on the host),
* neither ``force_torch=True`` nor the environment variable ``DSACP_FORCE_TORCH=1`` asks for torch.

The decision depends only on the process's setup, so every rank of a CP group decides alike (no
kernel launches a collective either way).

If a kernel raises, :func:`run_with_fallback` logs ONE warning per process per kernel
(``logging.getLogger(__name__)``), records the failure (:func:`fallbacks_taken`, which the run
report carries) and returns the fallback's result; later failures of that kernel fall back
silently. Successful calls log nothing: the kernels run once per layer per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache
from typing import TypeVar

import torch

from reference_impl.config import env_flag

logger = logging.getLogger(__name__)

T = TypeVar("T")

# kernel name -> "ExceptionType: message" of its first failure in this process
_FAILED: dict[str, str] = {}


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``triton`` and ``triton.language`` import in this process (cached)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything else at import
        return False
    return True


def device_runs_kernels(device: torch.device | str) -> bool:
    """True when Triton kernels can run for tensors on ``device`` (CUDA, Triton importable)."""
    return torch.device(device).type == "cuda" and triton_available()


def use_kernels(device: torch.device | str, *, debug: bool = False, force_torch: bool = False) -> bool:
    """Whether a dispatch runs its kernel for tensors on ``device`` (see the module docstring)."""
    if debug or force_torch or env_flag("force_torch"):
        return False
    return device_runs_kernels(device)


def run_with_fallback(
    kernel: str, fast: Callable[[], T], fallback: Callable[[], T], *, to: str = "the torch path"
) -> T:
    """``fast()``, or ``fallback()`` after ``fast`` raised (one warning per ``kernel`` per process).

    ``to`` names the fallback in the warning (another kernel in a chain, e.g. Gluon -> Triton).
    """
    try:
        return fast()
    except Exception as exc:  # compile, launch or unsupported-input failures all fall back
        if kernel not in _FAILED:
            _FAILED[kernel] = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "%s failed (%s: %s); falling back to %s (later failures of this kernel fall back silently)",
                kernel,
                type(exc).__name__,
                exc,
                to,
            )
        return fallback()


def fallbacks_taken() -> dict[str, str]:
    """Kernels that failed in this process so far, with their first error (a copy)."""
    return dict(_FAILED)


def reset_fallbacks() -> None:
    """Forget recorded failures, so the next failure warns again (tests, long-lived processes)."""
    _FAILED.clear()

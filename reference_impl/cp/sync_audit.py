"""Phase 6's audit: count host synchronizations inside the layer loop (debug mode asserts zero).

A host sync stalls the CPU until the GPU catches up and serializes the launch stream; the CP
metadata of phase 6 lives on the device so that the layer loop issues none. The counter patches,
while it is active, the tensor operations that force a device-to-host sync on CUDA (``item``,
``tolist``, ``cpu``, truth and number conversions, ``nonzero``, ``unique``) and counts their calls;
on CUDA it also counts the warnings of ``torch.cuda.set_sync_debug_mode("warn")``. The patched
calls are counted on CPU too, where they are harmless, so the audit runs in CPU tests.

Debug diagnostics sync on purpose (collective-sequence digests, loc range checks); they run
inside :func:`diagnostic`, which pauses the count.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch

_SYNCING: tuple[tuple[Any, str], ...] = (
    (torch.Tensor, "item"),
    (torch.Tensor, "tolist"),
    (torch.Tensor, "cpu"),
    (torch.Tensor, "__bool__"),
    (torch.Tensor, "__int__"),
    (torch.Tensor, "__float__"),
    (torch.Tensor, "__index__"),
    (torch.Tensor, "nonzero"),
    (torch, "nonzero"),
    (torch, "unique"),
    (torch.Tensor, "unique"),
)
_state = threading.local()


@contextlib.contextmanager
def diagnostic() -> Iterator[None]:
    """Run debug diagnostics that sync on purpose without counting them."""
    depth = getattr(_state, "paused", 0)
    _state.paused = depth + 1
    try:
        yield
    finally:
        _state.paused = depth


class HostSyncCounter:
    """``with HostSyncCounter() as audit: ...`` then ``audit.count`` and ``audit.sites`` (first few)."""

    def __init__(self, keep_sites: int = 5) -> None:
        self.count = 0
        self.sites: list[str] = []
        self._keep = keep_sites
        self._saved: list[tuple[Any, str, Any]] = []
        self._warnings: Any = None

    def _hit(self, name: str) -> None:
        if getattr(_state, "paused", 0) or getattr(_state, "inside", False):
            return
        self.count += 1
        if len(self.sites) < self._keep:
            frame = traceback.extract_stack(limit=4)[0]
            self.sites.append(f"{name} at {frame.filename}:{frame.lineno}")

    def _wrap(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._hit(name)
            _state.inside = True  # a patched op calling another patched op counts once
            try:
                return original(*args, **kwargs)
            finally:
                _state.inside = False

        return counted

    def __enter__(self) -> "HostSyncCounter":
        for owner, name in _SYNCING:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(name, original))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._warnings = warnings.catch_warnings(record=True)
            self._recorded = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        if self._warnings is not None:
            torch.cuda.set_sync_debug_mode("default")
            synced = [w for w in self._recorded if "synchroniz" in str(w.message)]
            self.count += len(synced)
            self.sites.extend(str(w.message)[:120] for w in synced[: max(0, self._keep - len(self.sites))])
            self._warnings.__exit__(*exc)
            self._warnings = None

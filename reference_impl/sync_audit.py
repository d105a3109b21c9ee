"""Count host synchronizations in a region of code (phase 6's audit of the layer loop).

A host sync stalls the CPU until the GPU catches up and serializes the launch stream. Two counters,
either or both active:

* **API** (any device): a :class:`~torch.overrides.TorchFunctionMode` that flags the torch calls
  that synchronize on CUDA: reading device memory from the host (``item``, ``tolist``, ``cpu``,
  ``numpy``, truth and number conversions), ops whose output size depends on the data
  (``nonzero``, ``unique``, ``masked_select``, boolean-mask indexing, ``repeat_interleave``
  without ``output_size``, one-argument ``where``), comparisons returning a Python bool
  (``equal``, ``allclose``), and tensors built from host data (``tensor``, ``as_tensor``,
  indexing with a Python list, a blocking ``to`` between CPU and a device). On a CPU these calls
  are harmless, so this is how a CPU run sees what would sync on a GPU.
* **CUDA** (CUDA only): :func:`torch.cuda.set_sync_debug_mode` ``"warn"``, CUDA's own count of
  every synchronizing operation, including ones inside torch that no API rule names.

A CUDA warning raised inside a call the API counter already flagged is the same sync and is not
counted twice. Two regions are set apart:

* :func:`diagnostic`: debug checks that sync on purpose (loc range checks, collective digests);
  nothing inside is counted.
* :func:`transport`: the wire's own work. A collective that stages CUDA tensors through host
  memory (gloo with CUDA tensors: ranks sharing a GPU) synchronizes by design; each such collective
  counts once as ``transport``, never hidden and never mixed with the layer's own syncs. Inside the
  wire CUDA's own counter is paused (gloo's worker threads would print a warning per staged copy).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"

# Calls that synchronize whatever their arguments.
_ALWAYS = frozenset(
    {
        "item",
        "tolist",
        "cpu",
        "numpy",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__complex__",
        "nonzero",
        "argwhere",
        "unique",
        "unique_consecutive",
        "masked_select",
        "equal",
        "allclose",
        "tensor",
        "is_nonzero",
    }
)
_INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})


def _index_syncs(index: Any) -> bool:
    """An index that needs the host: a boolean mask (its size depends on the data) or Python data."""
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, torch.Tensor) and part.dtype == torch.bool and part.dim() > 0:
            return True
        if isinstance(part, list):
            return True
    return False


def _to_crosses_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``tensor.to(...)`` between the CPU and a device (blocking unless ``non_blocking=True``)."""
    if not args or not isinstance(args[0], torch.Tensor) or kwargs.get("non_blocking"):
        return False
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (torch.device, str)):
            target = a
        elif isinstance(a, torch.Tensor):
            target = a.device
    if target is None:
        return False
    return (args[0].device.type == "cpu") != (torch.device(target).type == "cpu")


def syncing_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the torch call ``name(*args, **kwargs)`` synchronizes the host with a CUDA device."""
    if name in _ALWAYS:
        return True
    if name == "as_tensor":
        return not (args and isinstance(args[0], torch.Tensor))
    if name in _INDEXING:
        return len(args) > 1 and _index_syncs(args[1])
    if name == "repeat_interleave":
        return "output_size" not in kwargs and any(isinstance(a, torch.Tensor) for a in args[1:2])
    if name == "where":
        return len(args) + len(kwargs) == 1
    if name == "to":
        return _to_crosses_host(args, kwargs)
    return False


class _State(threading.local):
    paused = 0  # depth of diagnostic()
    transport = 0  # depth of transport()
    in_flagged = False  # inside a call the API counter flagged
    audit: HostSyncAudit | None = None


_state = _State()


@contextlib.contextmanager
def diagnostic() -> Iterator[None]:
    """Run debug diagnostics that sync on purpose without counting them."""
    _state.paused += 1
    try:
        yield
    finally:
        _state.paused -= 1


def _set_cuda_sync_mode(mode: int | str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "a prototype feature", on every call
        torch.cuda.set_sync_debug_mode(mode)


@contextlib.contextmanager
def transport(stages_through_host: bool = False) -> Iterator[None]:
    """Run a collective's wire transfer: a staging collective counts once as ``transport``; syncs
    the API counter sees inside count as ``transport`` too, never as the caller's."""
    audit = _state.audit
    paused_cuda = audit is not None and audit.cuda and stages_through_host
    if audit is not None and stages_through_host:
        audit.transport += 1
    _state.transport += 1
    if paused_cuda:
        _set_cuda_sync_mode("default")
    try:
        yield
    finally:
        _state.transport -= 1
        if paused_cuda:
            _set_cuda_sync_mode("warn")


def _caller_site() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if __file__ not in name and "/torch/" not in name and "/warnings.py" not in name:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class _ApiSyncMode(TorchFunctionMode):
    def __init__(self, audit: HostSyncAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _state.paused or not syncing_call(name, args, kwargs):
            return func(*args, **kwargs)
        self.audit._hit(f"{name}() at {_caller_site()}")
        _state.in_flagged = True
        try:
            return func(*args, **kwargs)
        finally:
            _state.in_flagged = False


class HostSyncAudit:
    """``with HostSyncAudit(api=..., cuda=...) as audit: ...`` then ``audit.count``, ``audit.transport``,
    ``audit.sites`` (the first few, ``"what at file:line"``) and ``audit.method``.

    Args:
        api: count the API calls listed in the module docstring (any device).
        cuda: count CUDA's sync-debug warnings (needs CUDA); ``None``: when CUDA is initialized.
        keep_sites: how many sites to keep for the error message.
    """

    def __init__(self, api: bool = True, cuda: bool | None = None, keep_sites: int = 5) -> None:
        self.api = api
        self.cuda = (torch.cuda.is_available() and torch.cuda.is_initialized()) if cuda is None else cuda
        self.count = 0
        self.transport = 0
        self.sites: list[str] = []
        self._keep = keep_sites
        self._mode: _ApiSyncMode | None = None
        self._warnings: Any = None
        self._previous_debug_mode = 0
        self._previous_showwarning: Any = None

    @property
    def method(self) -> str:
        """How syncs were counted, for reports: ``"api"``, ``"cuda-sync-debug"`` or both joined by ``+``."""
        return "+".join(m for m, on in (("cuda-sync-debug", self.cuda), ("api", self.api)) if on) or "none"

    def _hit(self, site: str) -> None:
        if _state.transport:
            return  # the wire's: a staging collective already counted once (see transport())
        self.count += 1
        if len(self.sites) < self._keep:
            self.sites.append(site)

    def _on_warning(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if _CUDA_SYNC_WARNING not in str(message):
            self._previous_showwarning(message, category, filename, lineno, *rest)
            return
        if _state.paused or _state.in_flagged:  # on purpose, or already counted by the API counter
            return
        self._hit(f"CUDA sync at {filename}:{lineno}")

    def __enter__(self) -> HostSyncAudit:
        if _state.audit is not None:
            raise RuntimeError("HostSyncAudit regions do not nest")
        _state.audit = self
        if self.cuda:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            self._previous_showwarning = warnings.showwarning
            warnings.showwarning = self._on_warning
            self._previous_debug_mode = torch.cuda.get_sync_debug_mode()
            _set_cuda_sync_mode("warn")
        if self.api:
            self._mode = _ApiSyncMode(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        if self._warnings is not None:
            _set_cuda_sync_mode(self._previous_debug_mode)
            self._warnings.__exit__(*exc)
            self._warnings = None
        _state.audit = None

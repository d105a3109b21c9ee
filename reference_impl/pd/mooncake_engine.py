"""The Mooncake Transfer Engine, as a PD transport uses it: start, register, write, notify.

One :class:`MooncakeEngine` per process. :meth:`MooncakeEngine.start` creates the engine with
the P2P handshake (no metadata server: a peer is named by its session id ``host:rpc_port``, and
the engine binds a free port itself, so processes side by side never collide). Mooncake chooses
the protocol: it looks for RDMA devices and installs its RDMA transport when it finds one, TCP
otherwise (``MC_FORCE_TCP=1`` forces TCP); :attr:`MooncakeEngine.protocol` says which.

The calls a PD transport needs:

* :meth:`~MooncakeEngine.register`: memory a peer may write into (the decode's pool) or that the
  NIC reads from (the prefill's send buffer). RDMA needs both; TCP checks the destination only.
* :meth:`~MooncakeEngine.write`: one synchronous batch of one-sided writes (source addresses here,
  destination addresses in the peer's registered memory); returns once every byte is placed,
  raises :class:`MooncakeError` on failure. A batch may carry a notification that Mooncake sends
  to the peer after the batch completed.
* :meth:`~MooncakeEngine.notifications`: the peer's side, the notifications received so far.

The package ``mooncake-transfer-engine-non-cuda`` (CPU) or ``mooncake-transfer-engine[-cuda13]``
(GPU memory too) provides ``mooncake.engine``; it links ``libibverbs.so.1`` even when no RDMA
device is present (Debian: ``libibverbs1``, ``librdmacm1``). :func:`mooncake_unavailable` says
why it cannot be imported, or ``None``.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any

import torch

from reference_impl.config import env_flag
from reference_impl.errors import ConfigError

MAX_BATCH = 1024  # entries per batch call: the engine refuses batches of a few thousand entries


class MooncakeError(RuntimeError):
    """A Mooncake call failed (its return code and what was asked are in the message)."""


def mooncake_unavailable() -> str | None:
    """Why ``mooncake.engine`` cannot be imported here, or ``None`` when it can.

    A library stays quiet unless asked. Mooncake logs through glog to stderr: at INFO by default, and
    even at its quietest (``MC_LOG_LEVEL=ERROR``, read when the library loads; glog's own
    ``GLOG_minloglevel`` is overridden by it) a successful start logs ``Local segment descriptor not
    found`` at ERROR, once per process. So unless ``MC_LOG_LEVEL`` is set or ``DSACP_DEBUG`` is on
    (``--debug`` sets ``MC_LOG_LEVEL=INFO``), it loads at ERROR and then glog's level is raised to FATAL.
    """
    quiet = "MC_LOG_LEVEL" not in os.environ and not env_flag("debug")
    if quiet:  # for the load only: a process started from this one decides again, from the same environment
        os.environ["MC_LOG_LEVEL"] = "ERROR"
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake Transfer Engine does not import ({exc}); install it with scripts/setup.sh"
    finally:
        if quiet:
            del os.environ["MC_LOG_LEVEL"]
    if quiet:
        _glog_fatal_only()
    return None


GLOG_FATAL = 3  # glog's severities: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL
_GLOG_MIN_LEVEL = "_ZN3fLI17FLAGS_minloglevelE"  # glog's gflag ``minloglevel`` (namespace fLI), C++-mangled


def _glog_fatal_only() -> None:
    """Set ``FLAGS_minloglevel`` to FATAL in the glog that Mooncake loaded (the wheel bundles its own
    ``libglog-*.so``); where it cannot be found (another build, not Linux) the logs stay as they are."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if os.path.basename(line.split()[-1]).startswith("libglog")}
    except OSError:
        return
    for path in sorted(paths):
        try:
            ctypes.c_int.in_dll(ctypes.CDLL(path), _GLOG_MIN_LEVEL).value = GLOG_FATAL
        except (OSError, ValueError):
            continue


def _engine_module() -> Any:
    reason = mooncake_unavailable()
    if reason is not None:
        raise ConfigError(f"the mooncake transport needs the Mooncake Transfer Engine: {reason}")
    import mooncake.engine as engine_module

    return engine_module


INFINIBAND_SYSFS = Path("/sys/class/infiniband")


def installed_protocol(topology_json: str) -> str:
    """The protocol Mooncake installs, from its local topology: ``rdma`` when it lists an RDMA
    device (and ``MC_FORCE_TCP`` is unset), else ``tcp``."""
    topology = json.loads(topology_json) if topology_json.strip() else {}
    devices = [hca for lists in topology.values() for group in lists for hca in group]
    return "rdma" if devices and not os.environ.get("MC_FORCE_TCP") else "tcp"


def _engine_protocol(engine: Any) -> str:
    """What ``engine`` installed. Without an RDMA device in sysfs Mooncake finds none: TCP, known
    at once; otherwise its own topology says (a call that costs about a second)."""
    if not INFINIBAND_SYSFS.is_dir() or not any(INFINIBAND_SYSFS.iterdir()):
        return "tcp"
    return installed_protocol(engine.get_local_topology())


class MooncakeEngine:
    """One process's transfer engine (see the module docstring)."""

    def __init__(self, engine: Any, hostname: str) -> None:
        self._engine = engine
        self._module = _engine_module()
        self.session_id = f"{hostname}:{engine.get_rpc_port()}"
        self.protocol = _engine_protocol(engine)
        self._registered: dict[int, int] = {}  # address -> bytes

    @classmethod
    def start(cls, hostname: str = "127.0.0.1") -> MooncakeEngine:
        """Start an engine reachable at ``hostname`` (the address peers use to reach this process)."""
        module = _engine_module()
        engine = module.TransferEngine()
        # The protocol argument selects the memory allocator only; the transport comes from the
        # engine's own device discovery (RDMA if a device is found, TCP otherwise).
        code = engine.initialize(hostname, "P2PHANDSHAKE", "rdma", "")
        if code != 0:
            raise MooncakeError(f"TransferEngine.initialize({hostname!r}, P2PHANDSHAKE) returned {code}")
        return cls(engine, hostname)

    def register(self, tensor: torch.Tensor) -> None:
        """Register ``tensor``'s bytes (contiguous, host or device memory) for one-sided access."""
        if not tensor.is_contiguous():
            raise ConfigError("Mooncake registers contiguous memory only")
        address, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if size == 0 or address in self._registered:
            return
        code = self._engine.register_memory(address, size)
        if code != 0:
            raise MooncakeError(
                f"register_memory({size} B on {tensor.device}) returned {code}: the wheel may not "
                "support this memory (GPU memory needs a CUDA build)"
            )
        self._registered[address] = size

    def unregister(self, tensor: torch.Tensor) -> None:
        address = tensor.data_ptr()
        if self._registered.pop(address, None) is not None:
            self._engine.unregister_memory(address)

    def write(
        self,
        peer: str,
        sources: list[int],
        destinations: list[int],
        lengths: list[int],
        notify: tuple[str, str] | None = None,
    ) -> None:
        """Write ``lengths[i]`` bytes from ``sources[i]`` here to ``destinations[i]`` at ``peer``,
        in batches of :data:`MAX_BATCH`; with ``notify`` (name, message) the last batch carries a
        notification, which Mooncake sends once that batch completed. Returns when every byte is
        placed; raises :class:`MooncakeError` otherwise."""
        if not lengths:
            raise ConfigError(
                "a Mooncake batch needs at least one entry (a zero-length one carries a notification alone)"
            )
        for start in range(0, len(lengths), MAX_BATCH):
            stop = min(start + MAX_BATCH, len(lengths))
            args = (peer, sources[start:stop], destinations[start:stop], lengths[start:stop])
            if notify is not None and stop == len(lengths):
                code = self._engine.batch_transfer_sync(
                    *args, self._module.TransferOpcode.Write, self._module.TransferNotify(*notify)
                )
            else:
                code = self._engine.batch_transfer_sync_write(*args)
            if code != 0:
                raise MooncakeError(
                    f"batch write of {sum(lengths[start:stop])} B in {stop - start} pieces to {peer} returned {code}"
                )

    def notifications(self) -> list[tuple[str, str]]:
        """The notifications received since the last call: ``(name, message)`` pairs."""
        return [(n.name, n.msg) for n in self._engine.get_notifies()]

    def close(self) -> None:
        """Unregister everything this engine registered."""
        for address in list(self._registered):
            self._engine.unregister_memory(address)
        self._registered.clear()

    def destroy(self) -> None:
        """Close, then drop the native engine now, in this process: its destructor joins the engine's
        threads, which exist only in the process that started them (a forked child that freed its copy
        would hang there). The engine is unusable afterwards."""
        self.close()
        del self._engine

"""Facts about the machine the refusals are decided from: free host memory, cores, the file
descriptor limit. Read here, in one place, so that every check (the memory estimate of a run, the
ranks a machine can start, the size of a split) reads them alike.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_host_bytes", "cpu_cores", "fd_limit"]


def _cgroup_free() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, else v1), or ``None`` without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            return max(0, int(limit) - usage)
        return None
    return None


def available_host_bytes() -> int | None:
    """Host memory a new allocation can get: ``MemAvailable`` (free pages plus reclaimable caches),
    within the cgroup's limit when one is set; ``None`` where neither can be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    limit = _cgroup_free()
    return available if limit is None else min(available, limit)


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fd_limit() -> int | None:
    """The soft limit of open file descriptors (``ulimit -n``) every child inherits; ``None``: unlimited."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)

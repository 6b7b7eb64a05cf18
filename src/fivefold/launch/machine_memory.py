"""The memory this machine has free for a run, and whether the kernel's out-of-memory killer
struck: read from Linux (`/proc/meminfo`, this process's memory cgroup, v1 or v2,
`/proc/vmstat`) and, for GPUs, from NVML. Every reader returns None where it cannot tell, so
a check built on it is skipped, never wrong. Importing this module does not import torch.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT_BYTES = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _field(text: str | None, name: str) -> int | None:
    """The number after `name` in a 'name value' (or 'name: value kB') listing."""
    for line in (text or "").splitlines():
        key, _, rest = line.partition(" ")
        if key.rstrip(":") == name and rest.split():
            value = int(rest.split()[0])
            return value * 1024 if rest.strip().endswith("kB") else value
    return None


def memory_cgroup() -> tuple[Path, int] | None:
    """(directory, version) of this process's memory cgroup, or None without one.

    /proc/self/cgroup names it: `0::/path` (v2) or `N:...memory...:/path` (v1). Inside a
    container the path may be the host's, so the mount's root is tried too."""
    for line in (_read(PROC / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        number, controllers, path = parts
        if number == "0" and controllers == "":
            version, base, probe = 2, CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):
            version, base, probe = 1, CGROUP_ROOT / "memory", "memory.limit_in_bytes"
        else:
            continue
        for directory in (base / path.lstrip("/"), base):
            if (directory / probe).is_file():
                return directory, version
    return None


def available_bytes() -> int | None:
    """Memory a new process can still use: the kernel's MemAvailable, or what is left under
    this process's cgroup limit (limit - usage) when that is less; None when unknown."""
    available = _field(_read(PROC / "meminfo"), "MemAvailable")
    cgroup = memory_cgroup()
    if cgroup is not None:
        directory, version = cgroup
        names = (
            ("memory.max", "memory.current")
            if version == 2
            else (
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        )
        limit, usage = ((_read(directory / name) or "").strip() for name in names)
        if limit.isdigit() and usage.isdigit() and int(limit) < NO_LIMIT_BYTES:
            left = max(0, int(limit) - int(usage))
            available = left if available is None else min(available, left)
    return available


def oom_kill_count() -> int | None:
    """How many processes the out-of-memory killer has ended so far: in this process's memory
    cgroup (v2 memory.events, v1 memory.oom_control), else on the whole machine
    (/proc/vmstat); None when neither says. Compare two readings around a run."""
    cgroup = memory_cgroup()
    if cgroup is not None:
        directory, version = cgroup
        name = "memory.events" if version == 2 else "memory.oom_control"
        count = _field(_read(directory / name), "oom_kill")
        if count is not None:
            return count
    return _field(_read(PROC / "vmstat"), "oom_kill")


def gpu_free_bytes(count: int, in_process: bool = False) -> list[int] | None:
    """Free memory of GPUs 0..count-1: NVML's total - used, which creates no CUDA context in
    this process (a launcher's would hold GPU 0's memory while the ranks train); with
    `in_process` (this process trains on GPU 0 itself) CUDA's own count when NVML is missing.
    None where neither answers."""
    try:
        import torch  # lazily: the launcher calls this and must not load torch before the ranks

        if not torch.cuda.is_available() or torch.cuda.device_count() < count:
            return None
    except Exception:
        return None
    try:
        return [
            torch.cuda.get_device_properties(i).total_memory - torch.cuda.device_memory_used(i)
            for i in range(count)
        ]
    except Exception:  # no NVML (pynvml), an older torch, a driver that does not answer
        if in_process and count == 1:
            return [int(torch.cuda.mem_get_info(0)[0])]
        return None

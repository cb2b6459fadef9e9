"""What the machine has to spare. How busy it is besides this process: a profile measured
while other work takes cores is too slow, and not evenly so, so the start-up check marks it
busy (forward_profile.py) and a later start on a quiet machine measures again. How much memory
a KV cache may take: the machine's available memory, within the container's limit."""

from __future__ import annotations

import os
import time


def _busy_jiffies() -> tuple[int, int]:
    """CPU time spent so far, in clock ticks: the whole machine's (all but idle and iowait) and
    this process's own (user and system)."""
    with open("/proc/stat") as f:
        ticks = [int(field) for field in f.readline().split()[1:9]]
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()  # fields from the 3rd on: state, ppid, ...
    return sum(ticks) - ticks[3] - ticks[4], int(own[11]) + int(own[12])


def machine_load(window_s: float = 0.3) -> tuple[float, int, bool]:
    """How many cores other processes keep busy, measured over `window_s`; the cores; and
    whether the machine counts as busy for profiling (others on more than half the cores: they
    take cores from the forward pass). This process's own work is left out: the load average
    counts it, and a start that has just loaded and converted a model (a minute of both cores
    for Qwen2.5-Coder-1.5B) would call every profile busy. Where /proc is missing, the
    one-minute load average."""
    cores = os.cpu_count() or 1
    try:
        busy, own = _busy_jiffies()
        time.sleep(window_s)
        busy_after, own_after = _busy_jiffies()
        others = max(0.0, (busy_after - busy) - (own_after - own)) / \
            os.sysconf("SC_CLK_TCK") / window_s
    except (OSError, ValueError, IndexError):
        others = os.getloadavg()[0]
    return others, cores, others > 0.5 * cores


# The memory cgroup's limit, use, and statistics files: version 2, then version 1.
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
                 "/sys/fs/cgroup/memory.stat", "inactive_file"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                 "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                 "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"))
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def cgroup_room(files=CGROUP_FILES) -> int | None:
    """Bytes this process's memory cgroup (a container's limit) still allows: its limit less
    what it uses, page cache that can be dropped not counted as used; None without a limit."""
    for limit_path, usage_path, stat_path, inactive_key in files:
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= NO_LIMIT:
            return None
        inactive = 0
        try:
            with open(stat_path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == inactive_key:
                        inactive = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - max(0, usage - inactive))
    return None

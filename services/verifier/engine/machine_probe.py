"""How busy the machine is besides this process: a profile measured while other work takes
cores is too slow, and not evenly so, so the start-up check marks it busy (forward_profile.py)
and a later start on a quiet machine measures again."""

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

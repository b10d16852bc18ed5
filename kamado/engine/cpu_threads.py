"""How many threads the engine computes with on a CPU: as many as there are idle cores.

Agents run builds and tests on the same machine as the server. Matmul threads wait for each
other at every parallel region, so when another process takes one of their cores, every
region waits for the thread that lost its core: measured on a 2-core machine with one core
kept busy, 2 threads decoded at a quarter of their quiet speed, 1 thread at half of it.
The governor reads the machine's CPU time (/proc/stat) against this process's own, and
computes with the cores that others leave idle, re-checking every second.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# torch's own choice for this process (OMP_NUM_THREADS, else the physical cores): the most
# the governor uses, read once before any governor changes it.
DEFAULT_THREADS = torch.get_num_threads()
CHECK_EVERY_S = 1.0
# A core still counts as free while others use up to this share of it (the server process
# beside the engine, short bursts); more, and a thread on it would stall the others.
NEIGHBOUR_SHARE = 0.3


@dataclass
class CpuTimes:
    busy_s: float  # all processes, all cores (steal included: the core was not ours)
    own_s: float  # this process, all threads
    wall_s: float


def read_cpu_times() -> CpuTimes | None:
    """Busy CPU seconds of the machine and of this process; None where /proc is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    # utime and stime are the 12th and 13th fields after the command name.
    return CpuTimes(busy / tick, (int(own[11]) + int(own[12])) / tick, time.monotonic())


class ThreadGovernor:
    """Keeps torch's thread count at the number of cores other processes leave idle,
    between 1 and `max_threads`. `fixed` pins the count instead."""

    def __init__(
        self,
        max_threads: int,
        fixed: int | None = None,
        num_cores: int | None = None,
        read: Callable[[], CpuTimes | None] = read_cpu_times,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.num_cores = num_cores or len(os.sched_getaffinity(0))
        self.fixed = fixed
        self._read = read
        self._set = set_threads
        self._clock = clock
        self.threads = fixed or self.max_threads
        self._set(self.threads)
        self._last = None if fixed else read()
        self.num_changes = 0

    def update(self) -> int:
        """Re-check the machine at most every CHECK_EVERY_S; returns the thread count."""
        if self._last is None:
            return self.threads
        if self._clock() - self._last.wall_s < CHECK_EVERY_S:
            return self.threads
        current = self._read()
        if current is None:
            return self.threads
        wall = current.wall_s - self._last.wall_s
        others = max(0.0, (current.busy_s - self._last.busy_s) - (current.own_s - self._last.own_s))
        self._last = current
        idle_cores = self.num_cores - others / wall
        threads = min(self.max_threads, max(1, int(idle_cores + NEIGHBOUR_SHARE)))
        if threads != self.threads:
            self.threads = threads
            self._set(threads)
            self.num_changes += 1
        return self.threads

"""CPU time this process lost to others while it ran: steal and run-queue waits (Linux).

On a virtual machine the hypervisor may run other guests on our virtual cores (steal,
counted for the whole machine in /proc/stat), and on our own machine another process may
hold a core our threads were ready to run on (their run-queue wait, in each thread's
/proc/self/task/*/schedstat). Either lengthens a step while the engine does nothing
different, so the fairness bench records both for each step: a slow step then says
whether the machine was taken from it. Elsewhere both read 0.
"""

from __future__ import annotations

import os
from pathlib import Path

_STAT = Path("/proc/stat")
_TASKS = Path("/proc/self/task")
_STEAL_FIELD = 8  # of the "cpu" line: user nice system idle iowait irq softirq steal


class LostCpu:
    """Running totals, in seconds, of the machine's steal and this process's waits."""

    def __init__(self) -> None:
        self._available = _STAT.exists() and _TASKS.exists()
        self._tick = 1.0 / os.sysconf("SC_CLK_TCK") if self._available else 0.0

    def stolen(self) -> float:
        """CPU-seconds the hypervisor gave to others, summed over all cores (counted in
        ticks of 10 ms)."""
        if not self._available:
            return 0.0
        with _STAT.open() as f:
            fields = f.readline().split()
        return int(fields[_STEAL_FIELD]) * self._tick

    def waited(self) -> float:
        """Seconds this process's threads have spent ready to run without a core. A
        thread that exits takes its count with it, so a difference may come out below 0."""
        if not self._available:
            return 0.0
        total = 0
        for task in _TASKS.iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (FileNotFoundError, ProcessLookupError):  # the thread just exited
                continue
        return total * 1e-9

"""The fairness bench's account of CPU time taken by others (Linux's /proc)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kamado.bench.lost_cpu import LostCpu

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")


def test_a_process_spinning_on_our_core_shows_as_time_waited():
    lost = LostCpu()
    cpu = min(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    rival = subprocess.Popen([sys.executable, "-c", spin])
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only, on the rival's core
        time.sleep(0.5)  # the rival starts spinning
        waited, stolen = lost.waited(), lost.stolen()
        deadline = time.perf_counter() + 0.6
        while time.perf_counter() < deadline:
            pass
        # Sharing one core with a spinning process, this thread waits about half the time.
        assert lost.waited() - waited > 0.1
        assert lost.stolen() >= stolen >= 0.0
    finally:
        os.sched_setaffinity(0, allowed)
        rival.kill()
        rival.wait()


def test_a_thread_alone_on_an_idle_core_hardly_waits():
    lost = LostCpu()
    waited = lost.waited()
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline:
        pass
    assert lost.waited() - waited < 0.15

"""The engine computes with the cores other processes leave idle, and tokens do not change."""

import subprocess
import sys
import time

import torch

from kamado.engine.cpu_threads import CHECK_EVERY_S, CpuTimes, ThreadGovernor, read_cpu_times
from tests.engine.conftest import greedy, make_engine, run


class FakeMachine:
    """CPU times advancing by hand: one second at a time, with `others` cores busy."""

    def __init__(self) -> None:
        self.t = self.busy = self.own = 0.0

    def tick(self, others: float, own: float = 1.5) -> None:
        self.t += CHECK_EVERY_S
        self.busy += others + own
        self.own += own

    def read(self) -> CpuTimes:
        return CpuTimes(self.busy, self.own, self.t)


def test_threads_follow_the_cores_others_leave_idle():
    machine, set_to = FakeMachine(), []
    governor = ThreadGovernor(
        4, num_cores=4, read=machine.read, set_threads=set_to.append, clock=lambda: machine.t
    )
    seen = []
    for others in (0.0, 0.2, 1.0, 2.5, 3.9, 0.1, 1.2):
        machine.tick(others)
        seen.append(governor.update())
    # A core counts as free while others take at most 0.3 of it; never fewer than 1.
    assert seen == [4, 4, 3, 1, 1, 4, 3]
    assert set_to == [4, 3, 1, 4, 3]  # set only when the count changes
    machine.t += CHECK_EVERY_S / 2
    machine.busy += 3  # a burst within the same second is not looked at yet
    assert governor.update() == 3


def test_more_cores_than_threads_and_a_fixed_count():
    machine = FakeMachine()
    clock = lambda: machine.t  # noqa: E731
    governor = ThreadGovernor(
        2, num_cores=8, read=machine.read, set_threads=lambda n: None, clock=clock
    )
    machine.tick(others=5.0)  # 3 cores idle: both threads still have one each
    assert governor.update() == 2
    pinned = ThreadGovernor(
        2, fixed=1, num_cores=8, read=machine.read, set_threads=lambda n: None, clock=clock
    )
    machine.tick(others=0.0)
    assert pinned.update() == 1


def test_a_busy_neighbour_on_this_machine_takes_a_thread_away():
    assert read_cpu_times() is not None
    governor = ThreadGovernor(2, num_cores=2, set_threads=lambda n: None)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        governor.update()  # the sample before this one covered the interpreter's start
        time.sleep(CHECK_EVERY_S + 0.2)
        assert governor.update() == 1
    finally:
        spin.kill()
        spin.wait()


def test_the_thread_count_does_not_change_a_token(tiny_models):
    path, _ = tiny_models["qwen2"]
    requests = {f"r{i}": ([5 + i, 9, 33, 2 * i + 1] * 6, greedy(16)) for i in range(4)}
    outputs = []
    for threads in (1, 2):
        outputs.append(run(make_engine(path, cpu_threads=threads), requests))
        assert torch.get_num_threads() == threads
    assert outputs[0] == outputs[1]

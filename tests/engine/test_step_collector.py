"""Garbage collections held during a step and run where the host waits for the device."""

from __future__ import annotations

import gc
import weakref

import pytest

from kamado.engine.step_collector import StepCollector


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cycle collector frees it


@pytest.fixture
def low_thresholds():
    """A gen-0 threshold of 10 allocations, so a few cycles make a collection due."""
    old = gc.get_threshold()
    gc.set_threshold(10, 10, 10)
    gc.collect()
    yield
    gc.set_threshold(*old)


def cycles(n: int) -> list[weakref.ref]:
    """`n` unreachable cycles, and a weak reference to each to see whether it is freed."""
    return [weakref.ref(Node()) for _ in range(n)]


def alive(refs: list[weakref.ref]) -> int:
    return sum(r() is not None for r in refs)


def test_no_collection_runs_inside_a_step_until_it_is_called_for(low_thresholds):
    collector = StepCollector(enabled=True)
    with collector.holding():
        assert not gc.isenabled()
        refs = cycles(200)  # twenty times the threshold
        assert alive(refs) == 200
        assert collector.collect_due() is not None
        assert alive(refs) == 0
        assert collector.collect_due() is None  # nothing due right after a collection
    assert gc.isenabled()


def test_young_generations_are_collected_as_they_come_due(low_thresholds):
    collector = StepCollector(enabled=True)
    with collector.holding():
        due = []
        for _ in range(12):  # each round makes gen 0 due; every eleventh, gen 1
            cycles(50)
            due.append(collector.collect_due())
        assert due.count(1) == 1 and due.count(0) == 11


def test_a_full_collection_waits_for_a_quarter_of_the_long_lived_objects(low_thresholds):
    """As CPython's: a full collection scans every object not frozen, so it waits until
    the objects promoted since the last one reach a quarter of those that one left (at
    first, those the engine froze)."""
    ballast = [[] for _ in range(100_000)]  # long-lived, whatever other tests froze before
    frozen = gc.get_freeze_count()
    collector = StepCollector(enabled=True)
    long_lived = gc.get_freeze_count() - frozen
    kept: list[list] = []
    with collector.holding():

        def round_due(keep: int) -> int | None:
            cycles(50)
            kept.extend([] for _ in range(keep))  # these survive, into the oldest
            return collector.collect_due()

        assert 2 not in [round_due(keep=0) for _ in range(300)]  # due by count, not more
        keep = long_lived // 400 + 1
        for _ in range(1000):
            if round_due(keep) == 2:
                break
        else:
            pytest.fail("no full collection once the quarter was promoted")
    assert long_lived / 4 < len(kept) < long_lived / 4 + 30 * keep
    assert long_lived > len(ballast)


def test_a_program_that_turned_collection_off_keeps_it_off(low_thresholds):
    collector = StepCollector(enabled=True)
    gc.disable()
    try:
        with collector.holding():
            refs = cycles(200)
            assert collector.collect_due() is None and alive(refs) == 200
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_on_a_cpu_the_collector_is_left_alone(low_thresholds):
    collector = StepCollector(enabled=False)
    with collector.holding():
        assert gc.isenabled()
        assert collector.collect_due() is None

"""Python's garbage collections, moved to where the host waits for the device.

A collection stops the host for as long as it scans: on the H200, 1.3-2.4 ms beside
5-8 ms decode steps. A gap of 1.82x in the 128k fairness bench was one, set off mid-step
by the allocations of a long prompt's admission. While a step computes on a device, the
host has nothing to do but wait for its tokens, so collections run there. During a step
the automatic collector is off, so no burst of allocations starts one at a worse moment;
what it would have collected waits for the next wait, where CPython's own rules say which
generation is due.

Those rules include the one for full collections, which scan every object not frozen
(9 ms deep in a 128k prompt on the H200): CPython runs one only once the objects promoted
to the oldest generation since the last reach a quarter of those that one left. Python
cannot read those two counts, so they are kept here. (Without the rule, a full collection
every eleventh young one made 13 steps of that bench pass 1.5x.)

On a CPU the host is the device and never waits: the collector is left as it is.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

OLDEST = 2


class StepCollector:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._held = False  # the automatic collector was on, and this turned it off
        # Everything alive now lives as long as the engine: kept out of the collector's
        # scans, so a collection between steps stays short and decode gaps stay even.
        gc.collect()
        self._long_lived = len(gc.get_objects(generation=OLDEST))  # as CPython counts them
        self._promoted = 0  # into the oldest generation since the last full collection
        gc.freeze()

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Automatic collections off inside (left off, where the program turned them off)."""
        if not self.enabled or not gc.isenabled():
            yield
            return
        gc.disable()
        self._held = True
        try:
            yield
        finally:
            self._held = False
            gc.enable()

    def collect_due(self) -> int | None:
        """Collect the oldest generation due by CPython's rules, as the automatic collector
        would have; returns it (None: none was due, or collections are not held here).
        Call it while the device computes."""
        if not self._held:
            return None
        counts, thresholds = gc.get_count(), gc.get_threshold()
        if counts[OLDEST] > thresholds[OLDEST] > 0 and self._promoted > self._long_lived / 4:
            gc.collect(OLDEST)
            self._promoted = 0
            self._long_lived = len(gc.get_objects(generation=OLDEST))
            return OLDEST
        if counts[1] > thresholds[1] > 0:
            young = len(gc.get_objects(generation=0)) + len(gc.get_objects(generation=1))
            self._promoted += max(0, young - gc.collect(1))  # the survivors
            return 1
        if counts[0] > thresholds[0] > 0:
            gc.collect(0)
            return 0
        return None

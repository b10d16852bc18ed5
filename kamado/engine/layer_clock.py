"""Stops a staged chunk's layers in a step once they have used the step's slack (CPU).

On a device that computes as the host calls it (a CPU), the host's clock measures each
layer as it runs. A staged chunk joined to the decodes' pass runs its planned layers one
at a time and stops before the one that would take it past its slack. The pacer's plan is
a prediction from earlier steps, and on a 2-core CPU a step's time varies by tens of ms:
an error per layer that the layers planned multiply (18 layers of a 24-token chunk took a
16k prompt's worst step to 1.9x the normal gap). The clock is this step's measurement.

What a joined layer adds is its time less that of a layer of the decodes alone, which the
same passes measure: the layers before and after the chunk's run the decodes alone. Where
the layers before it already ran late (a busy core, say), the chunk's slack shrinks by as
much: the step is late anyway, and its layers would add to it.

A chunk whose single layer took more than its slack would take as much in each of its
later steps, since a chunk keeps its size: it is split there (`tokens_to_keep`), and its
first tokens go on alone.

With nothing decoding, a chunk in a pass of its own stops the same way once its layers
near the scheduler's bound on a step alone (`passes_bound`), so a request arriving
meanwhile is admitted at the next step.
"""

from __future__ import annotations

from kamado.engine.pacer import chunk_sizes


class LayerClock:
    EMA = 0.3  # decode-only layers vary step to step; a few steps' average

    def __init__(self) -> None:
        self.decode_layer_s: float | None = None  # one layer of the decodes alone

    def decodes_ran(self, layers: int, seconds: float) -> float:
        """`layers` layers of the decodes alone took `seconds`; returns how much longer
        that was than usual (at least 0; 0 before any was timed)."""
        if layers <= 0:
            return 0.0
        old = self.decode_layer_s
        per_layer = seconds / layers
        self.decode_layer_s = per_layer if old is None else old + self.EMA * (per_layer - old)
        return 0.0 if old is None else max(0.0, seconds - layers * old)

    def stop_after(self, layers_done: int, seconds: float, slack_s: float) -> bool:
        """Whether a chunk whose first `layers_done` layers joined to the decodes took
        `seconds` stops before the next: what they added, and as much again as one of them
        added on average, would pass `slack_s`. Never before a decode-only layer was timed."""
        if self.decode_layer_s is None:
            return False
        return self.passes_bound(
            layers_done, seconds - layers_done * self.decode_layer_s, slack_s
        )  # fmt: skip

    def passes_bound(self, layers_done: int, seconds: float, bound_s: float) -> bool:
        """Whether a chunk whose first `layers_done` layers took `seconds` (in a pass of
        its own, or what they added to the decodes') stops before the next: those, and as
        much again as one of them took on average, would pass `bound_s`. With nothing
        decoding the bound is the scheduler's on a step alone."""
        return layers_done > 0 and seconds * (layers_done + 1) / layers_done > bound_s

    def tokens_to_keep(self, num_tokens: int, seconds: float, slack_s: float) -> int:
        """Of a chunk of `num_tokens` whose first layer joined to the decodes took
        `seconds`: the tokens to go on with, so that a layer of them adds about `slack_s`
        (its cost taken as proportional to its tokens), down to a chunk size (chunk_sizes:
        few shapes); all of them where it fit."""
        if self.decode_layer_s is None:
            return num_tokens
        added = seconds - self.decode_layer_s
        if added <= slack_s:
            return num_tokens
        return chunk_sizes(max(1, int(num_tokens * max(slack_s, 0.0) / added)))[-1]

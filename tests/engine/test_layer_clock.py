"""The clock that stops a staged chunk's layers once they used the step's slack (CPU)."""

import pytest

from kamado.engine.layer_clock import LayerClock


def test_decode_only_layers_set_the_baseline_and_say_how_late_they_ran():
    clock = LayerClock()
    assert clock.decodes_ran(0, 1.0) == 0.0 and clock.decode_layer_s is None  # no layer
    assert clock.decodes_ran(4, 0.040) == 0.0  # the first timing: nothing to compare with
    assert clock.decode_layer_s == pytest.approx(0.010)
    # Two layers at 20 ms each: 20 ms later than usual; weighed in at EMA.
    assert clock.decodes_ran(2, 0.040) == pytest.approx(0.020)
    assert clock.decode_layer_s == pytest.approx(0.010 + LayerClock.EMA * 0.010)
    assert clock.decodes_ran(3, 0.001) == 0.0  # early is not counted as slack to spend


def test_a_chunk_stops_before_the_layer_that_would_pass_the_slack():
    clock = LayerClock()
    assert not clock.stop_after(1, 10.0, 0.001)  # no decode-only layer timed yet
    clock.decodes_ran(1, 0.010)
    # Two joined layers took 50 ms: 30 ms added, 15 a layer; a third makes 45 ms.
    assert not clock.stop_after(2, 0.050, 0.050)
    assert clock.stop_after(2, 0.050, 0.040)
    # Joined layers no slower than the decodes alone never stop.
    assert not clock.stop_after(3, 0.030, 0.0)


def test_a_chunk_alone_stops_before_the_layer_that_would_pass_the_bound():
    clock = LayerClock()  # no decode-only layer needed: nothing decodes beside it
    # One layer took 300 ms: a second makes 600.
    assert not clock.passes_bound(1, 0.300, 0.600)
    assert clock.passes_bound(1, 0.300, 0.500)
    # Three layers in 0.9 s: a fourth makes 1.2 s.
    assert clock.passes_bound(3, 0.900, 1.0) and not clock.passes_bound(3, 0.900, 1.2)
    assert not clock.passes_bound(0, 10.0, 0.1)  # before any layer: at least one runs


def test_a_chunk_whose_first_layer_passed_the_slack_keeps_the_tokens_that_fit():
    clock = LayerClock()
    assert clock.tokens_to_keep(40, 10.0, 0.001) == 40  # no decode-only layer timed yet
    clock.decodes_ran(1, 0.010)
    # Its first joined layer took 110 ms: 100 ms added by 40 tokens, 25 ms of slack:
    # 10 tokens fit, and the chunk size below that is 8.
    assert clock.tokens_to_keep(40, 0.110, 0.025) == 8
    assert clock.tokens_to_keep(48, 0.110, 0.025) == 12
    assert clock.tokens_to_keep(40, 0.030, 0.025) == 40  # 20 ms added: it fit
    assert clock.tokens_to_keep(40, 0.110, 0.0) == 1  # never none

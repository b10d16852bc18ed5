"""Prefill pacing: chunks sized from measured step times to keep decodes at pace."""

import pytest

from kamado.engine.pacer import PrefillPacer, chunk_sizes

LONG = 1 << 20  # tokens left of a prompt, more than any chunk takes


def test_without_decodes_prefill_takes_the_whole_budget():
    assert PrefillPacer(1.25, 2048).prefill_limit(num_decodes=0) == 2048


def test_learns_the_decode_gap_first_then_sizes_chunks_to_the_slack():
    pacer = PrefillPacer(1.25, 2048)
    assert pacer.prefill_limit(3) == 0  # a decode-only step comes first, to measure
    pacer.observe(3, 0, 0.040)
    assert pacer.prefill_limit(3) == PrefillPacer.MIN_CHUNK  # no prefill cost known yet
    pacer.observe(3, 10, 0.040 + 10 * 0.002)  # 2 ms per prefill token beside decodes
    # 25% of a 40 ms step is 10 ms of slack: 5 tokens at 2 ms.
    assert pacer.prefill_limit(3) == 5


def test_chunks_shrink_as_prefill_tokens_get_dearer():
    pacer = PrefillPacer(1.5, 2048)
    pacer.observe(3, 0, 0.040)
    pacer.observe(3, 20, 0.040 + 20 * 0.001)
    before = pacer.prefill_limit(3)
    for _ in range(20):  # deeper into a long prompt, attention makes each token dearer
        pacer.observe(3, 5, 0.040 + 5 * 0.008)
    assert pacer.prefill_limit(3) < before
    assert pacer.prefill_limit(3) >= PrefillPacer.MIN_CHUNK


def test_the_decode_gap_is_measured_again_now_and_then():
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for _ in range(PrefillPacer.REMEASURE_EVERY):
        pacer.observe(3, 4, 0.048)
    assert pacer.prefill_limit(3) == 0
    pacer.observe(3, 0, 0.060)
    assert pacer.prefill_limit(3) > 0
    assert pacer.decode_step_s > 0.040  # the fresh, slower measurement moved the estimate


def test_unbounded_factor_turns_pacing_off():
    assert PrefillPacer(float("inf"), 512).prefill_limit(num_decodes=8) == 512


def test_fits_a_fixed_cost_per_chunk_and_a_cost_per_token():
    pacer = PrefillPacer(1.5, 2048)
    pacer.observe(3, 0, 0.100)
    for tokens in (4, 8, 12, 16):  # a chunk costs 10 ms just for being there, 1 ms a token
        pacer.observe(3, tokens, 0.100 + 0.010 + 0.001 * tokens)
    fixed, per_token, error = pacer.cost_model()
    assert (fixed, per_token) == (pytest.approx(0.010), pytest.approx(0.001))
    assert error == pytest.approx(0.0, abs=1e-9)
    # 50 ms of slack: 10 ms fixed leaves 40 ms, 40 tokens; capped at twice the largest seen.
    assert pacer.prefill_limit(3) == 32


def test_noisy_steps_make_the_pacer_more_careful():
    def limit_after(noise: float) -> int:
        pacer = PrefillPacer(1.2, 2048)
        pacer.observe(3, 0, 0.100)
        for i, tokens in enumerate((10, 12, 14, 16) * 4):
            pacer.observe(3, tokens, 0.100 + 0.001 * tokens + (noise if (i // 4) % 2 else -noise))
        return pacer.prefill_limit(3)

    # 20 ms of slack at 1 ms a token; steps 5 ms off either way leave 15 ms to plan with.
    clean, noisy = limit_after(0.0), limit_after(0.005)
    assert clean == pytest.approx(20, abs=1)
    assert noisy == pytest.approx(clean - 5, abs=1)


def test_when_any_chunk_overruns_the_slack_a_chunk_still_gets_the_slack():
    # As on a GPU: decodes replay from graphs in 7 ms, a mixed step runs eagerly, 20 ms more.
    pacer = PrefillPacer(1.25, 8192)
    pacer.observe(3, 0, 0.007)
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128) * 2:
        pacer.observe(3, tokens, 0.007 + 0.020 + tokens * 1e-6)
    fixed, per_token, _ = pacer.cost_model()
    assert fixed == pytest.approx(0.020) and per_token == pytest.approx(1e-6)
    # One token would stall the streams 27 ms as well; 1.75 ms of slack buys 1750 tokens
    # (capped at twice the largest chunk measured).
    assert pacer.prefill_limit(3) == 2 * 128


def test_one_token_chunks_that_overrun_the_slack_learn_the_slope_from_prefill_alone():
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(0, 2048, 0.256)  # a prompt alone: 0.125 ms a token
    pacer.observe(3, 0, 0.014)
    for _ in range(8):  # an eager mixed step costs 7.5 ms more whatever the chunk
        pacer.observe(3, 1, 0.014 + 0.0075)
    fixed, per_token, _ = pacer.cost_model()
    assert per_token == pytest.approx(0.000125) and fixed == pytest.approx(0.0075 - 0.000125)
    # The fixed part overruns the 3.5 ms slack: a chunk gets the slack's worth on top
    # (28 tokens), capped at twice the largest chunk measured.
    assert pacer.prefill_limit(3) == 2
    pacer.observe(3, 2, 0.014 + 0.0075 + 0.00025)
    assert pacer.prefill_limit(3) == 4


def test_a_follow_up_turn_stretches_steps_to_the_short_factor():
    pacer = PrefillPacer(1.25, 2048, short_factor=2.0)
    pacer.observe(3, 0, 0.040)
    for tokens in (4, 8, 16, 32):  # 1 ms fixed, 0.25 ms a token
        pacer.observe(3, tokens, 0.040 + 0.001 + 0.00025 * tokens)
    assert pacer.prefill_limit(3) == 64  # 40 ms of slack would fit 156; twice 32 seen


def test_a_prompt_going_by_layers_alone_also_measures_prefill_per_token():
    pacer = PrefillPacer(1.25, 2048, num_layers=24)
    # 2,048 tokens through 3 of 24 layers in 32 ms: 256 tokens' worth, 0.125 ms each.
    pacer.observe(0, 0, 0.032, staged=[(2048, 3)])
    assert pacer.prefill_token_s == pytest.approx(0.000125)
    # Through one layer, 2,048 tokens are still a chunk whose fixed costs do not count:
    # 0.25 ms a token here, weighed in at EMA.
    pacer.observe(0, 0, 2 * 0.032 / 3, staged=[(2048, 1)])
    learned = 0.000125 + PrefillPacer.EMA * 0.000125
    assert pacer.prefill_token_s == pytest.approx(learned)
    # A chunk too short to measure (128 tokens, through every layer too): unchanged.
    pacer.observe(0, 0, 1.0, staged=[(128, 24)])
    assert pacer.prefill_token_s == pytest.approx(learned)
    # Without the model's layers, a chunk going by layers measures nothing.
    unknown = PrefillPacer(1.25, 2048)
    unknown.observe(0, 0, 0.064, staged=[(2048, 6)])
    assert unknown.prefill_token_s is None


def test_one_token_chunks_are_off_the_line_of_longer_ones():
    # As on the H200 beside two decodes at 100k: a one-token chunk replays in the decode
    # graph (7.1 ms more than the decodes alone); from two tokens a step runs eagerly
    # (14.5 ms more) and each token adds little.
    pacer = PrefillPacer(1.25, 2048, short_factor=2.0)
    pacer.observe(0, 2048, 0.256)  # prefill alone: 0.125 ms a token
    pacer.observe(2, 0, 0.0144)
    for _ in range(20):
        pacer.observe(2, 1, 0.0215)
    pacer.observe(2, 2, 0.0289)
    # A line through one and two tokens charges 7.4 ms a token: chunks stayed at one token.
    # Off that line, the fixed part (14.25 ms) is nearly all of the 14.4 ms slack, so the
    # tokens get as long again: the chunk grows, capped at twice the largest seen.
    assert pacer.prefill_limit(2) == 4
    for tokens in (4, 8, 16, 32, 64):
        pacer.observe(2, tokens, 0.0144 + 0.0145 + 0.0001 * tokens)
    assert pacer.prefill_limit(2) == 128


def test_a_slope_that_does_not_stand_out_from_the_noise_is_not_trusted():
    pacer = PrefillPacer(1.5, 2048)
    pacer.observe(0, 2048, 0.256)  # prefill alone: 0.125 ms a token
    pacer.observe(3, 0, 0.040)
    # Chunks of two and three tokens, 10 ms more whatever the size, give or take 2 ms: the
    # three-token steps happened to run slower on average.
    for tokens, extra in [(2, 0.008), (3, 0.012), (2, 0.011), (3, 0.009), (2, 0.009)]:
        pacer.observe(3, tokens, 0.040 + extra)
    fixed, per_token, _ = pacer.cost_model()
    assert per_token == pytest.approx(0.000125)  # the prefill-alone slope, not the fit's 1.2 ms


def test_one_slow_decode_step_does_not_widen_the_slack():
    pacer = PrefillPacer(1.25, 2048)
    for seconds in (0.040, 0.041, 0.400, 0.039, 0.040):  # one step also admitted a prompt
        pacer.observe(3, 0, seconds)
    assert pacer.decode_step_s == pytest.approx(0.040)


def test_a_staged_chunk_starts_small_and_runs_one_layer_after_the_normal_gap_is_known():
    pacer = PrefillPacer(1.25, 2048)
    assert pacer.staged_chunk_tokens(LONG) == PrefillPacer.FIRST_STAGED_CHUNK
    assert pacer.staged_layers(16) == 0  # a decode-only step comes first, to measure
    pacer.observe(3, 0, 0.040)
    assert pacer.staged_layers(16) == 1


def test_the_last_chunks_of_a_prompt_take_chunk_sizes_too():
    # The first step with a matmul shape never run is slow: a prompt's end is cut into
    # sizes the chunks before it took (and the engine warmed), not one odd-sized remainder.
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for tokens, layers in ((16, 2), (32, 2), (64, 1)):  # 1 ms + 0.01 ms a token a layer
        pacer.observe(3, 0, 0.040 + layers * (0.001 + 0.00001 * tokens), [(tokens, layers)])
    assert pacer.staged_chunk_tokens(LONG) == 96
    assert pacer.staged_chunk_tokens(52) == 48
    assert pacer.staged_chunk_tokens(5) == 4
    assert pacer.staged_chunk_tokens(1) == 1
    assert pacer.staged_chunk_tokens(0) == 0


def test_staged_chunks_are_sized_per_layer_to_the_slack():
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for tokens, layers in ((4, 1), (8, 3), (16, 2), (32, 1)):  # 1 ms + 0.1 ms a token a layer
        pacer.observe(3, 0, 0.040 + layers * (0.001 + 0.0001 * tokens), [(tokens, layers)])
    fixed, per_token, error = pacer.layer_cost_model()
    assert (fixed, per_token) == (pytest.approx(0.001), pytest.approx(0.0001))
    assert error == pytest.approx(0.0, abs=1e-9)
    # 10 ms of slack, two layers a step: 5 ms a layer, 1 ms fixed leaves 40 tokens, and the
    # chunk takes the size below that of the few it may take (chunk_sizes).
    assert pacer.staged_chunk_tokens(LONG) == 32
    assert pacer.staged_layers(40) == 1  # larger than any chunk measured: one layer first
    assert pacer.staged_layers(32) == 2  # 4.2 ms a layer
    assert pacer.staged_layers(16) == 3  # 2.6 ms a layer


def test_a_layer_whose_fixed_part_overruns_half_the_slack_is_sized_for_one_layer_a_step():
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for tokens in (8, 16, 32, 64):  # 6 ms a layer fixed (the context's K/V), 0.05 ms a token
        pacer.observe(3, 0, 0.040 + 0.006 + 0.00005 * tokens, [(tokens, 1)])
    # Two layers cannot fit 10 ms; one layer leaves 4 ms: 80 tokens, a chunk of 64.
    assert pacer.staged_chunk_tokens(LONG) == 64
    assert pacer.staged_layers(64) == 1


def test_steps_with_prompt_work_count_towards_measuring_the_normal_gap_again():
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for _ in range(PrefillPacer.REMEASURE_EVERY):
        pacer.observe(3, 0, 0.045, [(16, 1)])
    assert pacer.staged_layers(16) == 0
    assert pacer.prefill_limit(3) == 0
    pacer.observe(3, 0, 0.040)
    assert pacer.staged_layers(16) > 0


def test_staged_chunks_take_few_sizes_two_a_doubling():
    assert chunk_sizes(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96]
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for tokens in (16, 24, 32):  # 0.2 ms a token a layer: 25 tokens a layer in 5 ms
        pacer.observe(3, 0, 0.040 + 0.0002 * tokens, [(tokens, 1)])
    assert pacer.staged_chunk_tokens(LONG) == 24


def test_a_size_that_ran_slower_than_the_line_gets_fewer_layers():
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for tokens in (8, 16, 32, 64):  # 0.1 ms a token a layer, four layers a step
        pacer.observe(3, 0, 0.040 + 4 * 0.0001 * tokens, [(tokens, 4)])
    assert pacer.staged_layers(16) == 6  # 10 ms of slack at 1.6 ms a layer
    pacer.observe(3, 0, 0.040 + 2 * 0.004, [(16, 2)])  # but 16 tokens took 4 ms a layer
    # The refitted line says 3.2 ms a layer; this size's own steps, 1.6 and 4 ms, say
    # 2.8 ms give or take 1.2 ms: 2 layers.
    assert pacer.staged_layers(16) == 2


def test_a_new_staged_chunk_is_at_most_one_size_above_the_largest_measured():
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for tokens in (4, 8, 16):  # 0.01 ms a token a layer: 500 tokens would fit two layers
        pacer.observe(3, 0, 0.040 + 0.00001 * tokens, [(tokens, 1)])
    assert pacer.staged_chunk_tokens(LONG) == 24


def test_a_size_runs_at_most_twice_the_layers_it_ran_before_in_a_step():
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for tokens in (8, 16, 32):  # 0.01 ms a token a layer: 10 ms fits dozens of layers
        pacer.observe(3, 0, 0.040 + 0.00001 * tokens, [(tokens, 1)])
    assert pacer.staged_layers(16) == 2
    pacer.observe(3, 0, 0.040 + 2 * 0.00016, [(16, 2)])
    assert pacer.staged_layers(16) == 4


def test_a_chunk_grows_only_while_its_cost_scaled_from_the_largest_size_still_fits():
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for tokens in (8, 16, 32, 64):  # 2 ms a layer and 0.01 ms a token: 300 tokens would fit
        pacer.observe(3, 0, 0.040 + 0.002 + 0.00001 * tokens, [(tokens, 1)])
    # 64 tokens took 2.64 ms a layer; 96 in proportion, 3.96 ms, within 5 ms a layer.
    assert pacer.staged_chunk_tokens(LONG) == 96
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for _ in range(5):
        for tokens in (8, 16, 32):  # 2 ms a layer at any size: the weights are read anyway
            pacer.observe(3, 0, 0.042, [(tokens, 1)])
    pacer.observe(3, 0, 0.040 + 0.0039, [(64, 1)])  # but 64 tokens take 3.9 ms a layer
    # The line through them says 96 tokens fit in 5 ms a layer; in proportion from 64
    # they would take 5.85 ms: no chunk larger than 64.
    assert pacer.staged_chunk_tokens(LONG) == 64


def test_staged_chunks_do_not_shrink_where_their_cost_is_step_noise():
    """On CPU a step's noise (tens of ms) outweighs a layer of a small chunk. Where no slope
    stands out of it, the cost counts as fixed: the chunk may grow a size. (Counted per
    token, 60 ms over 1-3 tokens priced a token at 30 ms, and the chunks shrank each time
    down to one token, a 16k prompt crawling at a few tokens a minute.)"""
    pacer = PrefillPacer(1.5, 8192)
    for seconds in (0.400, 0.380, 0.420):
        pacer.observe(3, 0, seconds)
    for tokens, extra in ((1, 0.070), (2, 0.045), (3, 0.065), (1, 0.050), (2, 0.075), (3, 0.055)):
        pacer.observe(3, 0, 0.400 + extra, [(tokens, 1)])
    fixed, per_token, error = pacer.layer_cost_model()
    assert fixed == pytest.approx(0.060) and per_token < 1e-5
    # 200 ms of slack, 100 ms a layer: 3 tokens took 60 ms a layer, 4 would take 80.
    assert pacer.staged_chunk_tokens(LONG) == 4


def test_steps_faster_than_the_normal_gap_count_as_negative_cost():
    # Clipped at zero, the noise of steps around the normal gap would average to a cost.
    pacer = PrefillPacer(1.5, 8192)
    pacer.observe(3, 0, 0.400)
    for tokens, seconds in ((8, 0.440), (8, 0.360), (16, 0.430), (16, 0.370)):
        pacer.observe(3, 0, seconds, [(tokens, 1)])
    fixed, per_token, _ = pacer.layer_cost_model()
    assert fixed == pytest.approx(0.0, abs=1e-9) and per_token < 1e-5


def test_the_normal_gap_is_measured_again_after_some_seconds_of_slow_steps():
    # On CPU 64 steps are half a minute, over which the machine's pace drifts.
    pacer = PrefillPacer(1.5, 8192)
    pacer.observe(3, 0, 0.400)
    steps = int(PrefillPacer.REMEASURE_SECONDS / 0.450) + 1
    for _ in range(steps - 1):
        pacer.observe(3, 0, 0.450, [(16, 1)])
    assert pacer.staged_layers(16) > 0
    pacer.observe(3, 0, 0.450, [(16, 1)])
    assert pacer.staged_layers(16) == 0


def test_where_nothing_fits_by_the_line_a_chunk_shrinks_in_proportion():
    # 60 ms a layer at any of three sizes, over a 10 ms slack: no slope stands out, so the
    # line calls it all fixed, and no size fits; the smallest, 32 tokens, scaled to 10 ms
    # are 5.
    pacer = PrefillPacer(1.25, 2048)
    pacer.observe(3, 0, 0.040)
    for tokens in (32, 48, 64, 32, 48, 64):
        pacer.observe(3, 0, 0.040 + 0.060, [(tokens, 1)])
    assert pacer.staged_chunk_tokens(LONG) == 4


def test_no_new_chunk_takes_a_size_whose_own_layers_overran_where_the_line_says_it_fits():
    # On CPU deep in a 16k prompt: layers of 32-64 tokens cost 0-80 ms, step noise; one of
    # 96 tokens took 300 ms over an 87 ms slack. The line through them all promises 32
    # tokens; from 96's own cost the next chunk gets 96 * 87 / 300 = 27 at most.
    pacer = PrefillPacer(1.25, 8192)
    pacer.observe(3, 0, 0.350)
    noise = (0.0, 0.08, 0.02, 0.06, -0.01, 0.07)
    for i, tokens in enumerate((32, 48, 64) * 8):
        pacer.observe(3, 0, 0.350 + noise[i % 6], [(tokens, 1)])
    pacer.observe(3, 0, 0.350 + 0.300, [(96, 1)])
    assert pacer.staged_chunk_tokens(LONG) == 24


def test_chunks_of_one_size_that_overrun_the_slack_shrink_in_proportion():
    # Deep into a 128k prompt on a GPU: 384-token chunks take 7 ms a layer over a 1.9 ms
    # slack. One size shows no slope, but the cost is no noise: the chunk must shrink.
    pacer = PrefillPacer(1.25, 8192)
    pacer.observe(3, 0, 0.0075)
    for extra in (0.0069, 0.0071, 0.0070, 0.0072):
        pacer.observe(3, 0, 0.0075 + extra, [(384, 1)])
    assert pacer.staged_chunk_tokens(LONG) <= 96


def test_serve_flags_set_the_engines_pacing_bounds(capsys):
    from kamado.cli import build_parser
    from kamado.engine.core import EngineCore
    from kamado.server.commands import engine_config

    serve = build_parser().parse_args(
        ["serve", "--decode-stall-factor", "1.1", "--short-turn-stall-factor", "3"]
    )
    config = engine_config(serve, "synthetic:tiny-qwen2")
    config.kv_cache_bytes = 8 << 20
    pacer = EngineCore(config).pacer
    assert (pacer.factor, pacer.short_factor) == (1.1, 3.0)
    off = build_parser().parse_args(["serve", "--decode-stall-factor", "inf"])
    assert not PrefillPacer(off.decode_stall_factor, 2048).paces
    for bad, words in [("0.9", "at least 1"), ("nan", "at least 1"), ("fast", "a number")]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--decode-stall-factor", bad])
        assert words in capsys.readouterr().err


def test_a_prompts_last_token_alone_is_prompt_work_not_a_decode():
    from kamado.engine.core import StepWork
    from kamado.engine.sampling_params import SamplingParams
    from kamado.engine.scheduler import ScheduledSeq
    from kamado.engine.sequence import Sequence

    def seq(prompt: int, outputs: int) -> Sequence:
        s = Sequence("r", 0, list(range(prompt)), SamplingParams(), 0)
        s.token_ids += [1] * outputs
        s.num_computed = s.num_tokens - 1
        return s

    # A 300-token prompt whose last token goes alone, beside two decodes.
    work = StepWork.of([ScheduledSeq(seq(300, 0), 1)] + [ScheduledSeq(seq(64, 5), 1)] * 2)
    assert (work.num_decodes, work.prefill_tokens) == (2, 1)

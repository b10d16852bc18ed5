"""Long prompts go a few layers per step, beside decodes or alone in bounded steps: same
tokens as whole chunks."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest

from kamado.engine.core import EngineCore
from kamado.engine.layer_clock import LayerClock
from kamado.engine.sampling_params import SamplingParams
from tests.engine.conftest import FixedPacer, greedy, make_engine, tiny_hf_model

NUM_LAYERS = 4
MAX_STEPS = 3000  # every case here finishes in well under this


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> dict[str, str]:
    out = {}
    for arch in ("qwen3", "llama"):
        path = tmp_path_factory.mktemp(f"four-layer-{arch}")
        tiny_hf_model(arch, path, num_hidden_layers=NUM_LAYERS)
        out[arch] = str(path)
    return out


def paced(path: str, chunk: int, layers: int, **options) -> EngineCore:
    engine = make_engine(path, speculation="off", **options)
    # Prompts of more than 32 new tokens are long; fewer, follow-ups of 8 tokens a step.
    engine.pacer = engine.scheduler.pacer = FixedPacer(chunk, layers, short=8, long=32)
    # No layer clock: on a loaded CPU it would split chunks that overran the slack, and
    # the schedule (whether a preemption comes, say) would hang on the machine's load.
    # Tests of the clock set one that ignores time.
    engine.runner.clock = None
    return engine


def whole(path: str, **options) -> EngineCore:
    return make_engine(
        path, speculation="off", decode_stall_factor=float("inf"), alone_step_s=None, **options
    )  # fmt: skip


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(length)]


STREAMS = {f"stream{i}": (prompt(i, 5 + i), greedy(40)) for i in range(3)}
LONG_PROMPT = ("long", (prompt(10, 150), greedy(12)))


class Step(NamedTuple):
    decodes: int
    prompt_tokens: int
    layers: int  # of a staged chunk; 0: none
    ahead: bool  # launched before the step before it was read


def drive(engine: EngineCore, arrivals: dict[int, dict]) -> tuple[dict, list[Step]]:
    """Run to completion, adding arrivals[k] before step k. Returns the tokens of each
    request's choices and what each step ran."""
    out: dict[str, dict[int, list[int]]] = {}
    trace = []
    step = 0
    while engine.has_work() or step in arrivals:
        for request_id, (tokens, params) in arrivals.get(step, {}).items():
            engine.add_request(request_id, tokens, params)
        for delta in engine.step():
            out.setdefault(delta.request_id, {}).setdefault(delta.index, []).extend(
                delta.new_token_ids
            )
        s = engine.stats
        trace.append(
            Step(
                s.last_step_decodes,
                s.last_step_prefill_tokens,
                s.last_step_prefill_layers,
                s.last_step_launched_ahead,
            )
        )
        step += 1
        assert step < MAX_STEPS, "the requests did not finish"
    return out, trace


def long_beside_streams(long: tuple = LONG_PROMPT) -> dict[int, dict]:
    return {0: dict(STREAMS), 3: dict([long])}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("chunk,layers", [(7, 1), (16, 3), (1, 2), (40, NUM_LAYERS)])
def test_a_staged_prompt_gives_the_tokens_of_whole_chunks(four_layers, arch, chunk, layers):
    path = four_layers[arch]
    expected, _ = drive(whole(path), long_beside_streams())
    engine = paced(path, chunk, layers)
    got, trace = drive(engine, long_beside_streams())
    assert got == expected
    # The long prompt went a few layers a step beside the streams' decodes.
    staged = [t for t in trace if t.decodes == 3 and t.layers > 0]
    assert staged and all(t.layers <= layers for t in staged)
    assert engine.pool.num_used == 0


def test_a_chunk_left_when_decodes_end_finishes_its_layers_in_one_step(four_layers):
    path = four_layers["qwen3"]
    streams = {f"short{i}": (prompt(i, 6), greedy(3)) for i in range(2)}
    arrivals = {0: streams, 2: dict([LONG_PROMPT])}
    expected, _ = drive(whole(path), arrivals)
    got, trace = drive(paced(path, 9, 1), arrivals)
    assert got == expected
    # With no decodes left, a chunk part way through runs its remaining layers at once.
    assert any(t.decodes == 0 and 1 < t.layers < NUM_LAYERS for t in trace)


def test_a_follow_up_overtakes_a_long_prompt_going_by_layers(four_layers):
    path = four_layers["llama"]
    follow_up = ("follow-up", (prompt(20, 20), greedy(4)))
    arrivals = {0: dict(STREAMS), 3: dict([LONG_PROMPT]), 10: dict([follow_up])}
    expected, _ = drive(whole(path), arrivals)
    engine = paced(path, 5, 1)
    first_token: dict[str, int] = {}
    step = 0
    while engine.has_work() or step in arrivals:
        for request_id, (tokens, params) in arrivals.get(step, {}).items():
            engine.add_request(request_id, tokens, params)
        for delta in engine.step():
            first_token.setdefault(delta.request_id, step)
        step += 1
        assert step < MAX_STEPS, "the requests did not finish"
    # The follow-up ran whole 8-token chunks while the long prompt's chunks waited.
    assert first_token["follow-up"] < first_token["long"]
    assert first_token["follow-up"] - 10 <= 4
    got, _ = drive(paced(path, 5, 1), arrivals)
    assert got == expected


def test_a_short_prompt_does_not_queue_behind_a_long_one_prefilled_alone(four_layers):
    path = four_layers["llama"]
    arrivals = {0: dict([LONG_PROMPT]), 1: {"short": (prompt(21, 3), greedy(3))}}
    expected, _ = drive(whole(path), arrivals)
    got, trace = drive(paced(path, 5, 1, max_num_batched_tokens=16), arrivals)
    assert got == expected
    # Nothing decoded, so the long prompt had the whole budget of each step, and the
    # short one waited till its last chunk. Now it goes first, in a step of its own 3
    # tokens (a chunk of the long prompt beside them would delay its first token).
    assert trace[1].decodes == 0 and trace[1].prompt_tokens == 3
    assert trace[2].decodes == 1  # and decodes from the next step


def test_preemption_part_way_through_a_chunk_drops_it_and_changes_no_token(four_layers):
    path = four_layers["qwen3"]
    options = {"kv_cache_bytes": 56 * 4 * 2 * NUM_LAYERS * 2 * 32 * 4, "block_size": 4}
    arrivals = long_beside_streams()
    expected, _ = drive(whole(path), arrivals)
    engine = paced(path, 12, 1, **options)
    got, _ = drive(engine, arrivals)
    assert got == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_used == 0


def test_an_abort_part_way_through_a_chunk_frees_its_blocks(four_layers):
    path = four_layers["llama"]
    engine = paced(path, 16, 1, enable_prefix_caching=False)
    for request_id, (tokens, params) in STREAMS.items():
        engine.add_request(request_id, tokens, params)
    engine.step()
    engine.step()
    used_by_streams = engine.pool.num_used
    engine.add_request(*LONG_PROMPT[:1], *LONG_PROMPT[1])
    long_seq = engine._requests["long"][0]
    for _ in range(MAX_STEPS):
        if long_seq.staged is not None and long_seq.staged.next_layer >= 2:
            break
        engine.step()
    assert engine.pool.num_used > used_by_streams
    engine.abort("long")
    assert long_seq.staged is None
    engine.step()  # the streams' blocks may grow by one each in a step
    assert engine.pool.num_used <= used_by_streams + len(STREAMS)
    while engine.has_work():
        engine.step()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_the_prefix_cache_serves_a_prompt_computed_by_layers(four_layers, overlap):
    # With overlap, a chunk's blocks are cached once its last layer is queued.
    path = four_layers["qwen3"]
    engine = paced(path, 16, 2, overlap_decode=overlap)
    first, _ = drive(engine, long_beside_streams())
    again, _ = drive(engine, {0: {"again": LONG_PROMPT[1]}})
    assert again["again"] == first["long"]
    seq_tokens = LONG_PROMPT[1][0]
    assert engine.prefix.stats.device_hit_tokens >= len(seq_tokens) - 16


def test_choices_fork_from_a_prompt_computed_by_layers(four_layers):
    path = four_layers["llama"]
    params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=8)
    long = ("long", (prompt(10, 100), params))
    expected, _ = drive(whole(path), long_beside_streams(long))
    got, _ = drive(paced(path, 11, 3), long_beside_streams(long))
    assert got == expected
    assert len(got["long"]) == 3


def test_long_prompts_sharing_a_prefix_compute_it_once_beside_decodes(four_layers):
    """Beside decodes a long prompt is admitted whatever the budget, so the second one
    arrives while the first is part way: it waits for the block the first computes next
    (filed as in flight at each commit) instead of computing the shared prefix again."""
    path = four_layers["qwen3"]
    shared = prompt(20, 128)  # 8 full blocks of 16
    longs = {f"long{i}": (shared + prompt(30 + i, 40), greedy(4)) for i in range(2)}
    arrivals = {0: dict(STREAMS), 3: dict(longs)}
    expected, _ = drive(whole(path), arrivals)
    engine = paced(path, 16, 2)
    got, _ = drive(engine, arrivals)
    assert got == expected
    stream_tokens = sum(len(tokens) for tokens, _ in STREAMS.values())
    computed = engine.stats.prompt_tokens_total - stream_tokens
    assert computed <= len(shared) + 2 * 40 + 16  # the prefix once (and a block's slack)
    assert engine.prefix.stats.device_hit_tokens >= len(shared)
    assert engine.pool.num_used == 0


class StopAfterOneLayer(LayerClock):
    """A clock that finds the slack used, not passed, by every chunk's first layer in a
    step, and the bound on a step alone used by every layer: no chunk is split."""

    def stop_after(self, layers_done: int, seconds: float, slack_s: float) -> bool:
        return True

    def passes_bound(self, layers_done: int, seconds: float, bound_s: float) -> bool:
        return True

    def tokens_to_keep(self, num_tokens: int, seconds: float, slack_s: float) -> int:
        return num_tokens


def clocked_beside_streams(
    path: str, clock: LayerClock, stream_tokens: int
) -> tuple[EngineCore, list[Step]]:
    """The long prompt paced in chunks of 16 (3 layers planned a step) beside three
    streams of `stream_tokens` each, which outlast it so that all of it goes beside them,
    with `clock` timing its layers. Asserts the tokens are those of whole chunks; returns
    the engine and what each step ran."""
    streams = {f"stream{i}": (prompt(i, 5 + i), greedy(stream_tokens)) for i in range(3)}
    arrivals = {0: streams, 3: dict([LONG_PROMPT])}
    expected, _ = drive(whole(path), arrivals)
    engine = paced(path, 16, 3)
    engine.runner.clock = clock
    got, trace = drive(engine, arrivals)
    assert got == expected
    return engine, trace


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_chunk_the_clock_stops_early_gives_the_same_tokens(four_layers, arch):
    engine, trace = clocked_beside_streams(four_layers[arch], StopAfterOneLayer(), 100)
    # Planned 3 layers of 4, each step stops after one, the one that would sample the
    # prompt's token too: it samples in the step that runs the last layer.
    staged = [t.layers for t in trace if t.decodes == 3 and t.layers > 0]
    assert set(staged) == {1} and len(staged) == NUM_LAYERS * -(-150 // 16)
    assert engine.snapshot().staged_splits == 0
    assert engine.pool.num_used == 0


class KeepHalf(LayerClock):
    """A clock that finds each chunk's first layer in a step took twice its slack."""

    def tokens_to_keep(self, num_tokens: int, seconds: float, slack_s: float) -> int:
        return max(1, num_tokens // 2)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_chunk_split_where_its_layer_overran_gives_the_same_tokens(four_layers, arch):
    # Longer streams: the prompt takes more steps as it is split ever smaller.
    engine, trace = clocked_beside_streams(four_layers[arch], KeepHalf(), 600)
    # A chunk of 16 runs its first layer whole, then goes on with 8; those 8 split again
    # at the next step's first layer, and so on (a last layer is never split: 2 tokens
    # finish the chunk's 4 layers); then the tokens split off go on, each from its layer.
    beside = [(t.prompt_tokens, t.layers) for t in trace if t.decodes == 3 and t.layers]
    assert beside[:5] == [(16, 1), (8, 1), (4, 1), (2, 1), (2, 1)]
    assert engine.snapshot().staged_splits >= 3  # 16 to 8, 8 to 4, 4 to 2 above
    # Every prompt token through every layer once, staged; but for the last, which once
    # it is the only token left the next step computes whole (as a decode's input).
    staged = sum(tokens * layers for tokens, layers in beside)
    assert 149 * NUM_LAYERS <= staged <= 150 * NUM_LAYERS
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("chunk,layers", [(16, 1), (40, 3)])
def test_a_staged_prompt_goes_ahead_of_the_tokens_with_the_same_tokens(four_layers, chunk, layers):
    # Launched before the step in flight is read (as on a GPU), a step carries the next
    # layers of the chunk under way beside the decodes fed from the device.
    path = four_layers["qwen3"]
    streams = {f"stream{i}": (prompt(i, 5 + i), greedy(100)) for i in range(3)}
    arrivals = {0: streams, 3: dict([LONG_PROMPT])}
    expected, _ = drive(whole(path), arrivals)
    engine = paced(path, chunk, layers, overlap_decode=True)
    got, trace = drive(engine, arrivals)
    assert got == expected
    # Every step beside the prompt went ahead but its first (planned once the prompt had
    # arrived), new chunks' first layers too.
    beside = [t for t in trace if t.decodes and t.layers]
    assert len(beside) > 4 and not beside[0].ahead and all(t.ahead for t in beside[1:])
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("budget,chunks", [(2048, [150]), (64, [64, 64, 22])])
def test_a_long_prompt_alone_goes_a_layer_a_step_where_each_uses_the_bound(
    four_layers, budget, chunks
):
    path = four_layers["qwen3"]
    arrivals = {0: dict([LONG_PROMPT])}
    expected, _ = drive(whole(path, max_num_batched_tokens=budget), arrivals)
    engine = paced(path, 16, 1, max_num_batched_tokens=budget)
    engine.runner.clock = StopAfterOneLayer()
    got, trace = drive(engine, arrivals)
    assert got == expected
    # Each chunk is what the budget allows (not the pacer's 16: nothing decodes), one
    # layer a step; the steps after them decode.
    alone = [(t.prompt_tokens, t.layers) for t in trace if t.decodes == 0]
    assert alone == [(n, 1) for n in chunks for _ in range(NUM_LAYERS)]
    assert engine.pool.num_used == 0


def test_a_request_arriving_while_a_long_prompt_goes_alone_waits_one_step(four_layers):
    path = four_layers["llama"]
    short = ("short", (prompt(21, 3), greedy(3)))
    arrivals = {0: dict([LONG_PROMPT]), 2: dict([short])}
    expected, _ = drive(whole(path), arrivals)
    engine = paced(path, 16, 1)
    engine.runner.clock = StopAfterOneLayer()
    got, trace = drive(engine, arrivals)
    assert got == expected
    # The long prompt's one chunk of 150 had run 2 of its layers when the short one came:
    # the short one's 3 tokens went in the next step, on their own, and it decodes after.
    assert trace[:3] == [Step(0, 150, 1, False), Step(0, 150, 1, False), Step(0, 3, 0, False)]
    assert trace[3].decodes == 1
    # Beside the decodes, the chunk under way went on in the pacer's size, not its own.
    beside = [t.prompt_tokens for t in trace if t.decodes and t.layers]
    assert beside and max(beside) == 16
    assert engine.pool.num_used == 0


def test_the_engine_times_a_step_alone_by_its_layers(four_layers):
    path = four_layers["qwen3"]
    arrivals = {0: dict([LONG_PROMPT])}
    expected, _ = drive(whole(path), arrivals)
    for bound, layers_a_step in [(1e-9, [1] * NUM_LAYERS), (60.0, [NUM_LAYERS])]:
        # Every layer passes a bound of a nanosecond; none of a tiny model's, a minute.
        engine = make_engine(path, speculation="off", alone_step_s=bound)
        engine.pacer.SHORT_TURN_TOKENS = 32  # 150 tokens make a long prompt
        got, trace = drive(engine, arrivals)
        assert got == expected
        assert [t.layers for t in trace if t.prompt_tokens] == layers_a_step

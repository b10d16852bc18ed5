"""A batch's decode rate is taken over the steps in which the whole batch decodes."""

import pytest

from kamado.bench import throughput
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore


def staggering_engine() -> EngineCore:
    """Three sequences at most, 16 prompt tokens a step: longer prompts are prefilled one
    after another."""
    return EngineCore(
        EngineConfig(
            model="synthetic:tiny-qwen2", device="cpu", max_num_batched_tokens=16,
            max_num_seqs=3, enable_prefix_caching=False, speculation="off",
        )
    )  # fmt: skip


def test_decode_rate_leaves_out_the_staggered_prefill_and_the_shrinking_tail(monkeypatch):
    # 40-token prompts at 16 tokens a step: the first prompt decodes while the others are
    # prefilled, finishes first, and the batch then shrinks. On a fake clock a step takes a
    # second plus a second a token it emits, so a step of the whole batch of 3 gives 3
    # tokens in 4 seconds, and any other step a lower rate.
    engine = staggering_engine()
    now = 0.0
    engine_step = engine.step

    def step() -> list:
        nonlocal now
        deltas = engine_step()
        now += 1 + sum(len(d.new_token_ids) for d in deltas)
        return deltas

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: now)
    r = throughput.kamado_throughput(engine, "tiny", batch=3, prompt_len=40, gen_len=80)
    assert r.decode_tok_s == 3 / 4


def test_a_batch_that_never_decodes_together_is_an_error():
    # One new token each: every request finishes with its first token.
    engine = staggering_engine()
    with pytest.raises(ValueError, match="raise the number of new tokens"):
        throughput.kamado_throughput(engine, "tiny", batch=3, prompt_len=40, gen_len=1)


def test_a_batch_decoded_one_after_another_is_an_error():
    # Three new tokens each: the first request finishes while the third prompt is still
    # being prefilled, so no step decodes all three (the rate over the last one's tokens
    # alone is not the batch's).
    engine = staggering_engine()
    with pytest.raises(ValueError, match="raise the number of new tokens"):
        throughput.kamado_throughput(engine, "tiny", batch=3, prompt_len=40, gen_len=3)

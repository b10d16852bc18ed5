"""A draft model with its own paged KV: output unchanged, KV kept in step with the target."""

import pytest

from kamado.engine.sampling_params import SamplingParams
from tests.engine.conftest import make_engine, run
from tests.spec.test_greedy_identity import repetitive_requests, spec_stats, speculating
from tests.tiny_models import save_tiny_hf_model


@pytest.fixture(scope="module")
def near_copy(tmp_path_factory):
    """The tiny qwen3 model's weights drawn again at another scale: a draft that agrees
    with it often, but not always."""
    path = tmp_path_factory.mktemp("near-copy")
    options = dict(vocab_size=512, max_position_embeddings=1024, eos_token_id=None)
    save_tiny_hf_model(path, "qwen3", weight_std=0.06, tie_word_embeddings=True, **options)
    return path


@pytest.mark.parametrize(
    "options",
    [{}, {"kv_cache_bytes": 16 * 4096, "block_size": 4, "max_num_batched_tokens": 16}],
    ids=["batched", "chunked+preempted"],
)
def test_greedy_tokens_are_the_same_with_another_model_drafting(tiny_models, near_copy, options):
    target, _ = tiny_models["qwen3"]
    draft = near_copy
    requests = repetitive_requests()
    off = run(make_engine(target, speculation="off", **options), requests)
    engine = speculating(target, speculation=f"draft:{draft}", **options)
    assert run(engine, requests) == off
    drafted, accepted = spec_stats(engine)
    assert 0 < accepted < drafted  # both outcomes happened, so rollbacks did too
    assert engine.pool.num_used == 0
    proposer = engine.speculator.proposers[0]
    assert proposer.pool.num_used == 0 and not proposer._shadows


def test_seeded_sampling_with_a_draft_sharing_the_noise_is_accepted_almost_always(tiny_models):
    """The target drafting for itself with the same position-keyed noise picks the very
    tokens verification picks: what the coupling promises when the models agree."""
    target, _ = tiny_models["qwen2"]
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=40, ignore_eos=True)
    requests = {"s": ([5, 6, 7, 8, 9], params)}
    off = run(make_engine(target, speculation="off"), requests)
    engine = make_engine(target, speculation=f"draft:{target}")
    assert run(engine, requests) == off
    drafted, accepted = spec_stats(engine)
    assert drafted > 10 and accepted >= 0.9 * drafted


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    from tests.tiny_models import save_tiny_hf_model

    save_tiny_hf_model(tmp_path, "llama", vocab_size=100)
    with pytest.raises(ValueError, match="tokenizer"):
        make_engine(tiny_models["qwen3"][0], speculation=f"draft:{tmp_path}")

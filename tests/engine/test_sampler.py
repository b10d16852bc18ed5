"""The sampler against transformers' logits processors and against the laws it must keep."""

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kamado.engine.sampler import Sampler, SampleRow, filtered_probs
from kamado.engine.sampling_params import SamplingParams


def logits_row(vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def hf_kept(warper, logits: torch.Tensor) -> set[int]:
    out = warper(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]
    return set(torch.nonzero(out > float("-inf")).flatten().tolist())


def test_top_k_top_p_min_p_keep_the_same_tokens_as_transformers():
    for seed in range(20):
        logits = logits_row(seed=seed)
        for k in (1, 5, 20):
            ours = filtered_probs(logits, SamplingParams(top_k=k))
            assert kept(ours) == hf_kept(TopKLogitsWarper(k), logits)
        for top_p in (0.3, 0.8, 0.95):
            ours = filtered_probs(logits, SamplingParams(top_p=top_p))
            assert kept(ours) == hf_kept(TopPLogitsWarper(top_p), logits)
        for min_p in (0.05, 0.2):
            ours = filtered_probs(logits, SamplingParams(min_p=min_p))
            assert kept(ours) == hf_kept(MinPLogitsWarper(min_p), logits)


def test_repetition_penalty_matches_transformers():
    logits = logits_row()
    history = [3, 7, 7, 11, 42]
    params = SamplingParams(repetition_penalty=1.3, temperature=0)
    ours = Sampler()._adjust_logits(logits[None].clone(), [SampleRow(params, history, 2, 0)])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits[None].clone())
    torch.testing.assert_close(ours, ref)


def test_logit_bias_matches_transformers_sequence_bias():
    logits = logits_row()
    bias = {3: -100.0, 7: 2.5, 49: 0.5}
    params = SamplingParams(logit_bias=bias, presence_penalty=0.5)
    row = SampleRow(params, [1, 2, 7], num_prompt_tokens=2, index=0)
    ours = Sampler()._adjust_logits(logits[None].clone(), [row])
    ref = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(
        torch.tensor([row.token_ids]), logits[None].clone()
    )
    ref[0, 7] -= 0.5  # the presence penalty on the one output token, applied beside it
    torch.testing.assert_close(ours, ref)


def test_logit_bias_moves_the_pick_and_leaves_logprobs_raw():
    logits = logits_row()
    top = int(logits.argmax())
    banned = SamplingParams(temperature=0, logprobs=1, logit_bias={top: -100})
    rows = [SampleRow(SamplingParams(temperature=0, logprobs=1), [0], 1, 0)]
    rows.append(SampleRow(banned, [0], 1, 0))
    tokens, logprobs = Sampler()(torch.stack([logits, logits]), rows)
    assert tokens[0] == top and tokens[1] == int(logits.topk(2).indices[1])
    raw = torch.log_softmax(logits, -1)
    assert logprobs[1].logprob == pytest.approx(float(raw[tokens[1]]))
    assert logprobs[1].top[0][0] == top  # the banned token is still the model's likeliest


def test_logit_bias_is_validated():
    for bias, words in [({1: 101.0}, "between -100 and 100"), ({-1: 1.0}, "token ids")]:
        with pytest.raises(ValueError, match=words):
            SamplingParams(logit_bias=bias)
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(logit_bias=dict.fromkeys(range(2000), 1.0))


def test_presence_and_frequency_penalties_count_only_output_tokens():
    logits = torch.zeros(1, 10)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = SampleRow(params, [4, 4, 1, 1, 1, 2], num_prompt_tokens=2, index=0)
    out = Sampler()._adjust_logits(logits, [row])[0]
    assert out[4] == 0  # only in the prompt
    assert out[1] == -(0.5 + 3 * 0.25)
    assert out[2] == -(0.5 + 0.25)


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, seed=1234)
    sampler = Sampler()
    counts = torch.zeros(4)
    draws = 4000
    for position in range(draws):
        row = SampleRow(params, [0] + [1] * position, 1, 0)
        token, _ = sampler(logits[None], [row])
        again, _ = Sampler(seed=99)(logits[None], [row])
        assert token == again  # the seed, not the engine's generator, decides
        counts[token[0]] += 1
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05]) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom


def test_logprobs_are_of_the_raw_distribution_with_top_alternatives():
    logits = logits_row()
    params = SamplingParams(temperature=0.0, logprobs=3)
    tokens, logprobs = Sampler()(logits[None], [SampleRow(params, [1], 1, 0)])
    reference = torch.log_softmax(logits, -1)
    entry = logprobs[0]
    assert entry.token_id == tokens[0] == int(torch.argmax(logits))
    assert abs(entry.logprob - float(reference[tokens[0]])) < 1e-6
    assert [t for t, _ in entry.top] == torch.topk(reference, 3).indices.tolist()


def test_top_logprobs_leave_out_tokens_a_grammar_forbids():
    logits = logits_row()
    allowed = [4, 17]
    masked = torch.full_like(logits, float("-inf"))
    masked[allowed] = logits[allowed]  # as Guides' mask leaves a row
    params = SamplingParams(temperature=0.7, seed=3, logprobs=5)
    tokens, logprobs = Sampler()(masked[None], [SampleRow(params, [1], 1, 0)])
    entry = logprobs[0]
    assert tokens[0] in allowed
    assert sorted(t for t, _ in entry.top) == allowed
    assert all(v > float("-inf") for _, v in entry.top)
    assert abs(sum(torch.tensor([v for _, v in entry.top]).exp()) - 1) < 1e-5

"""Sampled requests keep their exact output distribution under speculation.

A small-vocabulary model samples three tokens many times while every step verifies a
draft; the counts of each 3-token outcome are tested (chi-square) against the exact
distribution computed with transformers, and against sampling with speculation off.
"""

import itertools
import math
from collections import Counter

import pytest
import torch

from kamado.engine.sampling_params import SamplingParams
from tests.engine.conftest import make_engine
from tests.tiny_models import save_tiny_hf_model

VOCAB = 4
PROMPT = [3, 0, 2, 1, 1]
TOKENS = 3
SAMPLES = 1024
N = 16  # choices per request: exercises forks too


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab4")
    model = save_tiny_hf_model(path, "qwen2", weight_std=0.25, vocab_size=VOCAB, eos_token_id=None)
    return path, model


class RepeatLast:
    """A point-mass draft (a fixed function of the context): the last token again."""

    name = "repeat"

    def propose(self, seq, k):
        return [seq.token_ids[-1]] * k

    def finish(self, seq):
        pass


def speculating_engine(path):
    engine = make_engine(path, speculation="ngram", spec_max_draft=2)
    engine.speculator.proposers = [RepeatLast()]
    # Verify every draft whatever the measured costs: the test is about what verification
    # emits, not about when it pays.
    controller = engine.speculator.controller
    controller.useful_length = lambda rate, batch: controller.max_draft
    controller.draft_lengths = lambda batch, cands: [len(c.draft) if c else 0 for c in cands]
    return engine


def sample_outcomes(engine, params: SamplingParams) -> Counter:
    for i in range(SAMPLES // N):
        engine.add_request(f"s{i}", PROMPT, params)
    outs: dict[tuple[str, int], list[int]] = {}
    while engine.has_work():
        for d in engine.step():
            outs.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
    assert all(len(o) == TOKENS for o in outs.values()) and len(outs) == SAMPLES
    return Counter(tuple(o) for o in outs.values())


def exact_distribution(model, temperature: float) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) by the chain rule over transformers' logits."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(TOKENS):
        prefixes = list(probs)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        step = torch.softmax(logits.double() / temperature, dim=-1)
        probs = {
            p + (t,): probs[p] * float(step[i, t])
            for i, p in enumerate(prefixes)
            for t in range(VOCAB)
        }
    return probs


def chi_square_p(observed: list[float], expected: list[float]) -> float:
    """Upper-tail p-value of Pearson's statistic (Wilson-Hilferty normal approximation),
    cells with small expectations pooled so the approximation holds."""
    pooled_o, pooled_e, rest_o, rest_e = [], [], 0.0, 0.0
    for o, e in zip(observed, expected, strict=True):
        if e >= 5:
            pooled_o.append(o)
            pooled_e.append(e)
        else:
            rest_o += o
            rest_e += e
    if rest_e > 0:
        pooled_o.append(rest_o)
        pooled_e.append(rest_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(pooled_o, pooled_e, strict=True))
    df = len(pooled_e) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def homogeneity_p(a: Counter, b: Counter) -> float:
    """Two samples of equal size from one distribution: a - b has expectation 0 per cell."""
    cells = sorted(set(a) | set(b))
    total = [a[c] + b[c] for c in cells]
    return chi_square_p([a[c] for c in cells], [t / 2 for t in total])


def test_sampling_with_speculation_matches_the_exact_distribution(small_vocab_model):
    path, model = small_vocab_model
    engine = speculating_engine(path)
    counts = sample_outcomes(engine, SamplingParams(n=N, temperature=1.0, max_tokens=TOKENS))
    s = engine.snapshot()
    assert s.spec_verified_drafts["repeat"] >= SAMPLES // 2  # most sequences verified a draft
    assert 0 < s.spec_accepted_tokens["repeat"] < s.spec_drafted_tokens["repeat"]
    outcomes = list(itertools.product(range(VOCAB), repeat=TOKENS))
    exact = exact_distribution(model, 1.0)
    observed = [counts[o] for o in outcomes]
    assert chi_square_p(observed, [exact[o] * SAMPLES for o in outcomes]) > 1e-3
    # The test has power: the same counts are far from a slightly different distribution.
    hotter = exact_distribution(model, 1.3)
    assert chi_square_p(observed, [hotter[o] * SAMPLES for o in outcomes]) < 1e-6


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.8, top_p=0.85, frequency_penalty=1.5, presence_penalty=0.5),
        dict(temperature=1.2, top_k=3, min_p=0.05, repetition_penalty=1.3),
        dict(temperature=1.0, logit_bias={1: 2.0, 2: -1.5}),
    ],
    ids=["top_p+penalties", "top_k+min_p+repetition", "logit_bias"],
)
def test_filtered_and_penalized_sampling_is_unchanged_by_speculation(small_vocab_model, params):
    path, _ = small_vocab_model
    p = SamplingParams(n=N, max_tokens=TOKENS, **params)
    on = sample_outcomes(speculating_engine(path), p)
    off = sample_outcomes(make_engine(path, speculation="off"), p)
    assert homogeneity_p(on, off) > 1e-3


def test_seeded_sampling_is_token_identical_with_speculation(small_vocab_model):
    path, _ = small_vocab_model
    p = SamplingParams(n=N, temperature=1.0, seed=1234, max_tokens=TOKENS, logprobs=2)
    engines = {"on": speculating_engine(path), "off": make_engine(path, speculation="off")}
    results = {}
    for name, engine in engines.items():
        engine.add_request("r", PROMPT, p)
        out: dict[int, tuple[list, list]] = {}
        while engine.has_work():
            for d in engine.step():
                tokens, logprobs = out.setdefault(d.index, ([], []))
                tokens.extend(d.new_token_ids)
                logprobs.extend((lp.token_id, round(lp.logprob, 4)) for lp in d.logprobs)
        results[name] = out
    assert results["on"] == results["off"]
    assert engines["on"].snapshot().spec_accepted_tokens["repeat"] > 0

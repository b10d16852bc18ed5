"""A request continued on a fresh engine from the tokens it had (the server does this after
an engine restart) goes on exactly as if nothing had happened."""

import pytest

from kamado.engine.core import RequestError
from kamado.engine.sampling_params import SamplingParams
from tests.engine.conftest import greedy, make_engine, run

PROMPT = [5, 77, 301, 12, 9, 240, 33]


@pytest.mark.parametrize(
    "params",
    [
        greedy(24),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, n=3),
        # Penalties count generated tokens only: the continuation must know which they are.
        SamplingParams(
            temperature=0.7, seed=5, max_tokens=24, frequency_penalty=1.5, presence_penalty=1.0
        ),
    ],
    ids=["greedy", "seeded-n3", "penalized"],
)
def test_continued_choices_finish_as_the_uninterrupted_ones(tiny_models, params):
    path, _ = tiny_models["llama"]
    whole = run(make_engine(path), {"r": (PROMPT, params)})["r"]
    # The old engine died when choice i had `cut[i]` tokens; choice 1 had finished already.
    cut = {0: 9, 2: 1} if params.n == 3 else {0: 9}
    engine = make_engine(path)
    engine.add_request("r", PROMPT, params, continue_from={i: whole[i][:k] for i, k in cut.items()})
    rest = {}
    while engine.has_work():
        for d in engine.step():
            rest.setdefault(d.index, []).extend(d.new_token_ids)
            assert d.num_prompt_tokens == len(PROMPT)
    assert rest == {i: whole[i][k:] for i, k in cut.items()}
    assert engine.pool.num_used == 0


def test_a_continuation_that_cannot_continue_is_refused(tiny_models):
    engine = make_engine(tiny_models["llama"][0])
    params = greedy(4)
    for bad in ({1: [3]}, {0: [3, 4, 5, 6]}, {0: [10**6]}):
        with pytest.raises(RequestError):
            engine.add_request("r", PROMPT, params, continue_from=bad)
    assert not engine.has_work()

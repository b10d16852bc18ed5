"""A decode step launched ahead is planned before its sequences' newest tokens are in:
only where the speculator would plan no draft whatever they are. It counts as planned,
and the proposers are asked once the tokens are in, as a step planned from them would."""

import random

from kamado.engine.sampling_params import SamplingParams
from kamado.engine.sequence import Sequence
from kamado.spec.ngram import NgramProposer
from kamado.spec.speculator import PROBE_EVERY, Speculator
from tests.spec.test_controller import controller_with_cost


def speculator(fixed: float, per_token: float, verify_extra: float) -> Speculator:
    spec = Speculator([NgramProposer()], max_draft=8, max_model_len=1000)
    spec.controller = controller_with_cost(fixed, per_token, verify_extra)
    return spec


def sequence() -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    return Sequence("r", 0, [5, 6, 7, 5, 6, 7, 5, 6], params, 0)  # the n-gram proposer has drafts


def step_both_ways(
    always: Speculator, ahead: Speculator, steps: int, hits: bool = True
) -> tuple[list[bool], int]:
    """Plan each step of one sequence from its tokens in `always` and, where it can be,
    ahead of them in `ahead`; both must ask the proposers the same and count alike.
    Returns which steps went ahead, and how many asked for drafts."""
    seq_a, seq_b = sequence(), sequence()
    planned_ahead, asked = [], 0
    noise = random.Random(0)
    for step in range(steps):
        always.plan([seq_a])
        blind = ahead.plan_none([seq_b])
        if blind:
            ahead.propose_late(seq_b)  # the step's input token is in
        else:
            ahead.plan([seq_b])
        planned_ahead.append(blind)
        state_a, state_b = always._seqs[seq_a], ahead._seqs[seq_b]
        assert (state_b.idle, state_b.drafts) == (state_a.idle, state_a.drafts), step
        asked += bool(state_b.drafts)
        # The n-gram drafts are right (or mostly wrong): both score the same.
        token = 5 + (step % 3) if hits else noise.choice([5, 6, 7])
        for spec, seq in ((always, seq_a), (ahead, seq_b)):
            seq.token_ids.append(token)
            spec.observe(seq, [token], 0)
    return planned_ahead, asked


def test_every_step_goes_ahead_where_verification_never_pays():
    # Verification costs ten plain steps: drafts are asked for, scored, never verified.
    planned, asked = step_both_ways(speculator(0.02, 0.001, 0.2), speculator(0.02, 0.001, 0.2), 12)
    assert all(planned) and asked >= 10


def test_probes_of_idle_proposers_are_asked_late_too():
    # A token costs as much as the step's fixed part and drafts mostly miss: soon none is
    # worth asking for, but every PROBE_EVERY-th step a one-token probe measures them.
    always, ahead = speculator(0.02, 0.02, 0.0), speculator(0.02, 0.02, 0.0)
    planned, asked = step_both_ways(always, ahead, 6 * PROBE_EVERY, hits=False)
    # The first step, at the prior rate, may verify a draft: it waits for its tokens.
    assert all(planned[1:]) and 3 <= asked <= 8  # probes, asked late and scored


def test_no_step_is_planned_ahead_where_drafts_pay():
    spec, seq = speculator(0.02, 0.001, 0.0), sequence()  # verification costs its tokens
    assert not spec.plan_none([seq])
    assert spec.plan([seq])[0]  # the step planned from the tokens drafts

"""A decode step launched ahead is planned without its sequences' newest tokens: only
where the speculator would plan no draft whatever they are, and it counts as planned."""

from kamado.engine.sampling_params import SamplingParams
from kamado.engine.sequence import Sequence
from kamado.spec.ngram import NgramProposer
from kamado.spec.speculator import PROBE_EVERY, Speculator
from tests.spec.test_controller import controller_with_cost


def speculator(verify_extra: float) -> Speculator:
    spec = Speculator([NgramProposer()], max_draft=8, max_model_len=1000)
    spec.controller = controller_with_cost(fixed=0.02, per_token=0.001, extra=verify_extra)
    return spec


def sequence() -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    return Sequence("r", 0, [5, 6, 7, 5, 6, 7, 5, 6], params, 0)  # the n-gram proposer has drafts


def test_steps_planned_ahead_keep_the_probe_schedule_of_steps_planned_from_tokens():
    # Verification costs ten plain steps: no draft is worth it, but a probe now and then.
    always, ahead = speculator(0.2), speculator(0.2)
    seq_a, seq_b = sequence(), sequence()
    planned_ahead = []
    for _ in range(3 * PROBE_EVERY):
        always.plan([seq_a])
        quiet = ahead.plan_none([seq_b])
        if not quiet:
            ahead.plan([seq_b])  # the step waits for the tokens and is planned from them
        planned_ahead.append(quiet)
        assert ahead._seqs[seq_b].idle == always._seqs[seq_a].idle
    assert planned_ahead == ([True] * (PROBE_EVERY - 1) + [False]) * 3


def test_no_step_is_planned_ahead_where_drafts_pay():
    spec, seq = speculator(0.0), sequence()  # verification costs what its tokens do
    assert not spec.plan_none([seq])
    assert spec.plan([seq])[0]  # the step planned from the tokens drafts

"""The adaptive controller: draft length follows acceptance and shrinks as the batch grows."""

import random

from kamado.spec.controller import Candidate, Controller, Rate, SeqRates, StepCost


def controller_with_cost(fixed: float, per_token: float, extra: float = 0.0) -> Controller:
    """Step times measured on a machine where plain steps cost fixed + per_token * tokens
    and verification steps `extra` more."""
    c = Controller(max_draft=16)
    for batch in (1, 2, 4, 8, 16, 32) * 3:
        c.cost.observe(batch, 0, fixed + per_token * batch)
        c.cost.observe(2 * batch, batch, fixed + per_token * 2 * batch + extra)
    return c


def test_draft_length_grows_with_acceptance():
    c = controller_with_cost(fixed=0.02, per_token=0.001)
    draft = list(range(16))
    lengths = [c.draft_lengths(1, [Candidate(draft, r, "x")])[0] for r in (0.1, 0.5, 0.9, 0.99)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    assert lengths[-1] == 16


def test_speculation_shrinks_and_turns_off_as_the_batch_grows():
    c = controller_with_cost(fixed=0.02, per_token=0.001)
    totals = []
    for batch in (1, 4, 16, 64, 256):
        candidates = [Candidate(list(range(8)), 0.7, "x")] * batch
        totals.append(sum(c.draft_lengths(batch, candidates)) / batch)
    assert totals == sorted(totals, reverse=True)
    assert totals[0] >= 3 and totals[-1] == 0


def test_no_speculation_where_a_token_costs_as_much_as_the_step():
    c = controller_with_cost(fixed=0.0001, per_token=0.01)  # compute-bound: no free tokens
    assert c.draft_lengths(1, [Candidate(list(range(8)), 0.6, "x")]) == [0]


def test_a_costly_verification_path_needs_long_accepted_drafts():
    # GPU-like: plain steps replay a graph, a verification step costs 2.2x one at any k.
    c = controller_with_cost(fixed=0.0055, per_token=0.00002, extra=0.012)
    cost = c.cost.model()
    assert abs(cost.extra - 0.012) < 1e-4 and abs(cost.fixed - 0.0055) < 1e-4
    draft = list(range(16))
    assert c.draft_lengths(1, [Candidate(draft, 0.6, "x")]) == [0]  # ~1.5 tokens: no gain
    assert c.draft_lengths(1, [Candidate(draft, 0.95, "x")]) == [16]


def test_the_better_accepted_sequence_gets_the_longer_draft():
    c = controller_with_cost(fixed=0.02, per_token=0.002)
    good, poor = Candidate(list(range(8)), 0.95, "x"), Candidate(list(range(8)), 0.4, "x")
    lengths = c.draft_lengths(8, [good, poor, None] + [None] * 5)
    assert lengths[0] > lengths[1] and lengths[2] == 0


def test_acceptance_is_scored_against_what_the_step_emitted():
    c = Controller(max_draft=8)
    rates = SeqRates()
    for _ in range(20):
        c.observe(rates, "good", [1, 2, 3, 4], [1, 2, 3, 4, 5])  # all accepted, no miss seen
        c.observe(rates, "poor", [1, 9, 9, 9], [1, 2, 3, 4, 5])  # one accepted, then a miss
    assert c.rate(rates, "good") > 0.95
    assert 0.4 < c.rate(rates, "poor") < 0.6
    # A draft judged only on the one token a step emitted without verification counts too.
    c.observe(rates, "late", [7, 7], [8])
    assert rates.by_proposer["late"].tried == 1 and rates.by_proposer["late"].accepted == 0


def test_rate_counts_decay_so_recent_steps_weigh_most():
    r = Rate()
    for _ in range(30):
        r.add(0, True, 0.8)
    for _ in range(10):
        r.add(4, False, 0.8)
    assert r.estimate(0.5, 2.0) > 0.75


def test_step_cost_fit_ignores_steps_slowed_by_something_else():
    cost = StepCost()
    rng = random.Random(0)
    for i in range(64):
        tokens = 1 + i % 8
        seconds = 0.05 + 0.004 * tokens
        if rng.random() < 0.15:
            seconds *= 10  # another process took the CPU for this step
        cost.observe(tokens, 0, seconds)
    model = cost.model()
    assert abs(model.fixed - 0.05) < 0.005 and abs(model.per_token - 0.004) < 0.001

"""Draft proposers: where their drafts come from, and when they stay quiet."""

from kamado.engine.sampling_params import SamplingParams
from kamado.engine.sequence import Sequence
from kamado.spec.ngram import NgramProposer
from kamado.spec.proposer import copy_forward
from kamado.spec.suffix import ALPHA, OutputStore, SuffixProposer


def seq(tokens: list[int], prompt_len: int | None = None, session: str | None = None) -> Sequence:
    n = len(tokens) if prompt_len is None else prompt_len
    s = Sequence("r", 0, tokens[:n], SamplingParams(), 0)
    s.token_ids = list(tokens)
    s.session = session
    return s


def test_copy_forward_continues_a_repeating_pattern_past_the_end():
    assert copy_forward([1, 2, 3, 1, 2, 3], 3, 2) == [1, 2]
    assert copy_forward([7, 1, 2, 1, 2], 3, 5) == [1, 2, 1, 2, 1]
    assert copy_forward([1, 2], 2, 3) == []


def test_ngram_drafts_what_followed_the_latest_occurrence():
    # "5 6 7" occurs twice; the later occurrence was followed by 9 9, the earlier by 8 8.
    s = seq([5, 6, 7, 8, 8, 1, 5, 6, 7, 9, 9, 2, 3, 6, 7])
    assert NgramProposer().propose(s, 2) == [9, 9]


def test_ngram_keeps_its_index_current_as_tokens_arrive():
    proposer = NgramProposer(sizes=(2,))
    s = seq([1, 2, 3, 4])
    assert proposer.propose(s, 3) == []  # no 2-gram repeats yet
    s.token_ids += [1, 2]
    assert proposer.propose(s, 3) == [3, 4, 1]
    s.token_ids += [3, 4, 5, 3, 4]
    assert proposer.propose(s, 3) == [5, 3, 4]  # the latest "3 4" is one it indexed later
    proposer.finish(s)
    assert not proposer._indexes


def test_ngram_stays_quiet_without_a_match():
    assert NgramProposer().propose(seq(list(range(50))), 4) == []


def test_suffix_drafts_from_the_longest_match_and_longer_where_it_is_longer():
    proposer = SuffixProposer()
    body = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    short = seq(body + [1, 12, 13])  # matches "12 13": at most ALPHA * 2 tokens
    assert proposer.propose(short, 8) == [14, 15, 16, 17][: int(ALPHA * 2)]
    long = seq(body + [1, 10, 11, 12, 13])
    assert proposer.propose(long, 8) == [14, 15, 16, 17, 18, 19, 1, 10]


def test_suffix_drafts_from_a_session_s_earlier_output_and_from_other_requests():
    proposer = SuffixProposer()
    earlier = seq([1, 2, 3, 40, 41, 42, 43, 44, 45], prompt_len=3, session="agent-a")
    proposer.finish(earlier)  # its output joins the session's and the global store
    assert proposer.propose(seq([7, 8, 40, 41, 42], session="agent-a"), 3) == [43, 44, 45]
    assert proposer.propose(seq([9, 40, 41, 42, 43], session="agent-b"), 3) == [44, 45]
    # A match never runs into the next output: outputs are kept apart in the stores.
    proposer.finish(seq([1, 50, 51], prompt_len=1))
    assert proposer.propose(seq([0, 44, 45]), 3) == []


def test_an_output_store_keeps_its_newest_outputs_within_its_capacity():
    store = OutputStore(capacity=20)
    for i in range(6):
        store.add([100 + i] * 5)
    assert sum(len(o) + 1 for o in store.outputs) <= 20
    assert store.outputs[-1] == [105] * 5
    assert len(store.automaton.tokens) <= 20
    assert store.generation > 0


def test_a_long_context_is_indexed_over_several_calls(monkeypatch):
    import kamado.spec.ngram as ngram
    import kamado.spec.suffix as suffix

    monkeypatch.setattr(ngram, "INDEX_PER_CALL", 8)
    monkeypatch.setattr(suffix, "EXTEND_PER_CALL", 8)
    tokens = [*range(100, 120), 1, 2, 3, *range(120, 130), 1, 2]
    s = seq(tokens)
    ngrams, suffixes = ngram.NgramProposer(sizes=(2,)), suffix.SuffixProposer()
    assert ngrams.propose(s, 2) == [] and suffixes.propose(s, 2) == []  # not indexed yet
    for _ in range(4):
        ngrams.propose(s, 2)
        suffixes.propose(s, 2)
    assert ngrams.propose(s, 2) == [3, 120] and suffixes.propose(s, 2) == [3, 120]

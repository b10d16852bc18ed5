"""The suffix automaton finds exactly the matches a brute-force scan finds."""

import random

from kamado.spec.suffix_automaton import Matcher, SuffixAutomaton


def brute_longest_repeat(tokens: list[int]) -> int:
    """Length of the longest suffix that also ends at an earlier position."""
    best = 0
    for n in range(1, len(tokens)):
        suffix = tokens[-n:]
        if any(tokens[e - n + 1 : e + 1] == suffix for e in range(n - 1, len(tokens) - 1)):
            best = n
    return best


def occurs_ending_at(text: list[int], pattern: list[int], end: int) -> bool:
    return end - len(pattern) + 1 >= 0 and text[end - len(pattern) + 1 : end + 1] == pattern


def test_longest_repeat_matches_a_brute_force_scan():
    rng = random.Random(0)
    for _ in range(30):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 60))]
        sam = SuffixAutomaton()
        for i, t in enumerate(tokens):
            sam.extend(t)
            length, end = sam.longest_repeat()
            prefix = tokens[: i + 1]
            assert length == brute_longest_repeat(prefix)
            if length:
                assert end < i and occurs_ending_at(prefix, prefix[-length:], end)


def test_matcher_finds_the_longest_suffix_of_another_stream():
    rng = random.Random(1)
    text = [rng.randrange(4) for _ in range(200)]
    sam = SuffixAutomaton()
    for t in text:
        sam.extend(t)
    stream = text[50:90] + [rng.randrange(4) for _ in range(30)]
    matcher = Matcher(sam)
    for i, t in enumerate(stream):
        matcher.feed(t)
        seen = stream[: i + 1]
        expected = max(
            (n for n in range(len(seen) + 1) if any(
                text[s : s + n] == seen[len(seen) - n :] for s in range(len(text) - n + 1)
            )),
            default=0,
        )  # fmt: skip
        length, end = matcher.match()
        assert length == expected
        if length:
            assert occurs_ending_at(text, seen[-length:], end)

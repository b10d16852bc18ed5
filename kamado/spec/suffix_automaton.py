"""A suffix automaton over a token stream: every substring seen so far, found in O(length)
and extended in amortized O(1) per appended token.

Each state is a class of substrings with the same set of end positions; `end` keeps the
first of them, which is where a draft continues reading. `Matcher` walks another stream
through the automaton, keeping the longest suffix of that stream that occurs in this one.
"""

from __future__ import annotations


class SuffixAutomaton:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.end = [-1]  # index of the last token of the state's first occurrence
        self.last = 0

    def _new_state(self, length: int, end: int, nxt: dict[int, int], link: int) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.end.append(end)
        return len(self.length) - 1

    def extend(self, token: int) -> None:
        pos = len(self.tokens)
        self.tokens.append(token)
        nxt, link, length = self.next, self.link, self.length
        cur = self._new_state(length[self.last] + 1, pos, {}, 0)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._new_state(length[p] + 1, self.end[q], dict(nxt[q]), link[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def longest_repeat(self) -> tuple[int, int]:
        """(length, end) of the longest suffix of the stream that also occurred earlier,
        `end` being the index of that earlier occurrence's last token."""
        state = self.link[self.last]
        return (self.length[state], self.end[state]) if state > 0 else (0, -1)


class Matcher:
    """The longest suffix of a stream fed token by token that occurs in an automaton."""

    def __init__(self, automaton: SuffixAutomaton) -> None:
        self.automaton = automaton
        self.state = 0
        self.length = 0

    def feed(self, token: int) -> None:
        a = self.automaton
        while self.state and token not in a.next[self.state]:
            self.state = a.link[self.state]
            self.length = a.length[self.state]
        if (nxt := a.next[self.state].get(token)) is not None:
            self.state = nxt
            self.length += 1
        else:
            self.length = 0

    def match(self) -> tuple[int, int]:
        """(length, end) of the match: `end` indexes its last token in the automaton."""
        return (self.length, self.automaton.end[self.state]) if self.length else (0, -1)

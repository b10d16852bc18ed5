"""The fixed prompts and text `kamado surgery check` measures with (written for kamado):
code and prose of the kind a coding agent reads and writes."""

PROMPTS = [
    "def fibonacci(n):",
    "# A Python function that parses a CSV file and returns a list of dicts\n",
    "The capital of France is",
    "import json\n\ndata = {'a': 1, 'b': [1, 2, 3]}\n",
    "class Stack:\n    def __init__(self):\n",
    "SELECT name, COUNT(*) FROM orders",
    "To reverse a linked list in place, you",
    "#include <stdio.h>\n\nint main(void) {\n",
]

PERPLEXITY_TEXT = '''A small cache keeps the results of slow function calls so that a second call
with the same arguments returns at once. The cache below holds at most a fixed number of
entries and forgets the one used least recently when it is full.

from collections import OrderedDict


class LRUCache:
    """A mapping with a size limit that evicts the least recently used key."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.entries: OrderedDict[str, object] = OrderedDict()

    def get(self, key: str, default: object = None) -> object:
        if key not in self.entries:
            return default
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key: str, value: object) -> None:
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


Every read moves the key to the end of the ordered dictionary, so the first key is
always the one that has waited longest. Both operations take constant time. A test
should check that a full cache drops the oldest key, that reading a key protects it
from eviction, and that a capacity of zero is refused.

def test_full_cache_drops_the_oldest_key():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.get("a")
    cache.put("c", 3)
    assert cache.get("b") is None
    assert cache.get("a") == 1
    assert cache.get("c") == 3
'''

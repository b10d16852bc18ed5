"""Which cached block goes first: superseded branches, then idle sessions, deepest first."""

import random

from kamado.kv.block_hash import block_key, extend_keys
from kamado.kv.block_pool import BlockPool
from kamado.kv.eviction import COMPACT_BELOW, EvictionOrder
from tests.engine.conftest import greedy, make_engine


def test_keys_name_the_whole_prefix_not_just_the_block():
    keys_a, keys_b = [], []
    extend_keys(keys_a, [1, 2, 3, 4, 5, 6], 3, 2)
    extend_keys(keys_b, [9, 9, 3, 4, 5, 6], 3, 2)
    assert keys_a[1] != keys_b[1]  # same tokens, different history
    assert keys_a[1] == block_key(keys_a[0], [3, 4])


def drain(order: EvictionOrder) -> list[int]:
    return [order.pop() for _ in range(len(order))]


def test_idle_sessions_age_out_before_active_ones():
    order = EvictionOrder()
    order.touch("idle")
    order.touch("busy")
    for depth, block in enumerate([10, 11, 12]):
        order.add(block, "idle", depth)
    for depth, block in enumerate([20, 21]):
        order.add(block, "busy", depth)
    order.touch("busy")
    order.touch("idle")  # idle came back: now busy is the idler one
    order.touch("busy")
    # Within a session, the deepest block first: what stays is still a prefix.
    assert drain(order) == [12, 11, 10, 21, 20]


def test_a_superseded_branch_goes_before_the_newest_turn_of_any_session():
    order = EvictionOrder()
    for session, blocks in (("a", [1, 2, 3]), ("b", [4, 5])):
        order.touch(session)
        for depth, block in enumerate(blocks):
            order.add(block, session, depth)
    order.touch("a")
    order.supersede(3)
    assert drain(order) == [3, 5, 4, 2, 1]


def test_the_pool_hands_out_free_blocks_before_cached_ones():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.set_key(a, b"ka")
    pool.release(a, "s", 0)
    pool.release(b)
    assert pool.num_free == 4 and pool.num_cached == 1
    taken = {pool.allocate() for _ in range(3)}
    assert a not in taken and pool.lookup(b"ka") == a
    assert pool.allocate() == a and pool.lookup(b"ka") is None
    assert pool.num_evictions == 1


def test_an_agents_newest_turn_outlives_its_superseded_branch_and_idle_agents(tiny_models):
    path, _ = tiny_models["llama"]
    bs = 4
    engine = make_engine(path, block_size=bs, kv_cache_bytes=64 * 4096)
    stem, idle = list(range(100, 140)), list(range(300, 340))  # 10 blocks each
    old, new = stem + [1] * 16, stem + [2] * 16  # the agent rewinds: a new branch
    for request_id, prompt, session in (("old", old, "agent"), ("idle", idle, "other")):
        engine.add_request(request_id, prompt, greedy(1), session)
    while engine.has_work():
        engine.step()
    engine.add_request("new", new, greedy(1), "agent")
    while engine.has_work():
        engine.step()
    assert engine.pool.num_cached == 28  # stem, both branches, the idle agent
    # A stranger needs every free block and six cached ones.
    need = engine.num_blocks - engine.pool.num_cached + 6
    engine.add_request("big", [7 + i % 50 for i in range(need * bs)], greedy(1))
    while engine.has_work():
        engine.step()
    keys = {}
    for name, prompt in (("old", old), ("new", new), ("idle", idle)):
        keys[name] = []
        extend_keys(keys[name], prompt, len(prompt) // bs, bs)
    cached = [k for k in keys["new"] if engine.pool.lookup(k) is not None]
    assert len(cached) == 14  # the newest turn is whole
    assert all(engine.pool.lookup(k) is None for k in keys["old"][10:])  # superseded: gone
    idle_left = [engine.pool.lookup(k) is not None for k in keys["idle"]]
    assert idle_left == [True] * 8 + [False] * 2  # then the idle agent, from its tail


def test_releasing_a_chain_at_once_caches_and_orders_as_one_block_at_a_time():
    def pool_after(release) -> BlockPool:
        pool = BlockPool(16)
        for session in ("old", "new", None):
            chain = [pool.allocate() for _ in range(4)]
            for depth, block in enumerate(chain[:3]):  # the last block is not full: no key
                pool.set_key(block, f"{session}-{depth}".encode())
            pool.evictable.touch(session)
            release(pool, chain, session)
        return pool

    def one_at_a_time(pool: BlockPool, chain: list[int], session: str | None) -> None:
        for depth, block in enumerate(chain):
            pool.release(block, session, depth)

    def at_once(pool: BlockPool, chain: list[int], session: str | None) -> None:
        pool.release_chain(chain, session)

    expected, got = pool_after(one_at_a_time), pool_after(at_once)
    assert got.num_cached == expected.num_cached == 9
    assert got.num_free == expected.num_free == 16
    assert drain(got.evictable) == drain(expected.evictable)


def test_every_pop_takes_a_block_of_the_least_priority_as_blocks_come_and_go():
    # Random releases (chains and single blocks), reads, supersessions and session activity;
    # each pop is checked against every evictable block's priority, computed here from the
    # rule itself: superseded first, then the least recently active session, then deepest.
    rng = random.Random(7)
    order = EvictionOrder()
    sessions = ["a", "b", "c", None]
    for s in sessions[:3]:
        order.touch(s)
    active = {s: i + 1 for i, s in enumerate(sessions[:3])}
    info: dict[int, tuple[str | None, int, int]] = {}  # block -> (session, depth, tick)
    superseded: set[int] = set()
    clock, next_block = 3, 0

    def rank(block: int) -> tuple:
        session, depth, tick = info[block]
        return (0 if block in superseded else 1, active.get(session, tick), -depth)

    for _ in range(3000):
        op = rng.random()
        if op < 0.3:
            session = rng.choice(sessions)
            chain = [(next_block + i, i) for i in range(rng.randint(1, 40))]
            next_block += len(chain)
            order.add_chain(chain, session)
            for block, depth in chain:
                clock += 1
                info[block] = (session, depth, clock)
        elif op < 0.5 and info:
            block = rng.choice(sorted(info))
            order.remove(block)
            del info[block]
            superseded.discard(block)
        elif op < 0.6 and info:
            block = rng.choice(sorted(info))
            order.supersede(block)
            superseded.add(block)
        elif op < 0.7:
            session = rng.choice(sessions[:3])
            order.touch(session)
            clock += 1
            active[session] = clock
        elif info:
            block = order.pop()
            assert rank(block) == min(rank(b) for b in info)
            del info[block]
            superseded.discard(block)
        assert len(order) == len(info)


def test_a_released_turn_files_one_run_and_reads_leave_no_unbounded_entries():
    order = EvictionOrder()
    order.touch("agent")
    for turn in range(50):  # each turn reads the last one's blocks and releases them again
        chain = [(block, depth) for depth, block in enumerate(range(1000))]
        for block, _ in chain:
            if block in order:
                order.remove(block)
        order.add_chain(chain + [(1000 + turn, 1000)], "agent")
    assert len(order._runs) <= 2 * 50  # one heap entry a turn, not one a block
    pending = sum(len(run.blocks) - run.next for _, _, run in order._runs)
    assert pending <= COMPACT_BELOW * len(order) + 1000

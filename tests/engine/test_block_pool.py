"""The block pool: reference counts, contiguous runs, no leaks."""

import pytest

from kamado.kv.block_pool import BlockPool, OutOfBlocks


def grow(pool: BlockPool, table: list[int]) -> None:
    table.append(pool.allocate(after=table[-1] if table else None))


def is_run(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


def test_sequences_growing_side_by_side_each_keep_one_contiguous_run():
    pool = BlockPool(1000)
    tables: list[list[int]] = [[] for _ in range(8)]
    for table in tables:  # eight prompts admitted one after another
        for _ in range(16):
            grow(pool, table)
    for _ in range(40):  # then all decode in lockstep, a block each now and then
        for table in tables:
            grow(pool, table)
    assert all(is_run(t) for t in tables)
    assert len({b for t in tables for b in t}) == 8 * 56


def test_shared_blocks_return_only_when_every_reader_released_them():
    pool = BlockPool(4)
    block = pool.allocate()
    pool.share(block)
    pool.release(block)
    assert pool.num_free == 3
    pool.release(block)
    assert pool.num_free == 4


def test_running_out_raises_and_every_block_can_be_handed_out():
    pool = BlockPool(5)
    blocks = {pool.allocate() for _ in range(5)}
    assert blocks == set(range(5))
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    pool.release(3)
    assert pool.allocate(after=0) == 3  # 1 is taken; the only free block is found


def test_many_cycles_leave_the_pool_whole():
    pool = BlockPool(64)
    tables: list[list[int]] = []
    for round_ in range(300):
        table: list[int] = []
        for _ in range(round_ % 7 + 1):
            grow(pool, table)
        tables.append(table)
        if len(tables) > 5:
            for block in tables.pop(0):
                pool.release(block)
    for table in tables:
        for block in table:
            pool.release(block)
    assert pool.num_free == 64 and all(c == 0 for c in pool.ref_counts)

"""The block pool: reference counts, contiguous runs, no leaks."""

import pytest

from kamado.kv.block_pool import BlockPool, OutOfBlocks


def test_growing_sequences_get_contiguous_runs_when_free():
    pool = BlockPool(16)
    a = [pool.allocate()]
    b = [pool.allocate()]
    for _ in range(3):
        a.append(pool.allocate(after=a[-1]))
    assert b == [1]
    assert a == [0, 2, 3, 4]  # block 1 was taken, so the run continues after it
    assert pool.num_free == 11


def test_shared_blocks_return_only_when_every_reader_released_them():
    pool = BlockPool(4)
    block = pool.allocate()
    pool.share(block)
    pool.release(block)
    assert pool.num_free == 3
    pool.release(block)
    assert pool.num_free == 4


def test_running_out_raises_and_released_blocks_are_reused_lowest_first():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    pool.release(blocks[2])
    pool.release(blocks[0])
    assert pool.allocate() == 0
    assert pool.allocate() == 2


def test_many_cycles_keep_the_free_list_exact():
    pool = BlockPool(8)
    for round_ in range(200):
        taken = [pool.allocate(after=(round_ % 8) - 1) for _ in range(5)]
        assert len(set(taken)) == 5
        for block in taken:
            pool.release(block)
    assert pool.num_free == 8 and len(pool._heap) <= 16

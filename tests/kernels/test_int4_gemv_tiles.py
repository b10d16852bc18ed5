"""Which one-row int4 GEMV tiles the autotuner may choose among, by the matrix's rows."""

from __future__ import annotations

from kamado.surgery import triton_matmul as tm


def tiles(weight_rows: int, group: int = 128) -> list[tuple[int, int, int]]:
    configs = tm.int4_gemv_configs(tm._INT4_GEMV_CONFIGS, weight_rows, group, tm.HOPPER_SMS)
    return [(c.kwargs["BLOCK_N"], c.kwargs["GROUPS_PER_STEP"], c.num_warps) for c in configs]


def test_a_matrix_of_few_rows_gets_only_long_steps():
    # Qwen3-8B's QKV (6144 rows), o and down (4096): short steps leave DRAM idle there.
    for rows in (6144, 4096):
        assert tiles(rows) == [(4, 32, 4), (8, 16, 4), (8, 16, 2)]
        bytes_in_flight = rows * 16 * 64 / tm.HOPPER_SMS  # 16 groups of 64 bytes a row
        assert bytes_in_flight >= tm.INT4_GEMV_MIN_BYTES_IN_FLIGHT


def test_a_wide_matrix_may_take_any_tile():
    # The gated gate/up (24576 weight rows) and the output head: one-warp tiles win there.
    for rows in (24576, 151936):
        assert len(tiles(rows)) == len(tm._INT4_GEMV_CONFIGS)


def test_a_tiny_matrix_keeps_the_longest_steps_rather_than_none():
    assert tiles(256) == [(4, 32, 4)]
    # Groups of 32 make a step four times shorter in bytes: fewer tiles pass.
    assert len(tiles(24576, group=32)) < len(tiles(24576))

"""Which kernel serves how many input rows in triton_matmul, checked on the CPU: every
Triton launcher is replaced by a recorder, so the test sees the rows of each launch and
which input rows each one was given. Inputs of more than DOT_MAX_ROWS, up to TILED_MAX_ROWS,
must run as slices through the kernels that read the compressed weight, with their outputs
stacked back in order; wider inputs widen the weight (computed here for real on the CPU,
widen.py's kernels in Triton's interpreter)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")

from kamado.surgery import formats  # noqa: E402
from kamado.surgery import triton_matmul as tm  # noqa: E402

LAUNCHERS = [
    "_rowwise_tuned", "_scaled_dot_tuned",
    "_int4_dot_tuned", "_int4_gemv_tuned", "_int4_gemv_rows_tuned", "_int4_mma_tuned",
]  # fmt: skip
N, K, GROUP = 48, 256, 128
FORMATS = ["int8", "fp8", "int4"]


class Launches:
    """Stands for every tuned launcher, `launcher(rows)[grid](x, weight, scales, bias, out,
    ...)`: records each launch's (first input row, rows) and writes each output row as that
    input row's sum, so the order the slices are stacked in shows in the result."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.seen: list[tuple[int, int]] = []

    def tuned(self, rows: int) -> Launches:
        return self

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return self.launch

    def launch(self, x: torch.Tensor, *args: object, **kwargs: object) -> None:
        out = args[3]
        assert isinstance(out, torch.Tensor)
        row_bytes = self.x.stride(0) * self.x.element_size()
        self.seen.append(((x.data_ptr() - self.x.data_ptr()) // row_bytes, x.shape[0]))
        out.copy_(x.float().sum(1, keepdim=True).expand_as(out))


def matmul_of(fmt: str) -> tuple[Callable[..., torch.Tensor], tuple, torch.Tensor]:
    """(the format's matmul, its weight arguments, the float32 weight they stand for)."""
    w = torch.randn(N, K) * 0.02
    if fmt == "int8":
        q, scales = formats.quantize_int8(w)
        return tm.int8_matmul, (q, scales), formats.dequantize_int8(q, scales)
    if fmt == "fp8":
        q, scales = formats.quantize_fp8(w)
        return tm.fp8_matmul, (q, scales.view(-1, 1)), formats.dequantize_fp8(q, scales)
    q, scales, mins = formats.quantize_int4(w, GROUP)
    scale_mins = formats.pack_int4_scale_mins(scales, mins)
    on_card = formats.dequantize_int4(q, scale_mins[..., 0], scale_mins[..., 1])
    return tm.int4_matmul, (formats.pack_int4(q, GROUP), scale_mins), on_card


def recorded(
    monkeypatch, fmt: str, rows: int
) -> tuple[torch.Tensor, torch.Tensor, Launches, torch.Tensor]:
    matmul, weight, reference = matmul_of(fmt)
    x = torch.randn(rows, K, dtype=torch.bfloat16)
    launches = Launches(x)
    for name in LAUNCHERS:
        monkeypatch.setattr(tm, name, launches.tuned)
    return x, matmul(x, *weight, None), launches, reference


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_past_one_tile_run_as_slices_stacked_in_order(monkeypatch, fmt):
    x, out, launches, _ = recorded(monkeypatch, fmt, 24)
    assert launches.seen == [(0, 16), (16, 8)]
    assert torch.equal(out, x.float().sum(1, keepdim=True).expand(24, N).to(out.dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_sliced_range_ends_at_its_limit(monkeypatch, fmt):
    rows = tm.TILED_MAX_ROWS
    _, _, launches, _ = recorded(monkeypatch, fmt, rows)
    assert launches.seen == [(i, 16) for i in range(0, rows, 16)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_row_past_a_tile_is_a_slice_of_its_own(monkeypatch, fmt):
    _, _, launches, _ = recorded(monkeypatch, fmt, tm.DOT_MAX_ROWS + 1)
    assert launches.seen == [(0, 16), (16, 1)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_past_the_sliced_range_widen_the_weight_once(monkeypatch, interpreted_widen, fmt):
    rows = tm.TILED_MAX_ROWS + 1
    x, out, launches, reference = recorded(monkeypatch, fmt, rows)
    assert launches.seen == []  # widen.py's kernel, then cuBLAS's place: torch's CPU matmul
    expected = x.float() @ reference.T
    assert float((out.float() - expected).norm() / expected.norm()) < 1e-2  # bf16 rounding

"""The int8 matmul kernels of triton_matmul run by Triton's interpreter on the CPU, in every
configuration the autotuner may pick, against x @ W.T with W dequantized in float32:
- the tensor-core kernel of 3-16 input rows (_scaled_dot_kernel), with a scale per row, per
  group of 32 (GGUF's Q8_0) and per group of 128, split K too;
- the GEMV of 1-2 rows (_rowwise_kernel) with a scale per row, split K and step sums too,
  its gated form (silu(gate) * up), and with a scale per group of 32.
K is a multiple of no BLOCK_K, so last steps are masked.

The interpreter takes over only kernels defined after TRITON_INTERPRET=1 is set, so the
check runs in a child process: this file as a script. Inputs are float32, since the
interpreter widens int8 to bf16 wrongly (values near 1e11); so this covers the kernels'
indexing, scales, masks and split-K sums, and bf16 operands (the GPU's) are
tests/gpu/test_quantized_matmul.py's. fp8 has no numpy type, so it is the GPU tests' alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

# case: (kernel, K, scale groups a row, input rows, gated)
CASES = {
    "tile-row": ("dot", 3000, 1, 3, False),
    "tile-group-32": ("dot", 3008, 94, 3, False),
    "tile-group-128": ("dot", 1024, 8, 3, False),
    "gemv-row": ("gemv", 3000, 1, 2, False),
    "gemv-row-gated": ("gemv", 3000, 1, 1, True),
    "gemv-group-32": ("gemv", 3008, 94, 2, False),
}
N = 200  # outputs: a part tile for every BLOCK_N


@pytest.mark.parametrize("case", list(CASES))
def test_every_configuration_matches_its_dequantized_weight(case):
    child = subprocess.run(
        [sys.executable, __file__, case],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout + child.stderr[-4000:]
    assert child.stdout.count("\n") == len(_configs(case)), child.stdout


def _configs(case: str) -> list:
    from kamado.surgery import triton_matmul as tm

    kernel, k, groups, _, gated = CASES[case]
    # those its autotuner keeps
    if kernel == "dot":
        return tm._split_fits(tm._SCALED_DOT_CONFIGS, {"N": N}, GATED=gated)
    return tm._gemv_fits(tm._CONFIGS, {"N": N}, K=k, GROUP=k // groups, GATED=gated)


def _index_from_one_element() -> None:
    """Triton 3.6's interpreter makes an index of a scalar by int() of a 1-element array,
    which numpy 2 refuses (a range over a program's split then fails): take the element."""
    import triton.runtime.interpreter as interpreter

    patch = interpreter._patch_lang_tensor

    def patch_with_index(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_with_index


def _launch(case: str, meta: dict, x, q, scales, bias, out, partials, arrived) -> None:
    import triton

    from kamado.surgery import triton_matmul as tm

    kernel, k, groups, rows, gated = CASES[case]
    n = out.shape[1]
    shape = {"K": k, "HAS_BIAS": True, "PDL": False, **meta}
    if kernel == "dot":
        grid = (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])
        tm._scaled_dot_kernel[grid](
            x, q, scales, bias, out, partials, arrived, rows, n, x.stride(0), q.stride(0),
            scales.stride(0), out.stride(0), GROUP=k // groups, BLOCK_M=tm.DOT_MAX_ROWS,
            **shape,
        )  # fmt: skip
    else:
        grid = (triton.cdiv(n, meta["BLOCK_N"]), rows, meta["SPLIT_K"])
        tm._rowwise_kernel[grid](
            x, q, scales, bias, out, partials, arrived, n, x.stride(0), q.stride(0),
            scales.stride(0), out.stride(0), GROUP=k // groups, HAS_SCALE=True, GATED=gated,
            **shape,
        )  # fmt: skip


def _check(case: str) -> None:
    """Print each configuration's relative error; fail if any is off or leaves split-K's
    arrival counts other than zero."""
    import torch.nn.functional as F

    from kamado.surgery import formats

    torch.manual_seed(0)
    _, k, groups, rows, gated = CASES[case]
    weight_rows = 2 * N if gated else N  # gated: gate's rows, then up's
    q = torch.randint(-128, 128, (weight_rows, k), dtype=torch.int8)
    scales = torch.rand(weight_rows, groups) * 1e-3
    x, bias = torch.randn(rows, k), torch.randn(weight_rows)
    expected = x @ formats.dequantize_int8(q, scales).T + bias
    if gated:
        expected = F.silu(expected[:, :N]) * expected[:, N:]
    partials, arrived = torch.zeros((N + 128) * 16 * 8), torch.zeros(2 * N, dtype=torch.int32)
    failed = []
    for config in _configs(case):
        meta = dict(config.kwargs)
        out = torch.empty(rows, N)
        _launch(case, meta, x, q, scales, bias, out, partials, arrived)
        error = float((out - expected).norm() / expected.norm())
        print(f"{meta} relative error {error:.1e}")
        if not error < 1e-5 or arrived.any():
            failed.append(meta)
    assert not failed, f"{case}: {failed}"


if __name__ == "__main__":
    _index_from_one_element()
    _check(sys.argv[1])

"""triton_matmul._scaled_dot_kernel (int8 and fp8 weights on tensor cores, 3-16 input rows)
run by Triton's interpreter on the CPU, in every configuration the autotuner may pick: a
scale per row, per group of 32 (GGUF's Q8_0) and per group of 128; K a multiple of no
BLOCK_K (masked last steps) and split K; against x @ W.T with W dequantized in float32.

The interpreter takes over only kernels defined after TRITON_INTERPRET=1 is set, so the
check runs in a child process: this file as a script. Its inputs are float32, since the
interpreter widens int8 to bf16 wrongly (values near 1e11); so this covers the kernel's
indexing, scales, masks and split-K sums, and the bf16 operands (the GPU's) are
tests/gpu/test_quantized_matmul.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

CASES = {"row": (3000, 1), "group-32": (3008, 94), "group-128": (1024, 8)}  # K, groups
N, ROWS = 200, 3  # 200 outputs: a part tile for every BLOCK_N


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
    from kamado.surgery.triton_matmul import _SCALED_DOT_CONFIGS

    assert child.stdout.count("\n") == len(_SCALED_DOT_CONFIGS), child.stdout


def _index_from_one_element() -> None:
    """Triton 3.6's interpreter makes an index of a scalar by int() of a 1-element array,
    which numpy 2 refuses (a range over a program's split then fails): take the element."""
    import triton.runtime.interpreter as interpreter

    patch = interpreter._patch_lang_tensor

    def patch_with_index(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_with_index


def _check(case: str) -> None:
    """Print each configuration's relative error; fail if any is off or leaves split-K's
    arrival counts other than zero."""
    import triton

    from kamado.surgery import formats
    from kamado.surgery import triton_matmul as tm

    torch.manual_seed(0)
    k, groups = CASES[case]
    q = torch.randint(-128, 128, (N, k), dtype=torch.int8)
    scales = torch.rand(N, groups) * 1e-3
    x, bias = torch.randn(ROWS, k), torch.randn(N)
    expected = x @ formats.dequantize_int8(q, scales).T + bias
    partials, arrived = torch.zeros((N + 128) * 16 * 8), torch.zeros(N, dtype=torch.int32)
    failed = []
    for config in tm._SCALED_DOT_CONFIGS:
        meta = dict(config.kwargs)
        out = torch.empty(ROWS, N)
        tm._scaled_dot_kernel[(triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](
            x, q, scales, bias, out, partials, arrived, ROWS, N, x.stride(0), q.stride(0),
            scales.stride(0), out.stride(0), K=k, GROUP=k // groups, HAS_BIAS=True,
            BLOCK_M=tm.DOT_MAX_ROWS, PDL=False, **meta,
        )  # fmt: skip
        error = float((out - expected).norm() / expected.norm())
        print(f"{meta} relative error {error:.1e}")
        if not error < 1e-5 or arrived.any():
            failed.append(meta)
    assert not failed, f"{case}: {failed}"


if __name__ == "__main__":
    _index_from_one_element()
    _check(sys.argv[1])

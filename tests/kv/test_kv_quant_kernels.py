"""The quantizing K/V store kernel, compiled for Hopper (sm_90) on a machine without a GPU,
rounds as kv/quant.py does (IEEE division, to nearest even; fp8 saturating), which is what
makes the Triton and torch backends write the same bytes. Runs wherever Triton and its
bundled ptxas are installed; tests/kernels compiles every kernel, tests/gpu runs them."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kamado.attention import triton_kernels as kernels  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
POINTERS = {"int8": "*i8", "fp8": "*fp8e4nv"}


def ptx(fn, signature: dict[str, str], constants: dict) -> str:
    signature = signature | {name: "constexpr" for name in constants}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    return triton.compile(source, target=HOPPER).asm["ptx"]


def ints(*names: str) -> dict[str, str]:
    return {name: "i32" for name in names}


@pytest.mark.parametrize(
    ("kv", "qmax", "rounding"),
    [("int8", 127.0, "cvt.rni.f32.f32"), ("fp8", 448.0, "cvt.rn.satfinite.e4m3x2.f32")],
)
def test_the_store_kernel_quantizes_with_the_torch_roundings(kv, qmax, rounding):
    codes = POINTERS[kv]
    signature = {
        "k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache": codes, "v_cache": codes,
        "k_scale": "*fp32", "v_scale": "*fp32", "slot_mapping": "*i64",
    } | ints("stride_k", "stride_v", "stride_slot", "stride_sslot")  # fmt: skip
    constants = {"KV_HEADS": 8, "HEADS_PAD": 8, "HEAD_DIM": 128, "QMAX": qmax, "INT8": kv == "int8",
                 "PDL": True}  # fmt: skip
    code = ptx(kernels._store_kv_quant_kernel, signature, constants)
    assert "div.rn.f32" in code and "div.full.f32" not in code
    assert rounding in code

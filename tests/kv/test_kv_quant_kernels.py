"""The quantizing Triton kernels compile for Hopper (sm_90) on a machine without a GPU, and
round as kv/quant.py does (IEEE division, to nearest even; fp8 saturating), which is what
makes the Triton and torch backends write the same bytes. Runs wherever Triton and its
bundled ptxas are installed; tests/gpu runs the kernels themselves."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kamado.attention import triton_kernels as kernels  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
POINTERS = {"int8": "*i8", "fp8": "*fp8e4nv", "auto": "*bf16"}


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


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_the_attention_kernels_compile_for_each_cache_format(kv):
    cache = POINTERS[kv]
    common = {"k_cache": cache, "v_cache": cache, "k_scale": "*fp32", "v_scale": "*fp32"}
    decode = {"q_ptr": "*bf16", **common, "block_tables": "*i32", "context_lens": "*i32",
              "mid_out": "*fp32", "mid_lse": "*fp32"}  # fmt: skip
    decode |= ints("stride_qt", "stride_qh", "stride_slot", "stride_kvh", "stride_sslot")
    decode |= ints("stride_bt", "stride_mb", "stride_mh", "stride_ms") | {"qk_scale": "fp32"}
    decode |= ints("window", "num_splits")
    for split in (False, True):
        code = ptx(kernels._decode_split_kernel, decode, {
            "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_N": 64,
            "SPLIT": split, "SCALED": kv != "auto", "PDL": True,
        })  # fmt: skip
        assert "griddepcontrol.wait" in code  # launched early (kamado.pdl), it waits
    extend = {"q_ptr": "*bf16", **common, "mid_out": "*fp32", "mid_lse": "*fp32",
              "block_tables": "*i32", "query_start": "*i32", "query_lens": "*i32",
              "context_lens": "*i32"}  # fmt: skip
    extend |= ints("stride_qt", "stride_qh", "stride_mb", "stride_mh", "stride_ms")
    extend |= ints("stride_slot", "stride_kvh", "stride_sslot", "stride_bt")
    extend |= {"qk_scale": "fp32"} | ints("window", "num_splits")
    for block_m, split in [(128, False), (16, True)]:
        ptx(kernels._extend_kernel, extend, {
            "GROUP": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_M": block_m, "BLOCK_N": 64,
            "SPLIT": split, "SCALED": kv != "auto",
        })  # fmt: skip


def test_the_merge_kernel_compiles_for_any_split_count():
    signature = {"mid_out": "*fp32", "mid_lse": "*fp32", "out_ptr": "*bf16"}
    signature |= ints("stride_mb", "stride_mh", "stride_ms", "stride_ot", "stride_oh", "num_splits")
    constants = {"HEAD_DIM": 128, "SPLITS_PAD": 64, "PDL": False}
    code = ptx(kernels._merge_splits_kernel, signature, constants)
    assert ".entry" in code

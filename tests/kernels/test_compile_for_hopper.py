"""Every Triton kernel that kamado launches compiles for Hopper (sm_90), here, without a GPU.

The GPU tests (tests/gpu) run only on the device machine, a short half hour a session, and
a kernel that does not compile (a loop variable that changes type, a name defined under a
compile-time branch only) fails there at its first launch. Here each launcher runs on CPU
tensors with Triton's launch replaced by a recorder, and every launch it makes (each of an
autotuner's configurations too) is specialized as Triton would on the device and compiled
ahead of time for sm_90 by Triton and the ptxas its wheel carries; a kernel that takes PDL
must wait for the kernel before it. Nothing runs: what the kernels compute stays with
tests/gpu. Skipped where Triton is not installed (the test extra installs it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from kamado.attention import triton_kernels as attention  # noqa: E402
from kamado.attention.triton_backend import EXTEND_TILES  # noqa: E402
from kamado.models import fused_kernels  # noqa: E402
from kamado.surgery import kernel_epilogues  # noqa: E402
from kamado.surgery import triton_matmul as matmul  # noqa: E402
from kamado.surgery.formats import pack_int4  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
# Qwen3-8B's attention: 32 query heads, 8 KV heads of 128; a small paged cache.
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCKS = 32, 8, 128, 16, 8
CACHE_CODES = {
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8-static": torch.float8_e4m3fn,  # a scale per layer and kv head: stride 0 over slots
}


@dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict[str, Any]


def recorded_launches(launcher: Callable[[], object], monkeypatch) -> list[Launch]:
    """The kernel launches `launcher` makes, every autotuner configuration among them, each
    with PDL on, as on the H200 (on a CPU the launchers turn it off)."""
    launches: list[Launch] = []

    def record(kernel: JITFunction, args: tuple, kwargs: dict[str, Any]) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        if "PDL" in kernel.arg_names:
            kwargs.update(PDL=True, launch_pdl=True)
        launches.append(Launch(kernel, args, kwargs))

    def jit_run(self: JITFunction, *args: Any, **kwargs: Any) -> None:
        record(self, args, kwargs)

    def tuner_run(self: Autotuner, *args: Any, **kwargs: Any) -> None:
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        for config in self.prune_configs(kwargs):
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
            record(self.fn, args, {**kwargs, **config.kwargs, **options})

    monkeypatch.setattr(JITFunction, "run", jit_run)
    monkeypatch.setattr(Autotuner, "run", tuner_run)
    launcher()
    return launches


def compile_for_hopper(launch: Launch) -> Any:
    """Specialize the launch's arguments as Triton's launcher does (alignment, divisibility
    by 16) and compile the kernel for sm_90 down to a cubin; returns Triton's compiled
    kernel (scripts/gemv_sass.py reads its cubin)."""
    kernel = launch.kernel
    backend = make_backend(HOPPER)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**launch.kwargs, "debug": False}
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=HOPPER, options=options.__dict__)
    assert compiled.asm["cubin"], kernel.__name__
    if "PDL" in kernel.arg_names:  # launched early (kamado.pdl), it waits
        assert "griddepcontrol.wait" in compiled.asm["ptx"], kernel.__name__
    return compiled


def cpu_randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def cache(codes: str) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    shape = (BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k, v = (torch.zeros(shape, dtype=CACHE_CODES[codes]) for _ in range(2))
    if codes == "bf16":
        return k, v, None
    if codes == "fp8-static":
        return (
            k,
            v,
            (torch.ones(KV_HEADS).expand(shape[:2]), torch.ones(KV_HEADS).expand(shape[:2])),
        )
    return k, v, (torch.ones(shape[:2]), torch.ones(shape[:2]))


def decode_attention(codes: str) -> None:
    k, v, scales = cache(codes)
    tables = torch.zeros(2, 16, dtype=torch.int32)
    lens = torch.tensor([40, 90], dtype=torch.int32)
    for splits in (1, 4):
        q = cpu_randn(2, HEADS, HEAD_DIM)
        attention.decode_attention(q, k, v, tables, lens, BLOCK_SIZE, splits, scales=scales)


def extend_attention(codes: str) -> None:
    """Each tile the engine compiles at start-up (TritonAttention.compile_kernels), once
    with a head a program and once with a GQA group and splits along the keys (a quantized
    cache: the smallest and the largest tile)."""
    k, v, scales = cache(codes)
    tables = torch.zeros(1, 16, dtype=torch.int32)
    group = HEADS // KV_HEADS
    tiles = EXTEND_TILES if codes == "bf16" else EXTEND_TILES[::4]
    for tile, (heads, splits) in itertools.product(tiles, ((1, 1), (group, 2))):
        rows = tile.block_m // heads
        lens = torch.tensor([rows], dtype=torch.int32)
        attention.extend_attention(
            cpu_randn(rows, HEADS, HEAD_DIM), k, v, tables, torch.zeros(1, dtype=torch.int32),
            lens, lens, rows, BLOCK_SIZE, 0, tile.block_m, tile.block_n, tile.num_warps,
            tile.num_stages, scales=scales, num_splits=splits, heads_per_program=heads,
        )  # fmt: skip


def store_kv(codes: str) -> None:
    k, v, scales = cache(codes)
    new = cpu_randn(3, KV_HEADS, HEAD_DIM)
    qmax = {"bf16": None, "int8": 127.0, "fp8": 448.0, "fp8-static": 448.0}[codes]
    attention.store_kv(new, new, k, v, torch.tensor([0, 5, -1]), scales, qmax)


def fused_elementwise() -> None:
    x = cpu_randn(2, 4096)
    fused_kernels.rms_norm(x, cpu_randn(4096), 1e-6)
    fused_kernels.rms_norm(x, cpu_randn(4096), 1e-6, residual=cpu_randn(2, 4096))
    kernel_epilogues.silu_mul(cpu_randn(2, 2 * 12288))
    k, v, _ = cache("bf16")
    rope = torch.ones(64, HEAD_DIM)
    for norm, store in itertools.product((True, False), repeat=2):
        weights = (cpu_randn(HEAD_DIM), cpu_randn(HEAD_DIM)) if norm else (None, None)
        fused_kernels.qk_norm_rope(
            cpu_randn(2, (HEADS + 2 * KV_HEADS) * HEAD_DIM), torch.tensor([3, 9]), rope, rope,
            HEADS, KV_HEADS, HEAD_DIM, *weights, 1e-6,
            (k, v, torch.tensor([7, -1])) if store else None,
        )  # fmt: skip


# Qwen3-8B's o_proj: 4096 x 4096, and the input rows that pick each kernel.
N = K = 4096


def dense_gemv() -> None:
    for rows in (1, 2):
        matmul.dense_matmul(cpu_randn(rows, K), cpu_randn(N, K), None)


def int8_matmuls() -> None:
    q = torch.zeros(N, K, dtype=torch.int8)
    # A scale a row, per group of 128, per group of 32 (GGUF's)
    for rows, groups in itertools.product((1, 8), (1, K // 128, K // 32)):
        matmul.int8_matmul(cpu_randn(rows, K), q, torch.ones(N, groups), None)
    # A K that no tile divides: the tensor-core kernel's masked last steps, a scale a row
    # and per group of 32.
    for k, groups in ((3000, 1), (3008, 3008 // 32)):
        q = torch.zeros(N, k, dtype=torch.int8)
        matmul.int8_matmul(cpu_randn(8, k), q, torch.ones(N, groups), None)


def fp8_matmuls() -> None:
    for k in (K, 3000):  # 3000: no tile divides it, so the last steps are masked
        q = torch.zeros(N, k, dtype=torch.float8_e4m3fn)
        for rows in (1, 8):
            matmul.fp8_matmul(cpu_randn(rows, k), q, torch.ones(N, 1), cpu_randn(N))


def gated_gemvs() -> None:
    """The GEMVs with SiLU(gate) * up as their epilogue, over Qwen3-8B's gate/up projection
    (2 x 12288 rows): dense and int8/fp8 with a scale per row, also at a K that no tile
    divides; int4 at one row, in groups of 128 and 32."""
    n = 2 * 12288
    for k in (K, 3000):
        x = cpu_randn(1, k)
        matmul.dense_matmul(x, cpu_randn(n, k), None, gated=True)
        int8 = torch.zeros(n, k, dtype=torch.int8)
        matmul.int8_matmul(x, int8, torch.ones(n, 1), None, gated=True)
        fp8 = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
        matmul.fp8_matmul(x, fp8, torch.ones(n, 1), cpu_randn(n), gated=True)
    for group in (128, 32):
        words = pack_int4(torch.zeros(n, K, dtype=torch.uint8), group)
        matmul.int4_matmul(cpu_randn(1, K), words, cpu_randn(n, K // group, 2), None, gated=True)


def int4_matmuls() -> None:
    """One row (GEMV), 2-8 bf16 rows (mma.sync), 3 fp16 rows (the rows GEMV), 16 rows
    (tiles); groups of 128, and of 32 as GGUF files bring."""
    for group in (128, 32):
        words = pack_int4(torch.zeros(N, K, dtype=torch.uint8), group)
        scale_mins = cpu_randn(N, K // group, 2)
        for rows, dtype in ((1, torch.bfloat16), (4, torch.bfloat16), (3, torch.float16),
                            (16, torch.bfloat16)):  # fmt: skip
            matmul.int4_matmul(cpu_randn(rows, K, dtype=dtype), words, scale_mins, None)


def widened_matmuls() -> None:
    """Inputs past the sliced rows: each format's weight widened for cuBLAS (int8 with a
    scale a row and a group; int4 in groups of 128, 32 and 96, a group no power of two)."""
    x = cpu_randn(65, K)
    int8 = torch.zeros(N, K, dtype=torch.int8)
    for groups in (1, K // 128):
        matmul.int8_matmul(x, int8, torch.ones(N, groups), None)
    matmul.fp8_matmul(x, torch.zeros(N, K, dtype=torch.float8_e4m3fn), torch.ones(N, 1), None)
    for group in (128, 32, 96):
        k = 3 * 1024 if group == 96 else K
        words = pack_int4(torch.zeros(N, k, dtype=torch.uint8), group)
        matmul.int4_matmul(cpu_randn(65, k), words, cpu_randn(N, k // group, 2), None)


LAUNCHERS: dict[str, Callable[[], None]] = {
    **{f"decode-attention-{c}": lambda c=c: decode_attention(c) for c in CACHE_CODES},
    **{f"extend-attention-{c}": lambda c=c: extend_attention(c) for c in CACHE_CODES},
    **{f"store-kv-{c}": lambda c=c: store_kv(c) for c in CACHE_CODES},
    "fused-elementwise": fused_elementwise,
    "dense-gemv": dense_gemv,
    "int8-matmuls": int8_matmuls,
    "fp8-matmuls": fp8_matmuls,
    "gated-gemvs": gated_gemvs,
    "int4-matmuls": int4_matmuls,
    "widened-matmuls": widened_matmuls,
}


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_kernels_compile_for_hopper(name, monkeypatch):
    launches = recorded_launches(LAUNCHERS[name], monkeypatch)
    assert launches, f"{name} launched no Triton kernel"
    for launch in launches:
        compile_for_hopper(launch)

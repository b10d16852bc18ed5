"""FusedForward (fused weights, norm/rope/SiLU kernels) against transformer.py's modules."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kamado.attention.backend import SeqChunk  # noqa: E402
from kamado.attention.torch_backend import TorchAttention  # noqa: E402
from kamado.kv.cache import KVCache  # noqa: E402
from kamado.models.fused_forward import FusedForward  # noqa: E402
from kamado.models.rope import RotaryEmbedding  # noqa: E402
from kamado.models.synthetic import synthetic_config, synthetic_weights  # noqa: E402
from kamado.models.transformer import StepContext, Transformer  # noqa: E402
from kamado.surgery.fuse import fuse_layer  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def hidden_states(config, weights, dtype, fused, ids):
    with torch.device("meta"):
        model = Transformer(config)
    model.load_weights({k: v.to(dtype) for k, v in weights.items()})
    if fused:
        for layer in model.model.layers:
            fuse_layer(layer)
    forward = FusedForward(model) if fused else model
    n = ids.shape[0]
    cache = KVCache(config, 8, 16, dtype, CUDA)
    backend = TorchAttention(CUDA)
    metadata = backend.build_metadata([SeqChunk(n, n, list(range(6)))], 16)
    ctx = StepContext(RotaryEmbedding(config, CUDA), backend, cache, metadata)
    with torch.inference_mode():
        hidden = forward(ids, torch.arange(n, device=CUDA), ctx).float()
    state = model.state_dict()  # fusing keeps every weight under its name, unchanged
    assert all(torch.equal(state[k], weights[k].to(dtype)) for k in weights)
    return hidden


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen2.5-0.5b", "tiny-llama"])
def test_fused_forward_is_as_close_to_float32_as_the_modules(shape):
    config = synthetic_config(shape)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=3)
    ids = torch.randint(0, min(config.vocab_size, 30000), (96,), device=CUDA)
    reference = hidden_states(config, weights, torch.float32, False, ids)
    plain = hidden_states(config, weights, torch.bfloat16, False, ids)
    fused = hidden_states(config, weights, torch.bfloat16, True, ids)

    def err(x: torch.Tensor) -> float:
        return float((x - reference).norm() / reference.norm())

    # Both round to bf16 at the same steps; matmuls may sum in another order, so the fused
    # path's error against float32 must be of the plain bf16 modules' size.
    assert err(fused) < 1.5 * err(plain) + 1e-3, (err(fused), err(plain))


@pytest.mark.parametrize("qk_norm", [True, False])
def test_rope_kernel_writes_the_cache_as_store_kv_does(qk_norm):
    """qk_norm_rope with kv_store: the rotated qkv and the cache bit for bit as rotating,
    then store_kv; a padding row (slot -1) writes nothing."""
    from kamado.attention.triton_kernels import store_kv
    from kamado.models.fused_kernels import qk_norm_rope

    config = synthetic_config("qwen3-0.6b")
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    rope = RotaryEmbedding(config, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(5)
    tokens = 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g, device=CUDA)
    qkv = qkv.to(torch.bfloat16)
    positions = torch.tensor([0, 7, 8, 100, 31, 5], device=CUDA)
    slots = torch.tensor([3, 17, 18, -1, 40, 2], device=CUDA)
    norms = [torch.rand(dim, generator=g, device=CUDA).to(torch.bfloat16) for _ in range(2)]
    q_norm, k_norm = norms if qk_norm else (None, None)
    caches = [torch.full((64, kv_heads, dim), 7.0, dtype=torch.bfloat16, device=CUDA)
              for _ in range(4)]  # fmt: skip

    fused = qkv.clone()
    qk_norm_rope(
        fused, positions, rope.cos, rope.sin, heads, kv_heads, dim, q_norm, k_norm, 1e-6,
        (caches[0], caches[1], slots),
    )  # fmt: skip
    plain = qkv.clone()
    qk_norm_rope(plain, positions, rope.cos, rope.sin, heads, kv_heads, dim, q_norm, k_norm, 1e-6)
    k = plain[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = plain[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    store_kv(k, v, caches[2], caches[3], slots)
    torch.cuda.synchronize()
    assert torch.equal(fused, plain)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    written = slots[slots >= 0]
    assert torch.equal(caches[0][written], k[slots >= 0])
    untouched = torch.ones(64, dtype=torch.bool, device=CUDA)
    untouched[written] = False
    assert bool((caches[0][untouched] == 7.0).all())


def gate_up_module(fmt: str, n: int, k: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """A fused gate/up projection (gate's n rows, then up's) in `fmt`, and the float32
    weight its kernels compute with."""
    from kamado.surgery import formats
    from kamado.surgery.qlinear import Fp8Linear, Int4Linear, Int8Linear

    w = torch.randn(2 * n, k, device=CUDA) * 0.05  # outputs of a few units: SiLU bends
    if fmt == "bf16":
        module = torch.nn.Linear(k, 2 * n, bias=False, device=CUDA, dtype=torch.bfloat16)
        module.weight.data.copy_(w)
        return module, module.weight.float()
    if fmt.startswith("int8"):
        q, scales = formats.quantize_int8(w, 32 if fmt == "int8-grouped" else None)
        return Int8Linear(q, scales, None), formats.dequantize_int8(q, scales)
    if fmt == "fp8":
        q, scales = formats.quantize_fp8(w)
        return Fp8Linear(q, scales, None), formats.dequantize_fp8(q, scales)
    q, scales, mins = formats.quantize_int4(w, 128, torch.float16)
    module = Int4Linear(q, scales, mins, None)
    on_card = module.scale_mins.float()  # the kernels' bf16 scales and mins
    return module, formats.dequantize_int4(q, on_card[..., 0], on_card[..., 1])


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int8-grouped", "fp8", "int4"])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_gated_projection_is_silu_of_gate_times_up(fmt, rows, monkeypatch):
    """gated_projection: SiLU(gate) * up as close to float32 as the matmul then silu_mul,
    and in the GEMV's epilogue (no silu_mul kernel) where a GEMV takes the weight and rows."""
    from kamado.models import fused_forward
    from kamado.surgery import triton_matmul
    from kamado.surgery.kernel_epilogues import silu_mul

    if fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs fp8")
    n, k = 3000, 2048
    module, w = gate_up_module(fmt, n, k)
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)
    gate, up = (x.float() @ w.T).split(n, dim=1)
    expected = torch.nn.functional.silu(gate) * up
    calls = []
    monkeypatch.setattr(triton_matmul, "silu_mul", lambda t: calls.append(t) or silu_mul(t))
    with torch.inference_mode():
        got = fused_forward.gated_projection(module)(x)
        unfused = silu_mul(module(x))

    def err(t: torch.Tensor) -> float:
        return float((t.float() - expected).norm() / expected.norm())

    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert err(got) < 1.5 * err(unfused) + 1e-3, (err(got), err(unfused))
    in_epilogue = (fmt in ("bf16", "int8", "fp8") and rows <= 2) or (fmt == "int4" and rows == 1)
    assert len(calls) == (0 if in_epilogue else 1)

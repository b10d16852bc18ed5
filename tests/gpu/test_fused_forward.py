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

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

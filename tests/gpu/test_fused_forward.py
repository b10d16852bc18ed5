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

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen2.5-0.5b", "tiny-llama"])
def test_fused_forward_matches_the_modules(shape):
    config = synthetic_config(shape)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=3)
    n = 96
    ids = torch.randint(0, min(config.vocab_size, 30000), (n,), device=CUDA)
    positions = torch.arange(n, device=CUDA)
    outs = []
    for fused in (False, True):
        with torch.device("meta"):
            model = Transformer(config)
        model.load_weights({k: v.clone() for k, v in weights.items()})
        forward = FusedForward(model) if fused else model
        cache = KVCache(config, 8, 16, torch.bfloat16, CUDA)
        backend = TorchAttention(CUDA)
        rope = RotaryEmbedding(config, CUDA)
        ctx = StepContext(
            rope, backend, cache, backend.build_metadata([SeqChunk(n, n, list(range(6)))], 16)
        )
        with torch.inference_mode():
            outs.append(forward(ids, positions, ctx).float())
        state = model.state_dict()  # fusing keeps every weight under its name, unchanged
        assert all(torch.equal(state[k], weights[k]) for k in weights)
    ref, out = outs
    # Same bf16 roundings step by step; only matmul summation order may differ.
    assert float((out - ref).norm() / ref.norm()) < 1e-2

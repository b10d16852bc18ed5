"""GGUF tensors served as stored on CUDA: q/k/v and gate/up of one layout fused into one
compressed layer (the gated GEMV's input), computing what the dequantized model computes,
with the same greedy tokens from CUDA graphs as eagerly."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from gguf import GGMLQuantizationType as T  # noqa: E402

from kamado.config import EngineConfig  # noqa: E402
from kamado.engine.core import EngineCore  # noqa: E402
from kamado.engine.sampling_params import SamplingParams  # noqa: E402
from kamado.models.synthetic import synthetic_weights, tiny_config  # noqa: E402
from kamado.surgery.check import teacher_forced_logits  # noqa: E402
from kamado.surgery.qlinear import QuantizedLinear  # noqa: E402
from tests.models.gguf_files import write_gguf  # noqa: E402

pytestmark = pytest.mark.gpu
IDS = [3, 17, 99, 4, 250, 31, 8, 77, 120, 5, 64, 200]


def engine(path: str, surgery: tuple[str, ...], graphs: bool = True) -> EngineCore:
    config = EngineConfig(
        model=path, device="cuda", dtype="bfloat16", kv_cache_bytes=64 << 20,
        cuda_graphs=graphs, surgery=surgery,
    )  # fmt: skip
    return EngineCore(config)


def greedy(core: EngineCore) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    core.add_request("r", IDS, params)
    tokens: list[int] = []
    while core.has_work():
        for delta in core.step():
            tokens.extend(delta.new_token_ids)
    return tokens


@pytest.mark.parametrize("arch,qtype", [("qwen2", T.Q5_0), ("llama", T.Q8_0), ("llama", T.Q4_1)])
def test_gguf_served_as_stored_on_cuda(tmp_path, arch, qtype):
    config = tiny_config(arch, hidden_size=256, intermediate_size=512, head_dim=64)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, config, synthetic_weights(config, torch.float32, seed=5), quantized=qtype)
    kept = engine(path, ("gguf",))
    layer = kept.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
    reference = teacher_forced_logits(engine(path, ()), IDS)
    error = (teacher_forced_logits(kept, IDS) - reference).norm() / reference.norm()
    assert error < 3e-2  # bf16 throughout, on both sides
    assert greedy(kept) == greedy(engine(path, ("gguf",), graphs=False))

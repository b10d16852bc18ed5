"""The surgery pipeline on tiny models: names and their checks, each step's effect on the
model and its memory report, layer-by-layer application while weights stream in, and
outputs against the unmodified model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.models import resolve_model, transformer
from kamado.models.gguf_reader import GGUFFile
from kamado.models.loader import iter_weights
from kamado.models.synthetic import synthetic_weights, tiny_config
from kamado.surgery.build import build_model
from kamado.surgery.check import teacher_forced_logits
from kamado.surgery.kv import with_kv_surgery
from kamado.surgery.names import parse_surgery
from kamado.surgery.pipeline import LoadTarget, linear_slots, module_bytes
from kamado.surgery.qembedding import GroupedEmbedding
from kamado.surgery.qlinear import Int4Linear, Int8Linear, QuantizedLinear
from kamado.surgery.registry import make_steps, weight_step_names
from tests.models.gguf_files import write_gguf

IDS = [3, 17, 99, 4, 250, 31, 8, 77, 120, 5, 64, 200]


def engine(model: str, surgery: tuple[str, ...] = (), **options) -> EngineCore:
    config = EngineConfig(
        model=model, dtype="float32", kv_cache_bytes=4 << 20, surgery=surgery, **options
    )
    return EngineCore(config)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_names_are_checked():
    assert parse_surgery("int8, kv-fp8") == ("int8", "kv-fp8")
    with pytest.raises(ValueError, match="unknown surgery step 'int3'"):
        parse_surgery("int3")
    with pytest.raises(ValueError, match="one weight format"):
        parse_surgery("int8,int4")
    with pytest.raises(ValueError, match="repeated"):
        parse_surgery("fuse,fuse")


def test_fusion_is_implied_on_cuda_with_fused_kernels_only():
    assert weight_step_names(EngineConfig(surgery=("int8",))) == ["int8"]
    cuda = EngineConfig(device="cuda", surgery=("int8",))
    assert weight_step_names(cuda) == ["int8", "fuse"]
    assert weight_step_names(dataclasses.replace(cuda, fused_kernels=False)) == ["int8"]


def test_steps_run_in_stage_order_whatever_the_command_line_order():
    target = LoadTarget(
        resolve_model("synthetic:tiny-llama"), tiny_config("llama"), torch.float32, "cpu"
    )
    assert [s.name for s in make_steps(["int8", "fuse"], target)] == ["fuse", "int8"]


def test_kv_names_set_the_kv_cache_dtype():
    config = with_kv_surgery(EngineConfig(surgery=("int8", "kv-fp8")))
    assert config.kv_cache_dtype == "fp8"
    assert with_kv_surgery(EngineConfig(surgery=("kv-int8",))).kv_cache_dtype == "int8"
    static = with_kv_surgery(EngineConfig(surgery=("kv-fp8-static",)))
    assert static.kv_cache_dtype == "fp8-static"
    with pytest.raises(ValueError, match="conflicts"):
        with_kv_surgery(EngineConfig(surgery=("kv-fp8",), kv_cache_dtype="int8"))


def test_fp8_refuses_a_device_without_fp8_clearly():
    with pytest.raises(ValueError, match="fp8 support"):
        engine("synthetic:tiny-llama", ("fp8",))


@pytest.mark.parametrize("arch,head", [("llama", True), ("qwen2", False)])
@pytest.mark.parametrize("step,kind", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_compression_replaces_every_projection_and_reports_the_bytes_it_freed(
    arch, head, step, kind
):
    plain = engine(f"synthetic:tiny-{arch}")
    compressed = engine(f"synthetic:tiny-{arch}", (step,))
    model = compressed.runner.model
    for i, layer in enumerate(model.model.layers):
        slots = linear_slots(layer, f"model.layers.{i}.")
        assert len(slots) == 7 and all(type(getattr(p, a)) is kind for p, a, _ in slots)
    assert (type(model.lm_head) is kind) == head  # a tied head stays with the embedding
    assert type(model.model.embed_tokens) is nn.Embedding
    (report,) = compressed.surgery
    freed = module_bytes(plain.runner.model) - module_bytes(model)
    assert report.bytes_saved == freed > 0


# Per-weight RMS error on Gaussian weights: int8 ~0.5%, 4-bit min-max groups ~10%; through
# two layers and the head a few times that. An unrelated model would be off by ~140%.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("step,tolerance", [("fuse", 1e-5), ("int8", 3e-2), ("int4", 0.3)])
def test_surgery_keeps_logits_near_the_unmodified_model(arch, step, tolerance):
    reference = teacher_forced_logits(engine(f"synthetic:tiny-{arch}"), IDS)
    got = teacher_forced_logits(engine(f"synthetic:tiny-{arch}", (step,)), IDS)
    assert relative_error(got, reference) < tolerance


@pytest.mark.parametrize("step", ["kv-int8", "kv-fp8", "kv-fp8-static"])
def test_the_scorer_reads_k_and_v_in_the_engines_kv_format(step):
    # `surgery check` scores a KV step by these logits: read from a cache of the model's
    # dtype, they would score it as lossless.
    reference = teacher_forced_logits(engine("synthetic:tiny-qwen3"), IDS)
    got = teacher_forced_logits(engine("synthetic:tiny-qwen3", (step,)), IDS)
    assert 0 < relative_error(got, reference) < 0.1


def test_fusion_keeps_hugging_face_names_as_views_of_one_matrix():
    model = engine("synthetic:tiny-qwen2", ("fuse",)).runner.model
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj is not None
    state = model.state_dict()
    assert state["model.layers.0.self_attn.k_proj.bias"].shape == (32,)
    fused = attn.qkv_proj.weight
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()


def test_layers_are_transformed_while_later_layers_are_still_unread(monkeypatch):
    config = tiny_config("llama", num_layers=3)
    source = resolve_model("synthetic:tiny-llama")
    built: list[transformer.Transformer] = []
    init = transformer.Transformer.__init__

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(transformer.Transformer, "__init__", remember)
    layer0_compressed_when_layer2_read: list[bool] = []

    def stream():
        for name, tensor in iter_weights(source, config, torch.float32):
            if name.startswith("model.layers.2.") and not layer0_compressed_when_layer2_read:
                down = built[0].model.layers[0].mlp.down_proj
                layer0_compressed_when_layer2_read.append(isinstance(down, QuantizedLinear))
            yield name, tensor

    steps = make_steps(["int8"], LoadTarget(source, config, torch.float32, "cpu"))
    build_model(config, stream(), steps, torch.float32)
    assert layer0_compressed_when_layer2_read == [True]


@pytest.fixture
def gguf_model(tmp_path, request):
    arch, qtype, *rest = request.param
    config = tiny_config(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    weights = synthetic_weights(config, torch.float32, seed=5)
    write_gguf(path, config, weights, quantized=qtype, quantized_as=rest[0] if rest else None)
    return path


@pytest.mark.parametrize(
    "gguf_model,kind,tolerance",
    [
        (("llama", GGMLQuantizationType.Q8_0), Int8Linear, 1e-2),
        (("qwen2", GGMLQuantizationType.Q5_0), Int8Linear, 1e-2),
        (("llama", GGMLQuantizationType.Q4_1), Int4Linear, 1e-2),
        (("qwen2", GGMLQuantizationType.Q4_0), Int4Linear, 1e-2),
    ],
    indirect=["gguf_model"],
)
def test_gguf_tensors_are_served_as_stored_and_compute_as_dequantized(
    gguf_model, kind, tolerance, monkeypatch
):
    reference = teacher_forced_logits(engine(str(gguf_model)), IDS)
    dequantized: list[str] = []
    real = GGUFFile.dequantize
    monkeypatch.setattr(
        GGUFFile, "dequantize", lambda self, n: dequantized.append(n) or real(self, n)
    )
    kept = engine(str(gguf_model), ("gguf",))
    widened = [n for n in dequantized if n.endswith(("attn_q.weight", "ffn_down.weight"))]
    assert not widened  # projections never went through float
    layer = kept.runner.model.model.layers[1]
    # q/k/v and gate/up of one layout are one layer each, the only copy of their rows
    assert type(layer.self_attn.qkv_proj) is kind and type(layer.mlp.gate_up_proj) is kind
    assert layer.self_attn.q_proj is None and layer.mlp.up_proj is None
    assert type(layer.mlp.down_proj) is kind
    model = kept.runner.model
    assert type(model.model.embed_tokens) is GroupedEmbedding  # the table as stored too
    if model.config.tie_word_embeddings:  # and the head computes from its values
        assert type(model.lm_head) is kind
    assert "kept as stored" in kept.surgery[0].line()
    # Both compute in bf16 on CPU (cpu_matmul.py), grouped int8 as two 4-bit layers
    assert relative_error(teacher_forced_logits(kept, IDS), reference) < tolerance


@pytest.mark.parametrize(
    "gguf_model", [("qwen2", GGMLQuantizationType.Q5_0, {"attn_v": GGMLQuantizationType.Q4_1})],
    indirect=True,
)  # fmt: skip
def test_gguf_parts_of_different_layouts_stay_apart(gguf_model):
    reference = teacher_forced_logits(engine(str(gguf_model)), IDS)
    kept = engine(str(gguf_model), ("gguf",))
    layer = kept.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj is None  # v's 4-bit rows cannot join q's and k's int8
    assert type(layer.self_attn.q_proj) is Int8Linear
    assert type(layer.self_attn.v_proj) is Int4Linear
    assert type(layer.mlp.gate_up_proj) is Int8Linear
    assert "kept as stored: 2 Q4_1, 13 Q5_0" in kept.surgery[0].line()
    assert relative_error(teacher_forced_logits(kept, IDS), reference) < 1e-2


def test_gguf_step_refuses_a_model_that_is_not_gguf():
    with pytest.raises(ValueError, match="not a GGUF file"):
        engine("synthetic:tiny-llama", ("gguf",))


def test_command_lines_take_surgery_lists(capsys):
    from kamado.cli import build_parser
    from kamado.server.commands import engine_config

    serve = build_parser().parse_args(["serve", "--surgery", "int8,kv-fp8"])
    assert engine_config(serve, "m").surgery == ("int8", "kv-fp8")
    check = build_parser().parse_args(
        ["surgery", "check", "m", "--surgery", "int8", "--surgery", "gguf,fuse"]
    )
    assert check.surgery == [("int8",), ("gguf", "fuse")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--surgery", "int3"])
    assert "unknown surgery step 'int3'" in capsys.readouterr().err

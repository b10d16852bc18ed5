"""From an EngineConfig to what the engine needs: model config, weights and KV sizing."""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kamado.config import EngineConfig, ModelConfig
from kamado.kv.cache import bytes_per_block
from kamado.kv.calibration import calibrated, calibration_ids
from kamado.kv.quant import KVFormat, kv_format
from kamado.models import load_model_config, resolve_model
from kamado.models.loader import iter_weights
from kamado.models.transformer import Transformer
from kamado.surgery.build import build_model
from kamado.surgery.pipeline import LoadTarget, StepReport
from kamado.surgery.registry import make_steps, weight_step_names

CPU_KV_FRACTION = 0.25  # of available RAM, on CPU, when no budget is given
CPU_KV_CAP = 4 << 30
HOST_TIER_CAP = 8 << 30  # default host-RAM tier on a discrete accelerator


@dataclass
class LoadedForEngine:
    model_config: ModelConfig
    model: Transformer  # loaded, with its surgery applied
    dtype: torch.dtype
    kv_format: KVFormat
    num_blocks: int
    max_model_len: int
    surgery: list[StepReport]


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        # bf16 halves the bytes read per token; on CPUs without native bf16 it is slow.
        native_bf16 = device.startswith("cuda") or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return torch.bfloat16 if native_bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_for_engine(config: EngineConfig) -> LoadedForEngine:
    source = resolve_model(config.model)
    model_config = load_model_config(source)
    dtype = resolve_dtype(config.dtype, config.device)
    target = LoadTarget(source, model_config, dtype, config.device)
    steps = make_steps(weight_step_names(config), target)
    skip = frozenset().union(*(s.skip_loading for s in steps))
    weights = iter_weights(source, model_config, dtype, config.device, skip)
    model, reports = build_model(model_config, weights, steps, dtype)
    fmt = kv_format(config.kv_cache_dtype, dtype, config.device)
    per_block = bytes_per_block(model_config, config.block_size, dtype, fmt)
    if config.kv_cache_bytes:
        budget = config.kv_cache_bytes
    elif config.device.startswith("cuda"):
        from kamado.engine.gpu_memory import cuda_kv_budget

        budget = cuda_kv_budget(config, model_config, dtype)
    else:
        budget = _default_kv_budget()
    num_blocks = max(1, budget // per_block)
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None:
        limit = min(limit, config.max_model_len)
    max_model_len = min(limit, num_blocks * config.block_size)
    if fmt.static:  # its scales come from the model itself: after the weights, before the cache
        ids = calibration_ids(source, model_config.vocab_size)
        fmt = calibrated(fmt, model, model_config, dtype, config.device, ids)
    return LoadedForEngine(model_config, model, dtype, fmt, num_blocks, max_model_len, reports)


def _default_kv_budget() -> int:
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(CPU_KV_CAP, int(available * CPU_KV_FRACTION))


def host_tier_bytes(config: EngineConfig) -> int:
    """RAM for blocks the accelerator evicts: as set, else on a discrete CUDA device a
    quarter of the machine's memory up to 8 GiB; none where device memory is host memory."""
    if config.kv_host_bytes is not None:
        return config.kv_host_bytes
    device = torch.device(config.device)
    if device.type != "cuda" or torch.cuda.get_device_properties(device).is_integrated:
        return 0
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(HOST_TIER_CAP, total // 4)


def kv_fingerprint(
    config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, fmt: KVFormat
) -> bytes:
    """Names whose K/V a cached block holds: model weights, dtype, KV cache dtype (and its
    static scales), block layout, and the code and device that computed it. Blocks saved
    under another fingerprint are never loaded."""
    h = hashlib.blake2b(digest_size=16)
    h.update(_code_identity())
    h.update(_device_name(config.device).encode())
    # Surgery changes the K/V a model computes: blocks of one variant never serve another.
    steps = weight_step_names(config)
    layout = (model_config, str(dtype), fmt.name, config.block_size, config.seed, steps)
    h.update(repr(layout).encode())
    if fmt.scales is not None:  # codes read with other static scales would be other values
        h.update(fmt.scales.numpy().tobytes())
    source = resolve_model(config.model)
    if source.path is None:
        h.update(f"synthetic:{source.name}".encode())
    else:
        files = [source.path] if source.path.is_file() else sorted(source.path.glob("*"))
        for path in files:
            if path.is_file():
                h.update(_file_identity(path))
    return h.digest()


@functools.cache
def _code_identity() -> bytes:
    # Another build (kamado's sources, torch's kernels) may compute K/V that differ by
    # rounding, so an upgrade starts the disk tier afresh rather than mix the two.
    return sources_digest(Path(__file__).parents[1], torch.__version__)


def sources_digest(root: Path, salt: str) -> bytes:
    """A digest of every Python file under root, by path and content."""
    h = hashlib.blake2b(salt.encode(), digest_size=16)
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return h.digest()


def _device_name(device: str) -> str:
    # CPU and each GPU model run other kernels, with other rounding.
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return torch.device(device).type


def _file_identity(path: Path) -> bytes:
    # Name, size and the first and last MiB: cheap, and different for different weights.
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(1 << 20)
        f.seek(max(0, size - (1 << 20)))
        tail = f.read(1 << 20)
    return hashlib.blake2b(path.name.encode() + str(size).encode() + head + tail).digest()

"""Configuration dataclasses: what the model is, and how the engine runs it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8-static", "int8")  # see kamado/kv/quant.py


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder-only transformer; architecture differences live here."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF-style rope scaling dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"kamado supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")


def kamado_home() -> Path:
    """Where pulled models and converted tokenizers live ($KAMADO_HOME, else the user cache)."""
    if env := os.environ.get("KAMADO_HOME"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kamado"


@dataclass
class EngineConfig:
    """How the engine core runs a model."""

    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # KV cache storage: auto (the model's dtype) | fp8 (e4m3) | int8; 8-bit formats keep a
    # float32 scale per token and kv head (kamado/kv/quant.py) and hold about twice the tokens.
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    # KV cache memory budget in bytes; None sizes it from device memory.
    kv_cache_bytes: int | None = None
    # On CUDA with no kv_cache_bytes: the share of the card for weights, the largest
    # step's activations and the KV pool together.
    gpu_memory_fraction: float = 0.9
    # Upper bound on tokens per forward pass (prefill chunks + decodes).
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # Longest prompt + output a sequence may reach; None = the model's own limit.
    max_model_len: int | None = None
    # A step carrying a prefill chunk beside running decodes may take at most this many
    # times a decode-only step, so decoding streams are never frozen by a long prompt.
    decode_stall_factor: float = 1.25
    # The same bound while an agent's short follow-up turn (<= 2,048 new prompt tokens) is
    # prefilled: its time to first token is what the agent waits for.
    short_turn_stall_factor: float = 2.0
    # With nothing decoding, a long prompt's chunk goes by layers in steps of about this
    # many seconds, so a request arriving meanwhile (another agent's turn) waits for no
    # more than that; None: a whole chunk a step. Only where the host's clock times each
    # layer as it runs (CPU); on CUDA a chunk's step is short anyway.
    alone_step_s: float | None = 0.5
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere
    # Replay decode steps from CUDA graphs (CUDA with the triton backend only).
    cuda_graphs: bool = True
    # Queue each greedy decode step before the previous one's tokens reach the host, so the
    # device never waits on the engine's Python between steps; None: on for CUDA.
    overlap_decode: bool | None = None
    # Fused QKV and gate/up weights, fused norm/rope/SiLU kernels (CUDA only).
    fused_kernels: bool = True
    # CPU threads for the model; None: as many as other processes leave cores idle
    # (re-checked every second), up to torch's default.
    cpu_threads: int | None = None
    # Load-time surgery steps by name (kamado.surgery): fuse, int8, int4, fp8, gguf,
    # kv-fp8, kv-fp8-static, kv-int8. On CUDA with fused_kernels, fuse is always applied.
    surgery: tuple[str, ...] = ()
    # Keep full KV blocks of finished turns and reuse them for requests with the same prefix.
    enable_prefix_caching: bool = True
    # Host-RAM tier for cached blocks a discrete accelerator evicts; None: a quarter of the
    # machine's memory up to 8 GiB on CUDA, none on CPU (device memory is host memory).
    kv_host_bytes: int | None = None
    # Disk tier for cached blocks evicted from the device (None: off), and its size cap.
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 8 << 30
    seed: int = 0
    # Speculative decoding: "auto" (n-gram and suffix drafts, sized by the adaptive
    # controller, which turns them off where verification does not pay), "off", "ngram",
    # "suffix", or "draft:MODEL" (a small model sharing the target's tokenizer).
    speculation: str = "auto"
    spec_max_draft: int = 8  # most draft tokens one sequence verifies per step
    extra: dict = field(default_factory=dict)

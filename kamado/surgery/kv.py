"""Surgery names `kv-fp8`, `kv-fp8-static` and `kv-int8`: the KV cache's storage dtype.
They change no weights; they set EngineConfig.kv_cache_dtype, which the KV cache reads."""

from __future__ import annotations

import dataclasses

from kamado.config import EngineConfig

KV_STEPS = {"kv-fp8": "fp8", "kv-fp8-static": "fp8-static", "kv-int8": "int8"}


def with_kv_surgery(config: EngineConfig) -> EngineConfig:
    """config with kv_cache_dtype set from a kv-* surgery name, if one is given."""
    chosen = [KV_STEPS[name] for name in config.surgery if name in KV_STEPS]
    if not chosen:
        return config
    if len(chosen) > 1:
        raise ValueError(f"surgery: choose one KV cache format, not {', '.join(chosen)}")
    if config.kv_cache_dtype not in ("auto", chosen[0]):
        raise ValueError(
            f"surgery kv-{chosen[0]} conflicts with kv_cache_dtype={config.kv_cache_dtype!r}"
        )
    return dataclasses.replace(config, kv_cache_dtype=chosen[0])

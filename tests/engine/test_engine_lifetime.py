"""An engine that goes out of scope frees its memory at once. The engine freezes the garbage
collector after loading, so a reference cycle among its parts would hold the KV cache (and
on CUDA the pinned host tier) for the rest of the process."""

from __future__ import annotations

import weakref

from tests.engine.conftest import greedy, make_engine, run


def test_a_dropped_engine_frees_its_kv_cache_without_the_collector(tiny_models):
    path, _ = tiny_models["qwen2"]
    engine = make_engine(path, block_size=4, kv_cache_bytes=1 << 20)
    # Distinct prompts fill the cache, so later ones evict earlier cached blocks.
    prompts = {str(i): ([i + 1] * 40 + list(range(30)), greedy(4)) for i in range(30)}
    run(engine, prompts)
    assert engine.pool.num_evictions > 0
    cache, pool = weakref.ref(engine.runner.cache), weakref.ref(engine.pool)
    del engine
    assert cache() is None and pool() is None

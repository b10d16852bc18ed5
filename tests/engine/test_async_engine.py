"""The engine core in its own process, driven through AsyncEngine."""

import asyncio
import os
import signal

import pytest

from kamado.config import EngineConfig
from kamado.engine.async_engine import AsyncEngine, EngineDeadError
from kamado.engine.core import RequestError
from tests.engine.conftest import greedy, make_engine, run


@pytest.fixture(scope="module")
def tiny_path(tiny_models):
    return tiny_models["qwen2"][0]


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", kv_cache_bytes=8 << 20)


async def collect(engine: AsyncEngine, request_id: str, prompt, params) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for delta in engine.generate(request_id, prompt, params):
        out.setdefault(delta.index, []).extend(delta.new_token_ids)
    return out


async def test_concurrent_requests_match_the_in_process_engine(tiny_path):
    prompts = {f"r{i}": [i + 1, 7, 9, 11 + i] for i in range(6)}
    expected = run(make_engine(tiny_path), {k: (p, greedy(10)) for k, p in prompts.items()})
    engine = await AsyncEngine.start(config(tiny_path))
    try:
        results = await asyncio.gather(
            *(collect(engine, k, p, greedy(10)) for k, p in prompts.items())
        )
        assert dict(zip(prompts, results, strict=True)) == expected
        with pytest.raises(RequestError, match="context"):
            await collect(engine, "too-long", [1] * 5000, greedy(4))
        with pytest.raises(RequestError, match="logit_bias"):
            await collect(engine, "bad-bias", [1, 2], greedy(4, logit_bias={10**6: 1.0}))
        assert await collect(engine, "after", prompts["r0"], greedy(10)) == expected["r0"]
    finally:
        await engine.shutdown()


async def test_leaving_a_stream_early_frees_its_blocks(tiny_path):
    engine = await AsyncEngine.start(config(tiny_path))
    try:
        stream = engine.generate("long", [1, 2, 3], greedy(500))
        async for _ in stream:
            if engine.stats().kv_blocks_used:
                break
        await stream.aclose()  # what a disconnecting client does
        for _ in range(100):
            await asyncio.sleep(0.05)
            if engine.stats().kv_blocks_used == 0:
                break
        assert engine.stats().kv_blocks_used == 0
    finally:
        await engine.shutdown()


async def test_a_dead_engine_fails_requests_instead_of_hanging(tiny_path):
    engine = await AsyncEngine.start(config(tiny_path))
    try:
        stream = engine.generate("doomed", [1, 2, 3], greedy(100_000))
        await stream.__anext__()
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass
        assert not engine.stats().alive
    finally:
        await engine.shutdown()


async def test_aborting_one_choice_ends_it_and_the_others_run_on(tiny_path):
    from kamado.engine.sampling_params import SamplingParams

    engine = await AsyncEngine.start(config(tiny_path))
    try:
        params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=30, ignore_eos=True)
        reasons: dict[int, str] = {}
        counts = {0: 0, 1: 0}
        async with asyncio.timeout(60):
            async for delta in engine.generate("two", [1, 2, 3], params):
                counts[delta.index] += len(delta.new_token_ids)
                if delta.index == 0 and counts[0] == 3 and 0 not in reasons:
                    await engine.abort("two", 0)
                if delta.finish_reason:
                    reasons[delta.index] = delta.finish_reason
        assert reasons == {0: "abort", 1: "length"}
        assert counts[0] < 30 and counts[1] == 30
    finally:
        await engine.shutdown()

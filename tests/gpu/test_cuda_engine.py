"""Greedy generation of a full synthetic model (qwen3-0.6b shapes, bf16) on CUDA: the
Triton backend, CUDA graphs and fused kernels against the torch backend and plain modules."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kamado.config import EngineConfig  # noqa: E402
from kamado.engine.core import EngineCore  # noqa: E402
from kamado.engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.conftest import FixedPacer  # noqa: E402

pytestmark = pytest.mark.gpu
PROMPT_LENS = [7, 300, 1000, 2500]
GEN_LEN = 24
# Two bf16 logits closer than this may swap order between kernels summing in other orders.
BF16_TIE = 0.1
FP8_TIE = 0.5


def generate(
    backend: str,
    graphs: bool,
    logprobs: int | None = None,
    fused: bool = True,
    kv: str = "auto",
    prompt_lens: list[int] = PROMPT_LENS,
    model: str = "synthetic:qwen3-0.6b",
    logit_bias: dict[int, float] | None = None,
) -> dict[str, list]:
    engine = EngineCore(
        EngineConfig(
            model=model, device="cuda", dtype="bfloat16",
            kv_cache_bytes=1 << 30, max_num_seqs=8, max_num_batched_tokens=1024,
            attention_backend=backend, cuda_graphs=graphs, fused_kernels=fused,
            kv_cache_dtype=kv, speculation="off",  # these compare kernels and graphs
        )
    )  # fmt: skip
    params = SamplingParams(
        temperature=0.0, max_tokens=GEN_LEN, ignore_eos=True, logprobs=logprobs,
        logit_bias=logit_bias or {},
    )  # fmt: skip
    spread = min(30000, engine.model_config.vocab_size - 100)  # ids the vocabulary has
    for i, n in enumerate(prompt_lens):
        engine.add_request(
            str(i), [(i * 7919 + j * 104729) % spread + 100 for j in range(n)], params
        )
    tokens: dict[str, list] = {str(i): [] for i in range(len(prompt_lens))}
    while engine.has_work():
        for delta in engine.step():
            tokens[delta.request_id].extend(
                delta.logprobs if logprobs is not None else delta.new_token_ids
            )
    return tokens


def assert_same_up_to_bf16_ties(
    reference: dict[str, list],
    tokens: dict[str, list],
    tie: float = BF16_TIE,
    min_matched: float = 0.5,
) -> None:
    """Each sequence follows the reference's greedy tokens until, at most, one pick of the
    reference's runner-up within a tie; at least `min_matched` of all tokens match (a
    guard against a path that parts at once: the tie check is the test)."""
    matched = 0
    for rid, entries in reference.items():
        for pos, (entry, token) in enumerate(zip(entries, tokens[rid], strict=True)):
            if entry.token_id == token:
                matched += 1
                continue
            runner_up = dict(entry.top)
            assert token in runner_up, (rid, pos)
            assert entry.logprob - runner_up[token] < tie, (rid, pos)
            break  # the sequences differ from here on: nothing left to compare
    assert matched >= len(reference) * GEN_LEN * min_matched


def test_cuda_graphs_follow_the_eager_decode():
    # Replays pad a batch to the next captured size, so matmuls may sum in another order.
    assert_same_up_to_bf16_ties(
        generate("triton", graphs=False, logprobs=2), generate("triton", graphs=True)
    )


def test_graphs_hold_rotary_tables_that_nothing_grows_after_capture():
    """A token budget (1024) above the model's 512 positions: the start-up warm-up runs
    chunks longer than any sequence, whose positions need longer rotary tables. Grown after
    the graphs were captured, the tables moved and the graphs read freed memory (tiny GGUF
    models decoded zeros, bench/results/2026-12-07-h100-gguf-graphs-diagnosis.txt). Now the
    warm-up comes first and the tables are held once captured (growing them raises)."""
    short = dict(prompt_lens=[100], model="synthetic:tiny-llama")
    assert_same_up_to_bf16_ties(
        generate("triton", graphs=False, logprobs=2, **short),
        generate("triton", graphs=True, **short),
    )


def test_greedy_tokens_match_the_plain_torch_model_up_to_bf16_ties():
    # The reference: torch attention and the unfused modules of transformer.py. Random
    # weights give near-flat logits: on an H100 a run picked the reference's third token,
    # its top two 0.016 apart, so the pick is looked for among the top 5 (within a tie).
    reference = generate("torch", graphs=False, logprobs=5, fused=False)
    assert_same_up_to_bf16_ties(reference, generate("triton", graphs=True))
    assert_same_up_to_bf16_ties(reference, generate("triton", graphs=False, fused=False))


@pytest.mark.parametrize("prompt_lens", [[300], [7, 1000]])
def test_decodes_of_one_or_two_sequences_through_the_gemv_follow_the_plain_model(prompt_lens):
    # At 1-2 rows the fused path's projections and head run triton_matmul's GEMV. Random
    # weights give near-flat logits, and one sequence has no others to average over: a run
    # on the H200 parted at its 7th token on a tie of 0.06, so a quarter must match here.
    reference = generate("torch", False, logprobs=2, fused=False, prompt_lens=prompt_lens)
    tokens = generate("triton", True, prompt_lens=prompt_lens)
    assert_same_up_to_bf16_ties(reference, tokens, min_matched=0.25)


@pytest.mark.parametrize("kv", ["int8", "fp8", "fp8-static"])
def test_quantized_kv_through_triton_and_graphs_follows_the_torch_backend(kv):
    # Both read the same codes: the Triton store must write what the torch one writes.
    # A code one step away (see test_triton_attention) moves an e4m3 value by up to 1/8:
    # fp8 ties are wider than bf16 ones, and random weights give flat logits (the top few
    # tokens within a few hundredths), so the pick is looked for among the top 5.
    reference = generate("torch", graphs=False, logprobs=5, fused=False, kv=kv)
    tie = FP8_TIE if kv.startswith("fp8") else BF16_TIE
    assert_same_up_to_bf16_ties(reference, generate("triton", graphs=True, kv=kv), tie)


def test_logit_bias_bans_and_forces_tokens_through_graphs():
    # A biased greedy row is picked on the host (not by the argmax on the device), beside
    # decodes replayed from CUDA graphs.
    lens = dict(prompt_lens=[7, 300])
    free = generate("triton", graphs=True, **lens)
    seen = {t for tokens in free.values() for t in tokens}
    banned = generate("triton", graphs=True, logit_bias=dict.fromkeys(seen, -100.0), **lens)
    assert all(len(t) == GEN_LEN and not seen & set(t) for t in banned.values())
    forced = generate("triton", graphs=True, logit_bias={12345: 100.0}, **lens)
    assert all(t == [12345] * GEN_LEN for t in forced.values())


def test_decode_launched_ahead_gives_the_tokens_of_one_step_at_a_time():
    # Lengths differ, so the batch shrinks and later steps read their input tokens from
    # other rows of the step in flight; one request is aborted with a step in flight.
    runs, ahead = {}, {}
    for overlap in (False, True):
        engine = EngineCore(
            EngineConfig(
                model="synthetic:qwen3-0.6b", device="cuda", dtype="bfloat16",
                kv_cache_bytes=1 << 30, max_num_seqs=8, overlap_decode=overlap,
                speculation="off", decode_stall_factor=float("inf"),  # a fixed schedule
            )
        )  # fmt: skip
        tokens: dict[str, list[int]] = {}
        for i, n in enumerate(PROMPT_LENS):
            params = SamplingParams(temperature=0.0, max_tokens=GEN_LEN - 5 * i, ignore_eos=True)
            engine.add_request(str(i), [(i * 31 + j * 17) % 30000 + 100 for j in range(n)], params)
            tokens[str(i)] = []
        while engine.has_work():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.new_token_ids)
                if delta.request_id == "1" and len(tokens["1"]) == 6:
                    engine.abort("1")
        runs[overlap], ahead[overlap] = tokens, engine.stats.steps_launched_ahead
        assert engine.pool.num_used == 0
    assert runs[True] == runs[False]
    assert [len(t) for t in runs[True].values()] == [GEN_LEN, 6, GEN_LEN - 10, GEN_LEN - 15]
    assert ahead[False] == 0 and ahead[True] > 0


CHUNK = 253  # the long prompts' chunks in both runs: 256 tokens a step less 3 decodes


def staged_beside_streams(
    staged: bool, logprobs: int | None
) -> tuple[dict, list[tuple[int, bool]]]:
    """Three streams decode, then two long prompts arrive and go in chunks of CHUNK
    tokens: through 5 layers a step if `staged`, else through every layer at once.
    Returns each request's tokens (or logprobs) and, per step, the layers of its chunk and
    whether it was launched ahead."""
    engine = EngineCore(
        EngineConfig(
            model="synthetic:qwen3-0.6b", device="cuda", dtype="bfloat16",
            kv_cache_bytes=1 << 30, max_num_seqs=8, max_num_batched_tokens=CHUNK + 3,
            speculation="off", decode_stall_factor=1.25 if staged else float("inf"),
        )
    )  # fmt: skip
    if staged:
        engine.pacer = engine.scheduler.pacer = FixedPacer(CHUNK, 5, short=CHUNK, long=2048)
    params = SamplingParams(temperature=0.0, max_tokens=GEN_LEN, ignore_eos=True, logprobs=logprobs)
    for i in range(3):
        prompt = [(i * 31 + j * 17) % 30000 + 100 for j in range(9)]
        engine.add_request(f"s{i}", prompt, replace(params, max_tokens=400))
    tokens: dict[str, list] = {}
    layers = []
    for step in range(10_000):
        if step == 5:
            for i, n in enumerate((3000, 5000)):
                prompt = [(i * 7919 + j * 104729) % 30000 + 100 for j in range(n)]
                engine.add_request(f"p{i}", prompt, params)
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(
                delta.logprobs if logprobs is not None else delta.new_token_ids
            )
        layers.append(
            (engine.stats.last_step_prefill_layers, engine.stats.last_step_launched_ahead)
        )
        if not engine.has_work():
            break
    assert engine.pool.num_used == 0
    return tokens, layers


def test_prompts_staged_beside_decodes_follow_prompts_prefilled_whole():
    # Same chunks either way: what differs is that a staged chunk's residual stream waits
    # between steps, in its own pass beside the decodes' graph.
    reference, _ = staged_beside_streams(staged=False, logprobs=2)
    tokens, layers = staged_beside_streams(staged=True, logprobs=None)
    assert max(n for n, _ in layers) == 5
    # Greedy on the device: steps with a chunk's layers go ahead of the tokens too.
    staged = [ahead for n, ahead in layers if n]
    assert sum(staged) > len(staged) / 2
    matched = 0
    for rid in ("p0", "p1", "s0"):
        for entry, token in zip(reference[rid], tokens[rid], strict=True):
            if entry.token_id != token:
                runner_up = dict(entry.top)
                assert token in runner_up and entry.logprob - runner_up[token] < BF16_TIE
                break
            matched += 1
    assert matched >= GEN_LEN


def test_a_dropped_engine_frees_its_device_and_pinned_memory():
    """Graphs, Triton backend and the pinned host tier included: nothing may keep a dropped
    engine alive (the engine freezes the collector, so a cycle would hold it for good)."""
    engine = EngineCore(
        EngineConfig(
            model="synthetic:qwen3-0.6b", device="cuda", dtype="bfloat16",
            kv_cache_bytes=1 << 30, max_num_seqs=8, kv_host_bytes=1 << 30,
        )
    )  # fmt: skip
    engine.add_request("a", list(range(100, 400)), SamplingParams(temperature=0.0, max_tokens=8))
    while engine.has_work():
        engine.step()
    assert engine.host is not None
    cache, host = weakref.ref(engine.runner.cache), weakref.ref(engine.host)
    del engine
    assert cache() is None and host() is None


def compiled_attention_kernels() -> int:
    from kamado.attention import triton_kernels as kernels

    fns = (kernels._extend_kernel, kernels._decode_split_kernel, kernels._merge_splits_kernel)
    return sum(len(cache[0]) for fn in fns for cache in fn.device_caches.values())


# A 3,000-token prompt: chunks of it over a long context beside decodes.
LONG_PROMPT = [(j * 104729) % 30000 + 100 for j in range(3000)]


def long_prompt_engine() -> EngineCore:
    """Chunks of at most 512 tokens, so a long prompt goes in several beside decodes."""
    return EngineCore(
        EngineConfig(
            model="synthetic:qwen3-0.6b", device="cuda", dtype="bfloat16",
            kv_cache_bytes=1 << 30, max_num_seqs=8, max_num_batched_tokens=512,
            speculation="off",
        )
    )  # fmt: skip


def test_no_attention_kernel_compiles_after_the_engine_starts():
    """Short chunks over long contexts beside decodes, long chunks, every tile size and
    split count: all compiled at start, none mid-run (each compile stalled a step 0.6-2.5 s)."""
    engine = long_prompt_engine()
    compiled = compiled_attention_kernels()
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    long = LONG_PROMPT
    engine.add_request("long", long, params)
    engine.add_request("short", long[:5], params)
    for _ in range(12):  # the long prompt in chunks beside the short one decoding
        engine.step()
    # A follow-up turn (a few tokens past a cached prefix) and prompts of every tile size.
    engine.add_request("follow-up", long[:2048] + [7] * 9, params)
    for n in (20, 40, 70, 300):
        engine.add_request(f"p{n}", long[-n:], params)
    while engine.has_work():
        engine.step()
    assert compiled_attention_kernels() == compiled


def test_garbage_is_collected_only_while_the_device_computes():
    """No collection starts mid-step (a 2.4 ms one made the 128k fairness bench's worst
    gap), nor is garbage left uncollected: the engine collects while it waits for tokens."""
    engine = long_prompt_engine()
    where: list[str] = []
    state = {"in": "outside"}

    def marked(label: str, call):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            before, state["in"] = state["in"], label
            try:
                return call(*args, **kwargs)
            finally:
                state["in"] = before

        return run

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            where.append(state["in"])

    engine._step = marked("step", engine._step)
    engine.collector.collect_due = marked("wait", engine.collector.collect_due)
    old = gc.get_threshold()
    gc.set_threshold(50, 5, 5)  # a collection due every few steps
    gc.callbacks.append(seen)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        engine.add_request("long", LONG_PROMPT, params)
        engine.add_request("short", list(range(100, 120)), params)
        while engine.has_work():
            engine.step()
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*old)
    assert "step" not in where
    assert where.count("wait") >= 10

"""`kamado surgery check`: what each surgery variant costs in fidelity, beside the
unmodified model, and what it saves in memory and gains in decode speed.

Per variant: weight memory; greedy continuations of a fixed prompt set (prompts whose
whole continuation matches the unmodified model's, and the share of tokens before the
first difference); top-1 agreement of next-token predictions along the unmodified model's
continuations (teacher-forced, so one early difference does not hide the rest);
perplexity on a fixed text; batch-1 prefill and decode tokens/s of a SPEED_PROMPT-token
prompt, measured in interleaved rounds with speculation off (drafts accepted depend on what
each variant happens to generate: with them on, the column would measure luck, not the
weights). Prefill and decode may move apart: a format's matmul may be fast for one input
row and slow for hundreds.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kamado.bench.throughput import kamado_throughput
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams
from kamado.models import load_tokenizer, resolve_model
from kamado.models.prefill import prefill_alone
from kamado.surgery.check_texts import PERPLEXITY_TEXT, PROMPTS
from kamado.surgery.pipeline import module_bytes

SPEED_ROUNDS = 3
SPEED_PROMPT = 256  # prompt tokens of the speed rounds


@dataclass
class VariantResult:
    surgery: str
    weight_bytes: int
    kv_bytes_per_token: int  # every layer's K and V, scales included
    steps: list[str]
    greedy_same: int  # prompts whose continuation equals the unmodified model's
    greedy_prefix: float  # mean share of tokens before the first difference
    top1: float
    perplexity: float
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0


def run_check(
    model: str,
    variants: list[tuple[str, ...]],
    device: str = "cpu",
    dtype: str = "auto",
    new_tokens: int = 32,
    speed_tokens: int = 32,  # 0: no speed measurement
) -> dict:
    tokenizer = load_tokenizer(resolve_model(model))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    text = tokenizer.encode(PERPLEXITY_TEXT)
    engines = [_engine(model, device, dtype, v) for v in [(), *variants]]
    greedy = [_greedy(e, prompts, new_tokens) for e in engines]
    sequences = [p + g for p, g in zip(prompts, greedy[0], strict=True)]
    base_top1 = _predictions(engines[0], sequences, prompts)
    results = []
    for surgery, engine, tokens in zip([(), *variants], engines, greedy, strict=True):
        top1 = _predictions(engine, sequences, prompts)
        agree = sum(int((a == b).sum()) for a, b in zip(top1, base_top1, strict=True))
        results.append(
            VariantResult(
                surgery=",".join(surgery) or "none",
                weight_bytes=module_bytes(engine.runner.model),
                kv_bytes_per_token=engine.runner.cache.block_bytes // engine.runner.block_size,
                steps=[r.line() for r in engine.surgery],
                greedy_same=sum(t == b for t, b in zip(tokens, greedy[0], strict=True)),
                greedy_prefix=statistics.mean(
                    _common_prefix(t, b) / len(b) for t, b in zip(tokens, greedy[0], strict=True)
                ),
                top1=agree / sum(len(t) for t in base_top1),
                perplexity=_perplexity(teacher_forced_logits(engine, text), text),
            )
        )
    speeds: list[list[tuple[float, float]]] = [[] for _ in engines]
    for _ in range(SPEED_ROUNDS if speed_tokens else 0):  # interleaved: load hits all alike
        for i, engine in enumerate(engines):
            r = kamado_throughput(engine, model, 1, SPEED_PROMPT, speed_tokens)
            speeds[i].append((r.prefill_tok_s, r.decode_tok_s))
    for result, s in zip(results, speeds, strict=True):
        if s:
            result.prefill_tok_s = statistics.median(p for p, _ in s)
            result.decode_tok_s = statistics.median(d for _, d in s)
    print(format_table(results, len(prompts)))
    return dict(
        model=model, device=device, dtype=str(engines[0].dtype), new_tokens=new_tokens,
        prompts=len(prompts), text_tokens=len(text), speed_rounds=SPEED_ROUNDS,
        speed_prompt_tokens=SPEED_PROMPT,
        variants=[asdict(r) for r in results],
    )  # fmt: skip


def _engine(model: str, device: str, dtype: str, surgery: tuple[str, ...]) -> EngineCore:
    config = EngineConfig(
        model=model, device=device, dtype=dtype, surgery=surgery, kv_cache_bytes=64 << 20,
        enable_prefix_caching=False, speculation="off",
    )  # fmt: skip
    return EngineCore(config)


def _greedy(engine: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"check-{i}", prompt, params)
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return [out[f"check-{i}"] for i in range(len(prompts))]


def _predictions(
    engine: EngineCore, sequences: list[list[int]], prompts: list[list[int]]
) -> list[torch.Tensor]:
    """The argmax next token at each position of each sequence's continuation."""
    return [
        teacher_forced_logits(engine, s)[len(p) - 1 : -1].argmax(-1)
        for s, p in zip(sequences, prompts, strict=True)
    ]


@torch.inference_mode()
def teacher_forced_logits(engine: EngineCore, ids: list[int]) -> torch.Tensor:
    """Float32 logits at every position of ids, one prefill through the engine's model in a
    KV cache of its own, in the engine's KV format (a KV step's loss is scored too)."""
    runner = engine.runner
    hidden, _ = prefill_alone(
        runner.forward, runner.rope, runner.backend, ids, engine.model_config, engine.dtype,
        runner.device, runner.block_size, engine.kv_format,
    )  # fmt: skip
    return runner.forward.logits(hidden).cpu()


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    return math.exp(float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def format_table(results: list[VariantResult], num_prompts: int) -> str:
    base = results[0]
    lines = [
        f"{'surgery':16s} {'weights MiB':>11s} {'saved':>6s} {'KV B/token':>10s} "
        f"{'greedy same':>11s} "
        f"{'prefix':>6s} {'top-1':>6s} {'ppl':>7s} {'ppl +%':>6s} {'prefill tok/s':>13s} "
        f"{'speed':>6s} {'decode tok/s':>12s} {'speed':>6s}"
    ]
    for r in results:
        lines.append(
            f"{r.surgery:16s} {r.weight_bytes / 2**20:11.1f} "
            f"{1 - r.weight_bytes / base.weight_bytes:6.0%} {r.kv_bytes_per_token:10,d} "
            f"{f'{r.greedy_same}/{num_prompts}':>11s} {r.greedy_prefix:6.0%} {r.top1:6.1%} "
            f"{r.perplexity:7.3f} {r.perplexity / base.perplexity - 1:+6.1%} "
            f"{r.prefill_tok_s:13.1f} {r.prefill_tok_s / (base.prefill_tok_s or 1):5.2f}x "
            f"{r.decode_tok_s:12.1f} {r.decode_tok_s / (base.decode_tok_s or 1):5.2f}x"
        )
    for r in results:
        lines.extend(f"  {r.surgery}: {line}" for line in r.steps)
    return "\n".join(lines)

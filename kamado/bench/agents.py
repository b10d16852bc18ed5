"""`kamado bench --agents`: agents' turns against the engine itself, in token ids.

The agent-state workload without HTTP or a tokenizer, so it runs on synthetic weights on a
GPU machine: N agents share a system prompt; each starts from a long context (files read
earlier in its session), loaded all at once as the agents' cold turns, and then takes
turns that append ~`new_tokens` tokens (a tool result) after its previous reply and wait
for a reply of about `gen_len` tokens (half to one and a half times it, so the agents
drift out of step). Agents take turns independently, so a turn usually arrives while the
others are decoding. Reported: time to first token of the follow-up turns (median, p99,
and by how many other agents were decoding when each arrived), the prefix-cache hit rate,
and decode tokens/s.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kamado.bench.replay import median_p99, seconds_text
from kamado.bench.report import machine
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams


@dataclass
class Turn:
    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    seconds: float
    others_decoding: int  # other agents mid-reply when this turn arrived
    steps_to_first_token: int  # engine steps from its arrival to its first token


@dataclass
class Agent:
    index: int
    tokens: list[int]  # the session so far: prompt and replies
    turns_left: int
    turn: int = 0
    request_id: str | None = None
    submitted: float = 0.0
    first_token: float | None = None
    others_decoding: int = 0
    submitted_step: int = 0
    first_token_step: int = 0
    reply: list[int] = field(default_factory=list)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Clear of the special tokens at the top of real vocabularies.
    return [rng.randrange(100, min(vocab, 30000)) for _ in range(n)]


def run_agents(
    engine: EngineCore,
    agents: int = 4,
    context_tokens: int = 4096,
    new_tokens: int = 1024,
    turns: int = 4,
    gen_len: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """Each agent: one cold turn of `context_tokens` (the first half a system prompt all
    agents share), prefilled beside the other agents' cold turns and answered with one
    token, then `turns` follow-up turns of `new_tokens` each."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    system = _ids(rng, context_tokens // 2, vocab)
    own = context_tokens - len(system)
    crew = [Agent(a, system + _ids(rng, own, vocab), turns + 1) for a in range(agents)]
    done: list[Turn] = []
    decoded = 0
    steps: list[tuple[int, int, int, float]] = []  # (decodes, prompt tokens, drafts, s)
    started = time.perf_counter()

    def submit(agent: Agent) -> None:
        agent.request_id = f"agent{agent.index}-turn{agent.turn}"
        agent.submitted, agent.first_token, agent.reply = time.perf_counter(), None, []
        agent.submitted_step = engine.stats.steps
        agent.others_decoding = sum(
            1 for a in crew if a is not agent and a.request_id and a.first_token is not None
        )
        reply = rng.randint(max(1, gen_len // 2), max(1, gen_len * 3 // 2)) if agent.turn else 1
        params = SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)
        engine.add_request(agent.request_id, list(agent.tokens), params, f"agent-{agent.index}")
        by_id[agent.request_id] = agent

    by_id: dict[str, Agent] = {}
    waiting: list[Agent] = []  # between turns
    for agent in crew:
        submit(agent)
    while engine.has_work():
        before = engine.stats.steps
        deltas = engine.step()
        s = engine.stats
        if s.steps > before:
            steps.append(
                (s.last_step_decodes, s.last_step_prefill_tokens, s.last_step_draft_tokens,
                 s.last_step_seconds)
            )  # fmt: skip
        finished = []
        for delta in deltas:
            agent = by_id[delta.request_id]
            now = time.perf_counter()
            if agent.first_token is None:
                agent.first_token, agent.first_token_step = now, engine.stats.steps
            agent.reply += delta.new_token_ids
            decoded += len(delta.new_token_ids)
            if delta.finish_reason is None:
                continue
            done.append(
                Turn(
                    agent.index,
                    agent.turn,
                    len(agent.tokens),
                    delta.num_cached_tokens,
                    agent.first_token - agent.submitted,
                    now - agent.submitted,
                    agent.others_decoding,
                    agent.first_token_step - agent.submitted_step,
                )
            )
            agent.tokens += agent.reply + _ids(rng, new_tokens, vocab)
            agent.turn += 1
            agent.request_id = None
            finished.append(agent)
        # Once the whole step is counted, so an agent that finished beside it is not
        # counted as decoding; follow-ups once every agent has its context loaded.
        waiting += [a for a in finished if a.turn < a.turns_left]
        if all(a.turn > 0 for a in crew):
            for agent in waiting:
                submit(agent)
            waiting.clear()
    wall = time.perf_counter() - started
    return {**summarize(done, decoded, wall, agents), "steps": steps}


def summarize(done: list[Turn], decoded: int, wall_s: float, agents: int) -> dict[str, Any]:
    follow = [t for t in done if t.turn > 0]
    beside = [t for t in follow if t.others_decoding > 0]
    beside_all = [t for t in follow if t.others_decoding == agents - 1]

    def ttft(turns: list[Turn]) -> dict[str, float | int | None]:
        return {**median_p99([t.ttft_s for t in turns]), "count": len(turns)}

    prompt = sum(t.prompt_tokens for t in done)
    return {
        "turns": len(done),
        "prefix_hit_rate": sum(t.cached_tokens for t in done) / prompt if prompt else None,
        "prefix_hit_rate_follow_ups": (
            sum(t.cached_tokens for t in follow) / sum(t.prompt_tokens for t in follow)
            if follow
            else None
        ),
        "ttft_follow_ups": ttft(follow),
        "ttft_follow_ups_beside_decoding": ttft(beside),
        "ttft_follow_ups_beside_all_decoding": ttft(beside_all),
        "max_context": max((t.prompt_tokens for t in done), default=0),
        "decode_tokens_per_s": decoded / wall_s,
        "wall_s": wall_s,
        "per_turn": [asdict(t) for t in done],
    }


def run_agents_bench(
    model: str,
    device: str,
    dtype: str,
    agents: int = 4,
    context_tokens: int = 4096,
    new_tokens: int = 1024,
    turns: int = 4,
    gen_len: int = 32,
    kv_cache_bytes: int | None = None,
    baseline: bool = True,
    speculation: str = "auto",
) -> dict[str, Any]:
    """The same sessions with the prefix cache on, then (`baseline`) off, each on a fresh
    engine."""
    runs = {}
    for cache in (True, False) if baseline else (True,):
        engine = EngineCore(
            EngineConfig(
                model=model,
                device=device,
                dtype=dtype,
                kv_cache_bytes=kv_cache_bytes,
                enable_prefix_caching=cache,
                speculation=speculation,
            )
        )
        # A short session of its own first: first allocations and compilation are not timed.
        run_agents(engine, 1, 48, 16, 1, 4, seed=99)
        result = run_agents(engine, agents, context_tokens, new_tokens, turns, gen_len)
        runs["cache_on" if cache else "cache_off"] = result
        print(format_run("prefix cache " + ("on " if cache else "off"), result, new_tokens))
        del engine
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
    on = runs["cache_on"]["ttft_follow_ups"]["median_s"]
    off = runs["cache_off"]["ttft_follow_ups"]["median_s"] if baseline else None
    speedup = off / on if on and off else None
    if speedup is not None:
        print(f"follow-up TTFT median {speedup:.1f}x lower with the prefix cache")
    return {
        "machine": machine(),
        "model": model,
        "device": device,
        "agents": agents,
        "context_tokens": context_tokens,
        "new_tokens": new_tokens,
        "gen_len": gen_len,
        "speculation": speculation,
        "ttft_speedup_follow_ups": speedup,
        **runs,
    }


def format_run(name: str, r: dict[str, Any], new_tokens: int) -> str:
    f, b = r["ttft_follow_ups"], r["ttft_follow_ups_beside_decoding"]
    a = r["ttft_follow_ups_beside_all_decoding"]

    def sec(x: float | None) -> str:
        return seconds_text(x, 3)

    hit = r["prefix_hit_rate_follow_ups"]
    return (
        f"{name}: contexts to {r['max_context']} tokens, +{new_tokens} a turn; "
        f"hit rate {'n/a' if hit is None else f'{100 * hit:.1f}%'} of follow-up prompt tokens; "
        f"follow-up TTFT median {sec(f['median_s'])} p99 {sec(f['p99_s'])}, "
        f"{b['count']} of {f['count']} beside decoding agents (median {sec(b['median_s'])}), "
        f"{a['count']} beside all the others decoding (median {sec(a['median_s'])}); "
        f"{r['decode_tokens_per_s']:.1f} decode tok/s"
    )

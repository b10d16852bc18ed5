"""`kamado bench --gpu --surgery ...`: decode and memory per weight format on CUDA, each
against its own roofline (its own bytes read per token at the copy bandwidth measured in
the same run), and its speed relative to the unmodified bf16 model. Batch 1 is the
issue's figure; batch 4 is four agents decoding at once, where matmuls of a few input
rows take other kernels than one row.

Variants run one after another in one process, each loaded fresh. A variant whose bf16
weights would not fit on the card is reported as such rather than run.
"""

from __future__ import annotations

import gc
import time

import torch

from kamado.bench.gpu import copy_bandwidth, decode_bytes, timed_ms
from kamado.bench.throughput import kamado_throughput
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.kv.cache import bytes_per_block
from kamado.models import load_model_config, resolve_model
from kamado.models.layout import parameter_count
from kamado.surgery.pipeline import module_bytes

FIT_FRACTION = 0.9  # of the card, for bf16 weights plus KV and activations
AGENTS = 4  # the second batch size measured, unless the caller names another


def run_surgery_bench(
    model: str,
    variants: list[tuple[str, ...]],
    prompt_len: int = 512,
    gen_len: int = 128,
    rounds: int = 3,
    agents: int = AGENTS,
) -> dict:
    bandwidth = copy_bandwidth()
    total = torch.cuda.get_device_properties(0).total_memory
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, {total / 2**30:.0f} GiB on the card")
    config = load_model_config(resolve_model(model))
    bf16_bytes = parameter_count(config) * 2
    rows = []
    for surgery in [(), *variants]:
        name = ",".join(surgery) or "bf16"
        if not surgery and bf16_bytes > FIT_FRACTION * total:
            rows.append(dict(surgery=name, fits=False, weight_bytes=bf16_bytes))
            print(f"{name:8s}: {bf16_bytes / 2**30:.1f} GiB of weights: does not fit", flush=True)
            continue
        rows.append(
            _run_variant(model, surgery, config, bandwidth, prompt_len, gen_len, rounds, agents)
        )
        print(_fmt(rows[-1], agents), flush=True)
    base = rows[0] if rows[0].get("fits", True) else None
    if base is not None:
        for row in rows[1:]:
            row["speedup_vs_bf16"] = row["decode_tok_s"] / base["decode_tok_s"]
            row["graph_speedup_vs_bf16"] = row["graph_replay_tok_s"] / base["graph_replay_tok_s"]
            row["agents_speedup_vs_bf16"] = row["agents_decode_tok_s"] / base["agents_decode_tok_s"]
    _summary(rows, agents)
    return dict(
        model=model, copy_bandwidth_tb_s=bandwidth / 1e12, card_bytes=total,
        prompt_len=prompt_len, gen_len=gen_len, rounds=rounds, agents=agents, variants=rows,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )  # fmt: skip


def _run_variant(
    model: str,
    surgery: tuple[str, ...],
    config,
    bandwidth: float,
    prompt_len: int,
    gen_len: int,
    rounds: int,
    agents: int,
) -> dict:
    blocks = agents * ((prompt_len + gen_len) // 16 + 2)
    kv_bytes = int(bytes_per_block(config, 16, torch.bfloat16) * blocks)
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    engine = EngineCore(
        EngineConfig(
            model=model, device="cuda", dtype="bfloat16", kv_cache_bytes=kv_bytes,
            max_num_seqs=agents, surgery=surgery, enable_prefix_caching=False,
            speculation="off",  # one token a step, as the roofline counts
        )
    )  # fmt: skip
    load_s = time.perf_counter() - started
    net = engine.runner.model
    kamado_throughput(engine, model, 1, 16, 4)  # warm-up: Triton tuning and compiles
    rates = [kamado_throughput(engine, model, 1, prompt_len, gen_len) for _ in range(rounds)]
    decode = sorted(r.decode_tok_s for r in rates)[rounds // 2]
    context = prompt_len + gen_len // 2
    roofline = bandwidth / decode_bytes(net, config, 1, context)
    batched = [kamado_throughput(engine, model, agents, prompt_len, gen_len) for _ in range(rounds)]
    agents_roofline = agents * bandwidth / decode_bytes(net, config, agents, context)
    row = dict(
        surgery=",".join(surgery) or "bf16", fits=True, weight_bytes=module_bytes(net),
        peak_allocated_bytes=torch.cuda.max_memory_allocated(), load_s=load_s,
        steps=[r.line() for r in engine.surgery], decode_tok_s=decode,
        decode_runs=[r.decode_tok_s for r in rates], roofline_tok_s=roofline,
        fraction_of_roofline=decode / roofline,
        agents_decode_tok_s=sorted(r.decode_tok_s for r in batched)[rounds // 2],
        agents_decode_runs=[r.decode_tok_s for r in batched], agents_roofline_tok_s=agents_roofline,
    )  # fmt: skip
    graphs = engine.runner.graphs
    if graphs is not None and 1 in graphs.graphs:
        step_ms = timed_ms(graphs.graphs[1].replay, 50)
        row["graph_replay_tok_s"] = 1e3 / step_ms
        row["graph_fraction_of_roofline"] = row["graph_replay_tok_s"] / roofline
    del engine, net
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _fmt(row: dict, agents: int) -> str:
    return (
        f"{row['surgery']:8s}: {row['weight_bytes'] / 2**30:6.2f} GiB weights, decode "
        f"{row['decode_tok_s']:7.1f} tok/s (roofline {row['roofline_tok_s']:7.1f}: "
        f"{row['fraction_of_roofline']:.0%}); GPU alone {row.get('graph_replay_tok_s', 0):7.1f}"
        f"; batch {agents} {row['agents_decode_tok_s']:7.1f} tok/s"
    )


def _summary(rows: list[dict], agents: int) -> None:
    print(
        "\nweights   GiB   decode tok/s   roofline   of roofline   GPU alone   vs bf16"
        f"   batch {agents} tok/s   roofline   vs bf16"
    )
    for r in rows:
        if not r.get("fits", True):
            print(f"{r['surgery']:8s} {r['weight_bytes'] / 2**30:5.1f}   does not fit")
            continue
        speedup = f"{r['speedup_vs_bf16']:6.2f}x" if "speedup_vs_bf16" in r else "     -"
        agents = f"{r['agents_speedup_vs_bf16']:6.2f}x" if "speedup_vs_bf16" in r else "     -"
        print(
            f"{r['surgery']:8s} {r['weight_bytes'] / 2**30:5.1f}   {r['decode_tok_s']:12.1f}   "
            f"{r['roofline_tok_s']:8.1f}   {r['fraction_of_roofline']:11.0%}   "
            f"{r.get('graph_replay_tok_s', 0):9.1f}   {speedup}   "
            f"{r['agents_decode_tok_s']:13.1f}   {r['agents_roofline_tok_s']:8.1f}   {agents}"
        )

"""`kamado bench --gpu`: decode and prefill on CUDA against ceilings measured in the same run.

Decode of one token reads every weight once plus each sequence's K/V, so the copy
bandwidth measured here bounds decode tokens/s (the roofline); prefill is matrix work,
bounded by the bf16 matmul rate measured here. transformers `generate` on the same
weights runs beside kamado.
"""

from __future__ import annotations

import time

import torch

from kamado.bench.throughput import Throughput, kamado_throughput, transformers_throughput
from kamado.config import EngineConfig, ModelConfig
from kamado.engine.core import EngineCore
from kamado.kv.cache import bytes_per_block
from kamado.models import load_model_config, resolve_model
from kamado.models.layout import expected_weights
from kamado.models.reference import transformers_model
from kamado.surgery.pipeline import tensor_bytes

COPY_BYTES = 4 << 30
MATMUL_SIZE = 8192


def timed_ms(fn, reps: int) -> float:
    """Median device time of fn over reps runs, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read plus written per second."""
    src = torch.randn(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), 20)
    return 2 * COPY_BYTES / (ms / 1e3)


def matmul_flops() -> float:
    """bf16 matrix product of MATMUL_SIZE cubed on random data, FLOP per second."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    ms = timed_ms(lambda: a @ b, 20)
    return 2 * MATMUL_SIZE**3 / (ms / 1e3)


def decode_bytes(
    model: torch.nn.Module,
    config: ModelConfig,
    batch: int,
    context: int,
    kv_bytes_per_token: int | None = None,  # None: bf16 K/V
) -> int:
    """Bytes one decode step must read: every weight as stored (compressed ones too, each
    storage once) but the embedding table (a lookup reads only the batch's rows), plus each
    sequence's K/V."""
    weights = tensor_bytes(
        t
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if name != "model.embed_tokens.weight" or config.tie_word_embeddings
    )
    if kv_bytes_per_token is None:
        kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    return weights + batch * context * kv_bytes_per_token


def prefill_flops(config: ModelConfig, prompt_len: int) -> float:
    """Matrix FLOPs of a causal prefill: the layers' projections per token, and QK^T plus
    PV over half the square (the last token's logits are negligible)."""
    h, kv, d = config.hidden_size, config.num_kv_heads * config.head_dim, config.head_dim
    q = config.num_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    linear = 2 * prompt_len * config.num_layers * per_layer
    attention = config.num_layers * 2 * config.num_heads * d * prompt_len**2
    return linear + attention


def run_gpu_bench(
    model: str,
    batches: tuple[int, ...] = (1, 4, 16, 64),
    prompt_len: int = 512,
    gen_len: int = 128,
    prefill_lens: tuple[int, ...] = (8192, 32768, 131072),
    peer: bool = True,
) -> dict:
    bandwidth, flops = copy_bandwidth(), matmul_flops()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    # KV room for the longest prompt, or for every decoding sequence, with 10% to spare.
    config = load_model_config(resolve_model(model))
    tokens = max(*prefill_lens, max(batches) * (prompt_len + gen_len))
    kv_bytes = int(bytes_per_block(config, 16, torch.bfloat16) * (tokens // 16 + 1) * 1.1)
    engine = EngineCore(
        EngineConfig(
            model=model,
            device="cuda",
            dtype="bfloat16",
            kv_cache_bytes=kv_bytes,
            max_num_seqs=max(batches),
            max_num_batched_tokens=16384,
            speculation="off",  # one token a step, as the roofline counts (see bench --spec)
        )
    )
    config = engine.model_config
    net = engine.runner.model
    kamado_throughput(engine, model, 1, 16, 4)  # warm-up
    decode: list[dict] = []
    for batch in batches:
        r = kamado_throughput(engine, model, batch, prompt_len, gen_len)
        context = prompt_len + gen_len // 2
        roofline = batch * bandwidth / decode_bytes(net, config, batch, context)
        decode.append(_decode_row(r, roofline))
        if (graphs := engine.runner.graphs) is not None and batch in graphs.graphs:
            # The last step's graph replayed alone: the GPU's share of a step, no host work.
            step_ms = timed_ms(graphs.graphs[batch].replay, 20)
            decode[-1]["graph_replay_ms"] = step_ms
            decode[-1]["graph_replay_tok_s"] = batch / (step_ms / 1e3)
        print(_fmt_decode(decode[-1]), flush=True)
    prefill: list[dict] = []
    for n in prefill_lens:
        n = min(n, engine.max_model_len - 2)  # room for the prompt's two new tokens
        r = kamado_throughput(engine, model, 1, n, 2)
        seconds = n / r.prefill_tok_s
        achieved = prefill_flops(config, n) / seconds
        prefill.append(
            dict(prompt_len=n, seconds=seconds, tok_s=r.prefill_tok_s, tflops=achieved / 1e12,
                 fraction_of_matmul=achieved / flops)
        )  # fmt: skip
        print(
            f"prefill {n:6d}: {seconds:6.2f} s = {r.prefill_tok_s:8.0f} tok/s, "
            f"{achieved / 1e12:5.0f} TFLOP/s = {achieved / flops:.0%} of the matmul ceiling",
            flush=True,
        )
    peers: list[dict] = []
    if peer:
        names = expected_weights(config)  # the fused projections' views, not the fused copies
        weights = {k: v for k, v in net.state_dict().items() if k in names}
        del engine
        torch.cuda.empty_cache()
        with torch.device("cuda"):
            reference = transformers_model(config, weights, attn_implementation="sdpa")
        transformers_throughput(reference, model, 1, 16, 4, config.vocab_size, "cuda")
        for batch in batches:
            r = transformers_throughput(
                reference, model, batch, prompt_len, gen_len, config.vocab_size, "cuda"
            )
            peers.append(_decode_row(r, None))
            print(_fmt_decode(peers[-1]), flush=True)
    _summary(decode, peers)
    return dict(
        model=model,
        copy_bandwidth_tb_s=bandwidth / 1e12,
        matmul_tflops=flops / 1e12,
        decode=decode,
        transformers=peers,
        prefill=prefill,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def _decode_row(r: Throughput, roofline: float | None) -> dict:
    row = dict(engine=r.engine, batch=r.batch, prompt_len=r.prompt_len, gen_len=r.gen_len)
    row["decode_tok_s"] = r.decode_tok_s
    if roofline is not None:
        row["roofline_tok_s"] = roofline
        row["fraction_of_roofline"] = r.decode_tok_s / roofline
    return row


def _fmt_decode(row: dict) -> str:
    line = f"{row['engine']:12s} batch {row['batch']:2d}: decode {row['decode_tok_s']:8.1f} tok/s"
    if "roofline_tok_s" in row:
        line += f" (roofline {row['roofline_tok_s']:7.1f}: {row['fraction_of_roofline']:.0%})"
    if "graph_replay_ms" in row:
        line += (
            f"; GPU alone {row['graph_replay_ms']:.2f} ms/step = {row['graph_replay_tok_s']:.1f}"
        )
    return line


def _summary(decode: list[dict], peers: list[dict]) -> None:
    print("\nbatch   kamado tok/s   roofline   of roofline   transformers tok/s   speedup")
    for row in decode:
        peer = next((p for p in peers if p["batch"] == row["batch"]), None)
        peer_s = ""
        if peer is not None:
            speedup = row["decode_tok_s"] / peer["decode_tok_s"]
            peer_s = f"{peer['decode_tok_s']:18.1f}   {speedup:6.1f}x"
        print(
            f"{row['batch']:5d}   {row['decode_tok_s']:12.1f}   {row['roofline_tok_s']:8.1f}   "
            f"{row['fraction_of_roofline']:11.0%}   " + peer_s
        )

"""`kamado bench --contention`: decode speed while another process keeps a core busy (an
agent's build or test run beside the server), with the thread count pinned to all cores,
pinned to one, and following the idle cores (the default)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

from kamado.bench.report import machine
from kamado.bench.throughput import kamado_throughput
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.cpu_threads import CHECK_EVERY_S, DEFAULT_THREADS, ThreadGovernor

SETTINGS = {"all cores": DEFAULT_THREADS, "one thread": 1, "idle cores (default)": None}


def _spin() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_contention(
    model: str, dtype: str, prompt_len: int = 64, gen_len: int = 48, repeats: int = 3
) -> dict[str, Any]:
    engine = EngineCore(EngineConfig(model=model, dtype=dtype, kv_cache_bytes=256 << 20))
    rows = []
    for busy in (False, True):
        neighbour = _spin() if busy else None
        try:
            time.sleep(2 * CHECK_EVERY_S)  # the neighbour is running before any timing
            for batch in (1, 8):
                for name, fixed in SETTINGS.items():
                    engine.threads = ThreadGovernor(DEFAULT_THREADS, fixed)
                    kamado_throughput(engine, model, batch, prompt_len, 4)  # settle threads
                    runs = [
                        kamado_throughput(engine, model, batch, prompt_len, gen_len)
                        for _ in range(repeats)
                    ]
                    rows.append(
                        {
                            "neighbour_busy": busy,
                            "threads": name,
                            "threads_at_end": engine.threads.threads,
                            "batch": batch,
                            "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
                            "decode_tok_s_runs": [r.decode_tok_s for r in runs],
                        }
                    )
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
    print(format_table(rows))
    return {
        "machine": machine(),
        "load_average": os.getloadavg(),
        "model": model,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "rows": rows,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["decode tok/s, median of runs   quiet    one core busy   (threads used at end)"]
    for batch in (1, 8):
        for name in SETTINGS:
            quiet, busy = (
                next(
                    r
                    for r in rows
                    if r["batch"] == batch and r["threads"] == name and r["neighbour_busy"] == b
                )
                for b in (False, True)
            )
            q, b = quiet["decode_tok_s"], busy["decode_tok_s"]
            lines.append(
                f"batch {batch}  {name:<22} {q:7.1f}  {b:14.1f}"
                f"   ({quiet['threads_at_end']} / {busy['threads_at_end']})"
            )
    return "\n".join(lines)

"""Replay one trace against kamado with the prefix cache on and then off, in one run: each
configuration gets its own fresh `kamado serve` (and an empty disk tier)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kamado.bench.replay import format_summary, replay
from kamado.bench.trace import TraceTurn

CONFIGS = {"prefix_cache_on": [], "prefix_cache_off": ["--no-prefix-cache"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(model: str, args: list[str], log: Path, start_timeout_s: float = 600.0):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kamado.cli", "serve", "--model", model]
    cmd += ["--listen", f"127.0.0.1:{port}", *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"kamado serve exited ({proc.returncode}); see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kamado serve did not become healthy; see {log}")
                time.sleep(1)
            yield url + "/v1"
        finally:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def compare(model: str, turns: list[TraceTurn], serve_args: list[str]) -> dict[str, Any]:
    # A terminated run still stops the server it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, Any] = {}
    for name, extra in CONFIGS.items():
        with tempfile.TemporaryDirectory(prefix="kamado-replay-") as tmp:
            args = [*serve_args, *extra, "--kv-disk-dir", str(Path(tmp) / "kv")]
            log = Path(tmp) / "serve.log"
            with _server(model, args, log) as url:
                print(f"{name}: replaying {len(turns)} turns against {url}", flush=True)
                results[name] = asyncio.run(replay(url, turns))
        print(format_summary(name, results[name]), flush=True)
    on, off = (results[k]["ttft_follow_ups"]["median_s"] for k in CONFIGS)
    if on and off:
        results["follow_up_ttft_speedup"] = off / on
        print(f"median follow-up TTFT, cache off / on: {off / on:.1f}x")
    return results

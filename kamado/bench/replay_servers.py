"""Replay one trace against servers started for it, in one run: kamado with the prefix cache
on and then off (each a fresh `kamado serve` with an empty disk tier), or kamado beside a
peer OpenAI-compatible server, given by its URL or by a command that starts it."""

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from kamado.bench.replay import format_table, replay
from kamado.bench.trace import TraceTurn

CACHE_CONFIGS = {"prefix_cache_on": [], "prefix_cache_off": ["--no-prefix-cache"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log: Path, chars: int = 2000) -> str:
    return log.read_text(errors="replace")[-chars:]


def _wait_ready(proc: subprocess.Popen, ready_url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{_log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{ready_url} did not answer in {timeout_s:.0f}s:\n{_log_tail(log)}")
        time.sleep(1)


@contextlib.contextmanager
def _serving(cmd: list[str], ready_url: str, log: Path, start_timeout_s: float = 600.0):
    """Run a server in a process group of its own while the block runs, from the moment
    `ready_url` answers 200; afterwards nothing of that group is left running."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(proc, ready_url, log, start_timeout_s)
            yield
        finally:
            proc.send_signal(signal.SIGTERM)  # a clean shutdown first
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.contextmanager
def kamado_server(model: str, args: list[str], log: Path) -> Iterator[str]:
    """A fresh `kamado serve` on a free port; yields its OpenAI base URL."""
    url = f"http://127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "kamado.cli", "serve", "--model", model]
    cmd += ["--listen", url.removeprefix("http://"), *args]
    with _serving(cmd, url + "/health", log):
        yield url + "/v1"


@contextlib.contextmanager
def peer_server(command: str, log: Path) -> Iterator[str]:
    """A peer started by a shell command whose `{port}` is replaced by a free port; ready
    when its /v1/models answers. Yields its OpenAI base URL."""
    if "{port}" not in command:
        raise ValueError("the peer command must listen on {port} (it is replaced by a free port)")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/v1"
    with _serving(["bash", "-c", command.replace("{port}", str(port))], url + "/models", log):
        yield url


def _stop_on_sigterm() -> None:
    # A terminated run still stops the servers it started (the `finally` blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _replay_kamado(name: str, model: str, turns: list[TraceTurn], args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="kamado-replay-") as tmp:
        args = [*args, "--kv-disk-dir", str(Path(tmp) / "kv")]
        with kamado_server(model, args, Path(tmp) / "serve.log") as url:
            print(f"{name}: replaying {len(turns)} turns against {url}", flush=True)
            return asyncio.run(replay(url, turns))


def compare(model: str, turns: list[TraceTurn], serve_args: list[str]) -> dict[str, Any]:
    """kamado with the prefix cache on, then off."""
    _stop_on_sigterm()
    results: dict[str, Any] = {
        name: _replay_kamado(name, model, turns, [*serve_args, *extra])
        for name, extra in CACHE_CONFIGS.items()
    }
    print(format_table(results), flush=True)
    on, off = (results[k]["ttft_follow_ups"]["median_s"] for k in CACHE_CONFIGS)
    if on and off:
        results["follow_up_ttft_speedup"] = off / on
        print(f"median follow-up TTFT, cache off / on: {off / on:.1f}x")
    return results


@contextlib.contextmanager
def _peer_at(command: str | None, url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with (
        tempfile.TemporaryDirectory(prefix="kamado-peer-") as tmp,
        peer_server(command or "", Path(tmp) / "peer.log") as started,
    ):
        yield started


def compare_with_peer(
    model: str,
    turns: list[TraceTurn],
    serve_args: list[str],
    peer_name: str,
    peer_command: str | None = None,
    peer_url: str | None = None,
) -> dict[str, Any]:
    """kamado (prefix cache on), then the peer: started from `peer_command` and stopped
    after the replay, or already running at `peer_url`."""
    _stop_on_sigterm()
    kamado = _replay_kamado("kamado", model, turns, serve_args)
    with _peer_at(peer_command, peer_url) as url:
        print(f"{peer_name}: replaying {len(turns)} turns against {url}", flush=True)
        peer = asyncio.run(replay(url, turns))
    print(format_table({"kamado": kamado, peer_name: peer}), flush=True)
    where = {"command": peer_command} if peer_command else {"url": peer_url}
    return {"kamado": kamado, "peer": {"name": peer_name, **where, **peer}}

"""A real `kamado serve` process per test module, on 127.0.0.1 and a free port."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kamado-serve-{self.port}.log"
        # Its own disk tier (a later --kv-disk-dir in args wins), never the user's cache.
        self.kv_disk_dir = tempfile.mkdtemp(prefix="kamado-test-kv-")
        cmd = [sys.executable, "-m", "kamado.cli", "serve", "--model", str(model)]
        cmd += ["--listen", f"127.0.0.1:{self.port}", "--kv-cache-gb", "0.25"]
        cmd += ["--kv-disk-dir", self.kv_disk_dir, *args]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: teardown reaches the engine too
        )
        self.model = ""

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kamado serve exited ({self.proc.returncode}):\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"kamado serve did not become healthy:\n{self.log()}")

    def engine_pid(self) -> int:
        """The engine core: the server's child that is not multiprocessing's resource tracker."""
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in kids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return int(pid)
        raise RuntimeError("no engine process found")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        # Whatever is left of the group (engine core, resource tracker).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()
        shutil.rmtree(self.kv_disk_dir, ignore_errors=True)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def start_server(model: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    server = Server(model, *args, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smol_server(smollm2_path) -> Iterator[Server]:
    # float32 so that batched and unbatched greedy decoding agree exactly.
    yield from start_server(smollm2_path, "--max-model-len", "512", "--dtype", "float32")


@pytest.fixture(scope="module")
def qwen_server(qwen05_path) -> Iterator[Server]:
    # The default model: its template renders tools and tool results.
    yield from start_server(qwen05_path, "--max-model-len", "512")

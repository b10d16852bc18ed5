"""The server side's handle on the engine core, which runs in a separate process.

Python work on either side never stalls the other, and a hung or crashed core can be
killed and replaced without losing the listening socket. A reader thread turns the
core's messages into per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kamado.config import EngineConfig, ModelConfig
from kamado.engine.core import EngineStats, RequestError
from kamado.engine.engine_process import EngineInfo, run_engine_process
from kamado.engine.outputs import TokenDelta
from kamado.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine process is gone; requests in flight cannot complete."""


class EngineStartError(RuntimeError):
    pass


@dataclass
class ServerEngineStats(EngineStats):
    alive: bool = True
    busy: bool = False  # some request is waiting for tokens
    last_step_monotonic: float = 0.0  # when the core last made progress (this process's clock)


class AsyncEngine:
    def __init__(self, process: Any, conn: Any, info: EngineInfo) -> None:
        self._process = process
        self._conn = conn
        self.info = info
        self.model_config: ModelConfig = info.model_config
        self.max_model_len = info.max_model_len
        self._loop = asyncio.get_running_loop()
        self._queues: dict[str, asyncio.Queue] = {}
        self._send_lock = threading.Lock()
        self._stats = EngineStats(kv_blocks_total=info.num_blocks)
        self._last_progress = time.monotonic()
        self._alive = True
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    async def start(cls, config: EngineConfig) -> AsyncEngine:
        """Spawn the core process and wait until its model is loaded."""
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        process = ctx.Process(
            target=run_engine_process, args=(config, theirs), name="kamado-engine", daemon=True
        )
        process.start()
        theirs.close()
        try:
            message = await asyncio.to_thread(ours.recv)
        except EOFError:
            process.join(5)
            raise EngineStartError(
                f"the engine process exited during start-up (code {process.exitcode})"
            ) from None
        if message[0] == "failed":
            process.join(5)
            raise EngineStartError(message[1])
        return cls(process, ours, message[1])

    # ---- requests -------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        session: str | None = None,
        continue_from: dict[int, list[int]] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Yield the request's deltas (all choices, or those in `continue_from`: see
        EngineCore.add_request) until every one of them has finished.

        Leaving the loop early (client gone, task cancelled) aborts the request.
        """
        if not self._alive:
            raise EngineDeadError("the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        expected = params.n if continue_from is None else len(continue_from)
        finished: set[int] = set()
        try:
            self._send(("add", request_id, prompt_token_ids, params, session, continue_from))
            while len(finished) < expected:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.index in finished:
                    continue  # a delta that crossed an abort of its choice
                if item.finish_reason is not None:
                    finished.add(item.index)
                yield item
        finally:
            self._queues.pop(request_id, None)
            if len(finished) < expected and self._alive:
                self._send(("abort", request_id, None))

    async def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request, or one choice of it; its KV blocks are freed. An aborted choice
        ends its part of generate() with a delta whose finish_reason is "abort"."""
        if self._alive:
            self._send(("abort", request_id, index))
        if index is not None and (queue := self._queues.get(request_id)) is not None:
            queue.put_nowait(TokenDelta(request_id, index, [], None, "abort", 0))

    def stats(self) -> ServerEngineStats:
        return ServerEngineStats(
            **vars(self._stats),
            alive=self._alive and self._process.is_alive(),
            busy=bool(self._queues),
            last_step_monotonic=self._last_progress,
        )

    async def shutdown(self) -> None:
        if self._alive:
            with contextlib.suppress(OSError):
                self._send(("shutdown",))
        await asyncio.to_thread(self._process.join, 10)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, 5)
        self._alive = False

    # ---- plumbing ---------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                self._loop.call_soon_threadsafe(self._dispatch, message)
        except (EOFError, OSError):
            self._loop.call_soon_threadsafe(self._on_death)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, deltas, self._stats = message
            self._last_progress = time.monotonic()
            for delta in deltas:
                if (queue := self._queues.get(delta.request_id)) is not None:
                    queue.put_nowait(delta)
        elif kind == "stats":
            self._stats = message[1]
            self._last_progress = time.monotonic()
        elif kind == "rejected" and (queue := self._queues.get(message[1])) is not None:
            queue.put_nowait(RequestError(message[2]))

    def _on_death(self) -> None:
        self._alive = False
        code = self._process.exitcode
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(f"the engine process died (exit code {code})"))

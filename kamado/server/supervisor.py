"""Brings the engine core back when it dies or hangs, so an unattended server heals itself.

The HTTP side keeps its socket; requests in flight on the old core end with an error event
(streams) or a 503, and new requests get 503 + Retry-After until the new core has loaded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kamado.server.state import ServerState

log = logging.getLogger("kamado.server")


class Supervisor:
    def __init__(
        self,
        state: ServerState,
        start_engine: Callable[[], Awaitable[Any]],
        restart_after_stall_s: float,
        check_every_s: float = 1.0,
    ) -> None:
        self.state = state
        self.start_engine = start_engine
        # A hung core is restarted after this long without progress (0: never, only if dead).
        self.restart_after_stall_s = restart_after_stall_s
        self.check_every_s = check_every_s
        self.restarts = 0

    def _needs_restart(self) -> str | None:
        h = self.state.health()
        if h.status in ("engine_dead", "engine_unreachable"):
            return "the engine process died"
        stalled_for = h.detail.get("seconds_since_progress", 0.0)
        if (
            h.status == "engine_stalled"
            and self.restart_after_stall_s > 0
            and stalled_for > self.restart_after_stall_s
        ):
            return f"the engine made no progress for {stalled_for:.0f} s"
        return None

    async def restart(self, reason: str) -> None:
        log.warning("%s; restarting it", reason)
        old = self.state.engine
        try:
            await old.shutdown()  # kills it if it does not exit on its own
        except Exception as e:  # it is being replaced either way
            log.warning("engine shutdown failed: %s", e)
        while True:
            try:
                self.state.engine = await self.start_engine()
                break
            except Exception as e:
                log.error("engine restart failed (%s); retrying in 10 s", e)
                await asyncio.sleep(10)
        self.restarts += 1
        self.state.metrics.engine_restarts.inc()
        log.warning("engine restarted (%d restart(s) so far)", self.restarts)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.check_every_s)
            if reason := self._needs_restart():
                await self.restart(reason)

    async def close(self) -> None:
        await self.state.engine.shutdown()

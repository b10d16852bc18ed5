"""The engine core's own process: a plain loop of receive requests, step, send deltas.

Messages in (tuples): ("add", request_id, prompt_token_ids, params, session,
continue_from), ("abort", request_id, index | None), ("shutdown",). Messages out:
("ready", EngineInfo) or ("failed", message) once at start, then ("step", deltas, stats)
after each step, ("stats", stats) after requests change while idle, and ("rejected",
request_id, message).
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kamado.config import EngineConfig, ModelConfig
from kamado.engine.core import EngineCore, RequestError

IDLE_POLL_SECONDS = 1.0
# Fault tests: when the file this names exists at a step, the step removes it and fails.
FAULT_FILE_ENV = "KAMADO_FAULT_FILE"


@dataclass(frozen=True)
class EngineInfo:
    model_config: ModelConfig
    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    kv_cache_dtype: str  # what the KV cache stores: int8, fp8 or the model's dtype


def run_engine_process(config: EngineConfig, conn: Connection) -> None:
    logging.basicConfig(level=logging.INFO, format="engine: %(message)s")
    try:
        engine = EngineCore(config)
    except Exception as exc:  # report any load failure to the server, then exit
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(
        (
            "ready",
            EngineInfo(
                engine.model_config,
                engine.max_model_len,
                engine.num_blocks,
                config.block_size,
                str(engine.dtype).removeprefix("torch."),
                engine.kv_format.label,
            ),
        )
    )
    conn.send(("stats", engine.snapshot()))  # memory and pool state before the first step
    try:
        _loop(engine, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the server went away; nothing left to serve
    except Exception:
        traceback.print_exc()
        raise
    finally:
        engine.close()


def _loop(engine: EngineCore, conn: Connection) -> None:
    fault_file = os.environ.get(FAULT_FILE_ENV)
    while True:
        changed = False
        while conn.poll(0 if engine.has_work() else IDLE_POLL_SECONDS):
            message = conn.recv()
            kind = message[0]
            if kind == "shutdown":
                return
            changed = True
            if kind == "add":
                _, request_id, prompt, params, session, continue_from = message
                try:
                    engine.add_request(request_id, prompt, params, session, continue_from)
                except RequestError as exc:
                    conn.send(("rejected", request_id, str(exc)))
            elif kind == "abort":
                engine.abort(message[1], message[2])
        if engine.has_work():
            if fault_file:
                _inject_fault(fault_file)
            deltas = engine.step()
            conn.send(("step", deltas, engine.snapshot()))
        elif changed:
            conn.send(("stats", engine.snapshot()))


def _inject_fault(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    raise RuntimeError(f"fault injected inside a step ({FAULT_FILE_ENV})")

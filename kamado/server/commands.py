"""`kamado serve`: resolve (and pull) the model, start the engine core process, serve HTTP."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from kamado.config import EngineConfig, kamado_home

log = logging.getLogger("kamado.server")

GIB = 1 << 30


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"kamado serve: --listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _cannot_listen(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"kamado serve: {name} must be a number, got {value!r}") from None


def engine_config(args: argparse.Namespace, model_path: str) -> EngineConfig:
    return EngineConfig(
        model=model_path,
        device=os.environ.get("KAMADO_DEVICE") or _default_device(),
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_bytes=int(args.kv_cache_gb * GIB) if args.kv_cache_gb else None,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_cache,
        kv_host_bytes=None if args.kv_host_gb is None else int(args.kv_host_gb * GIB),
        kv_disk_dir=args.kv_disk_dir or str(kamado_home() / "kv-cache"),
        kv_disk_bytes=int(args.kv_disk_gb * GIB),
        cpu_threads=args.threads,
        decode_stall_factor=args.decode_stall_factor,
        short_turn_stall_factor=args.short_turn_stall_factor,
        surgery=args.surgery,
        speculation=args.speculation,
        spec_max_draft=args.spec_max_draft,
    )


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


async def _serve(
    args: argparse.Namespace,
    host: str,
    port: int,
    names: list[str],
    source,
    template_kwargs: dict[str, Any],
) -> int:
    import uvicorn

    from kamado.engine.async_engine import AsyncEngine, EngineStartError
    from kamado.models.tokenizer import load_tokenizer
    from kamado.server.app import build_app
    from kamado.server.state import ServerOptions, ServerState
    from kamado.server.streaming import HEARTBEAT_SECONDS
    from kamado.server.supervisor import Supervisor

    tokenizer = await asyncio.to_thread(load_tokenizer, source)
    if tokenizer is None:
        print("kamado serve: this model has no tokenizer (synthetic); it cannot be served.")
        return 2
    options = ServerOptions(
        model_names=names,
        max_num_seqs=args.max_num_seqs,
        max_queued=args.max_queued,
        bare_json_tool_calls=not args.no_bare_json_tool_calls,
        stall_timeout_s=_env_float("KAMADO_HEALTH_STALL_SECONDS", 120.0),
        heartbeat_s=_env_float("KAMADO_SSE_HEARTBEAT_SECONDS", HEARTBEAT_SECONDS),
        chat_template_file=args.chat_template,
        chat_template_kwargs=template_kwargs,
        tool_call_format=args.tool_call_format,
    )
    config = engine_config(args, str(source.path))
    print(f"kamado: loading {source.name} on {config.device} ...", flush=True)
    try:
        engine = await AsyncEngine.start(config)
    except EngineStartError as e:
        print(f"kamado serve: the engine failed to start: {e}", file=sys.stderr)
        return 1
    try:
        state = ServerState(engine, tokenizer, options)
    except (OSError, ValueError) as e:
        await engine.shutdown()
        print(f"kamado serve: {e}", file=sys.stderr)
        return 2
    supervisor = Supervisor(
        state,
        lambda: AsyncEngine.start(config),
        restart_after_stall_s=_env_float("KAMADO_ENGINE_RESTART_STALL_SECONDS", 600.0),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(state),
            host=host,
            port=port,
            log_level=os.environ.get("KAMADO_LOG_LEVEL", "warning").lower(),
            timeout_keep_alive=30,
            timeout_graceful_shutdown=5,
        )
    )
    server.config.load()
    server.lifespan = server.config.lifespan_class(server.config)
    # uvicorn re-raises a captured SIGTERM/SIGINT when this block exits, so the engine is
    # shut down inside it.
    with server.capture_signals():
        try:
            await server.startup()
            if not server.started or server.should_exit:
                print(f"kamado serve: could not listen on {host}:{port}", file=sys.stderr)
                return 1
            shown = f"[{host}]" if ":" in host else host
            print(
                f"kamado: serving {names[0]} ({source.path}) at http://{shown}:{port}/v1 "
                f"(context {engine.max_model_len} tokens, {engine.info.num_blocks} KV blocks "
                f"in {engine.info.kv_cache_dtype}, {engine.info.dtype})",
                flush=True,
            )
            watch = asyncio.create_task(supervisor.run(), name="engine-supervisor")
            try:
                await server.main_loop()
                await server.shutdown()
            finally:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            return 0
        finally:
            await supervisor.close()  # the current engine, which may be a restarted one


def _template_kwargs(text: str | None) -> dict[str, Any]:
    """--chat-template-kwargs: a JSON object of template variables."""
    from kamado.server.chat_template import check_template_options
    from kamado.server.errors import APIError

    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("give a JSON object, e.g. '{\"enable_thinking\": false}'")
    try:
        return check_template_options(value, "--chat-template-kwargs")
    except APIError as e:
        raise ValueError(e.message) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from kamado.models.errors import ModelLoadError
    from kamado.models.source import resolve_model

    host, port = parse_listen(args.listen)
    if problem := _cannot_listen(host, port):  # say so before minutes of model loading
        print(f"kamado serve: cannot listen on {host}:{port}: {problem}", file=sys.stderr)
        return 2
    if args.chat_template and not Path(args.chat_template).is_file():
        print(f"kamado serve: --chat-template {args.chat_template}: no such file", file=sys.stderr)
        return 2
    try:
        template_kwargs = _template_kwargs(args.chat_template_kwargs)
    except ValueError as e:
        print(f"kamado serve: --chat-template-kwargs: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="kamado: %(message)s")
    try:
        source = resolve_model(args.model, allow_pull=True)  # pulls with a progress bar
    except ModelLoadError as e:
        print(f"kamado serve: {e}", file=sys.stderr)
        return 2
    if source.path is None:
        print("kamado serve: synthetic models have no tokenizer and cannot be served.")
        return 2
    # Clients may name the model by its served name, the --model they were told, or file name.
    names = [args.served_model_name or source.name]
    names += [n for n in (args.model, source.name, source.path.name) if n not in names]
    try:
        return asyncio.run(_serve(args, host, port, names, source, template_kwargs))
    except KeyboardInterrupt:
        return 130

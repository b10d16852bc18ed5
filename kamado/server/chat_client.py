"""`kamado chat`: talk to a running server from the terminal; replies stream as they come."""

from __future__ import annotations

import argparse
import sys
from typing import Any

HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D)"


def _pick_model(client: Any, wanted: str | None) -> str:
    if wanted:
        return wanted
    models = client.models.list().data
    if not models:
        raise SystemExit("kamado chat: the server lists no models")
    return models[0].id


def _reply(
    client: Any, model: str, messages: list[dict[str, str]], args: argparse.Namespace
) -> str:
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = choice.delta.content or ""
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    if usage is not None and sys.stderr.isatty():
        cached = getattr(usage.prompt_tokens_details, "cached_tokens", 0) or 0
        sys.stderr.write(
            f"\033[2m[{usage.prompt_tokens} prompt ({cached} cached), "
            f"{usage.completion_tokens} generated]\033[0m\n"
        )
    return "".join(parts)


def cmd_chat(args: argparse.Namespace) -> int:
    import openai

    client = openai.OpenAI(base_url=args.url, api_key="kamado", max_retries=0)
    try:
        model = _pick_model(client, args.model)
    except openai.APIConnectionError:
        print(f"kamado chat: no server at {args.url}; start one with `kamado serve`")
        return 1
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print(f"kamado chat with {model} at {args.url}. {HELP}")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = list(system)
            print("(conversation cleared)")
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = _reply(client, model, messages, args)
        except KeyboardInterrupt:
            print("\n(interrupted)")
            messages.pop()
            continue
        except openai.APIError as e:
            print(f"kamado chat: {e}")
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})

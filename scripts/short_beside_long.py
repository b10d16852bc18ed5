"""How long a short request waits while another request's long prompt is prefilled alone.

Against a running server (`kamado serve`, or any OpenAI-compatible one): a long prompt
(a chat message of WORDS words, about 4 tokens each) with nothing else running, then,
DELAY seconds after it was sent, a short streamed request. Prints the short request's
time to first token and how long the long prompt took, one line per delay. Each run
starts both prompts with a fresh tag, so no cache holds their first blocks. Needs the
OpenAI client, which `scripts/setup --test` installs.

    .venv/bin/python scripts/short_beside_long.py [--url http://127.0.0.1:8091/v1]
        [--words 1300] [--delays 4 8 12]
"""

from __future__ import annotations

import argparse
import threading
import time

from openai import OpenAI


def one_run(client: OpenAI, model: str, words: int, delay: float) -> str:
    """The long prompt, the short request `delay` seconds after it; the line to print."""
    tag = f"{time.time():.6f}"
    text = f"Run {tag}. " + " ".join(f"w{(i * 7919) % 1000}" for i in range(words))
    sent = time.perf_counter()
    done: dict[str, float] = {}

    def long_prompt() -> None:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text + "\nSummarize."}],
            max_tokens=1,
        )
        done["seconds"] = time.perf_counter() - sent
        done["tokens"] = reply.usage.prompt_tokens if reply.usage else 0

    thread = threading.Thread(target=long_prompt)
    thread.start()
    time.sleep(delay)
    short_sent = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Say hi ({tag})"}],
        max_tokens=4,
        stream=True,
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - short_sent
    thread.join()
    ttft = f"{first:.2f} s" if first is not None else "none"
    return (
        f"{model}: long prompt {done['tokens']:.0f} tokens, done in {done['seconds']:.1f} s;"
        f" short sent {delay:g} s after it, first token after {ttft}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8091/v1")
    parser.add_argument("--words", type=int, default=1300)
    parser.add_argument("--delays", type=float, nargs="+", default=[4.0, 8.0, 12.0])
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key="none")
    model = client.models.list().data[0].id
    for delay in args.delays:
        print(one_run(client, model, args.words, delay), flush=True)


if __name__ == "__main__":
    main()

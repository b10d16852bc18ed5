"""A stand-in peer for `kamado replay compare --peer-command` tests: answers /v1/models and
streams a fixed three-chunk chat reply without usage, as llama-cpp-python's server streams.
Writes its pid to --pid-file and appends each request's message count to --requests-file."""

from __future__ import annotations

import argparse
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPLY = ["Hello", " from", " peer"]


def chunk(delta: dict, finish: str | None = None) -> bytes:
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    body["choices"][0]["finish_reason"] = finish
    return f"data: {json.dumps(body)}\n\n".encode()


def handler(requests_file: Path) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._send(200, "application/json", json.dumps({"data": [{"id": "fake"}]}).encode())

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with requests_file.open("a") as f:
                f.write(f"{len(request['messages'])}\n")
            stream = [chunk({"role": "assistant"})]
            stream += [chunk({"content": text}) for text in REPLY]
            stream += [chunk({}, "stop"), b"data: [DONE]\n\n"]
            self._send(200, "text/event-stream", b"".join(stream))

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pid-file", type=Path, required=True)
    parser.add_argument("--requests-file", type=Path, required=True)
    args = parser.parse_args()
    args.pid_file.write_text(str(os.getpid()))
    ThreadingHTTPServer(("127.0.0.1", args.port), handler(args.requests_file)).serve_forever()


if __name__ == "__main__":
    main()

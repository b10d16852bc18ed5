"""Where a benchmark ran, and how to keep its raw results."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(path: str | None, kind: str, results: Any) -> None:
    record = {
        "benchmark": kind,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "commit": commit(),
        "command": shlex.join(["kamado", *sys.argv[1:]]),  # quoted: runs as pasted
        "results": results,
    }
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(results_json(record))
        print(f"raw results written to {path}")


# A list of numbers only, as json.dumps(indent=2) writes it: one number a line (a JSON string
# holds no raw line break, so none is matched).
_NUMBER = r"-?\d[\d.eE+-]*"
_NUMBER_LIST = re.compile(rf"\[\n\s*({_NUMBER}(?:,\n\s*{_NUMBER})*)\n\s*\]")


def _one_line(match: re.Match[str]) -> str:
    return "[" + re.sub(r",\n\s*", ", ", match.group(1)) + "]"


def results_json(record: Any) -> str:
    """`record` as indented JSON, with each list of numbers on one line: a fairness run
    keeps thousands of rows of numbers, 2.6 times the bytes at one number a line."""
    return _NUMBER_LIST.sub(_one_line, json.dumps(record, indent=2)) + "\n"

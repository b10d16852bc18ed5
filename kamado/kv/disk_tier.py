"""The disk tier: cached KV blocks, one file each, in a size-capped directory that outlives
the process, so an evicted block (or any block, after a restart) is read back, not recomputed.

A file starts with a header naming what wrote it: the model fingerprint (model, dtype, KV
cache dtype, block layout), the block's content key, and a checksum of the payload. A file
from another model, dtype, KV cache dtype or layout is never loaded; a corrupted one is
deleted when found. When the directory outgrows its cap, the least recently used files go
first.

On CPU and unified memory the device memory is host memory, so blocks come here directly
(there is no host-RAM copy to keep); a host-RAM tier for CUDA would sit in front of this
one with the same store/load/contains calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"KAMADOKV"
VERSION = 1
# magic, version, model fingerprint, content key, payload bytes, payload checksum
HEADER = struct.Struct("<8sI16s16sQ16s")
SUFFIX = ".kvb"


def _checksum(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class DiskTier:
    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        fingerprint: bytes,
        block_bytes: int,
    ) -> None:
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes  # what KVCache.read_block returns
        self._prefix = fingerprint.hex()[:16] + "-"
        # Every .kvb file in the directory (ours or another model's), least recently used first.
        self._files: OrderedDict[Path, int] = OrderedDict()
        self._ours: dict[bytes, Path] = {}
        self.num_bytes = 0
        self.num_corrupt = 0
        self.num_removed = 0  # files deleted to stay under the cap
        self._scan()

    def __len__(self) -> int:
        return len(self._ours)

    def __contains__(self, key: bytes) -> bool:
        return key in self._ours

    def _scan(self) -> None:
        """Index what an earlier run left: read headers only; payloads are checked on load."""
        found = []
        for path in self.directory.glob("*" + SUFFIX):
            with contextlib.suppress(OSError):
                found.append((path.stat().st_mtime, path))
        for _, path in sorted(found):
            header = self._read_header(path)
            if header is None:
                self._discard(path)
                continue
            fingerprint, key = header
            self._add(path, path.stat().st_size)
            if fingerprint == self.fingerprint and path.name == self._name(key):
                self._ours[key] = path
        if self.num_corrupt:
            log.warning("disk KV tier: removed %d unreadable files", self.num_corrupt)
        self._shrink()

    def _read_header(self, path: Path) -> tuple[bytes, bytes] | None:
        try:
            with path.open("rb") as f:
                raw = f.read(HEADER.size)
        except OSError:
            return None
        if len(raw) != HEADER.size:
            return None
        magic, version, fingerprint, key, _, _ = HEADER.unpack(raw)
        if magic != MAGIC or version != VERSION:
            return None
        return fingerprint, key

    def _name(self, key: bytes) -> str:
        return self._prefix + key.hex() + SUFFIX

    def store(self, key: bytes, data: torch.Tensor) -> int:
        """Write a block's bytes unless they are here already; returns the bytes written."""
        if key in self._ours:
            self._files.move_to_end(self._ours[key])
            return 0
        payload = data.contiguous().flatten().view(torch.uint8).numpy().tobytes()
        blob = HEADER.pack(MAGIC, VERSION, self.fingerprint, key, len(payload), _checksum(payload))
        if len(blob) + len(payload) > self.capacity_bytes:
            return 0
        path = self.directory / self._name(key)
        # Written aside and renamed, so a crash never leaves a half file under the real name.
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("disk KV tier: cannot write %s: %s", path, e)
            return 0
        self._add(path, len(blob) + len(payload))
        self._ours[key] = path
        self._shrink()
        return len(payload)

    def load(self, key: bytes) -> torch.Tensor | None:
        """The block's bytes (flat uint8), or None when the file is gone or fails any check."""
        path = self._ours.get(key)
        if path is None:
            return None
        try:
            raw = path.read_bytes()
        except OSError:
            raw = b""
        payload = raw[HEADER.size :]
        if len(raw) < HEADER.size:
            self._discard(path)
            return None
        magic, version, fingerprint, stored_key, size, checksum = HEADER.unpack(raw[: HEADER.size])
        if (
            (magic, version, fingerprint, stored_key) != (MAGIC, VERSION, self.fingerprint, key)
            or size != len(payload)
            or size != self.block_bytes
            or checksum != _checksum(payload)
        ):
            self._discard(path)
            return None
        self._files.move_to_end(path)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency survives a restart
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def _discard(self, path: Path) -> None:
        log.warning("disk KV tier: ignoring and removing corrupted file %s", path.name)
        self.num_corrupt += 1
        self._forget(path)

    def _add(self, path: Path, size: int) -> None:
        self.num_bytes += size - self._files.get(path, 0)
        self._files[path] = size

    def _forget(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
        self.num_bytes -= self._files.pop(path, 0)
        if path.name.startswith(self._prefix):
            with contextlib.suppress(ValueError):
                self._ours.pop(bytes.fromhex(path.name[len(self._prefix) : -len(SUFFIX)]), None)

    def _shrink(self) -> None:
        while self.num_bytes > self.capacity_bytes and self._files:
            self._forget(next(iter(self._files)))
            self.num_removed += 1

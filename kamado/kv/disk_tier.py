"""The disk tier: cached KV blocks, one file each, in a size-capped directory that outlives
the process, so an evicted block (or any block, after a restart) is read back, not recomputed.

A file starts with a header naming what wrote it: the model fingerprint (model, dtype, KV
cache dtype, block layout), the block's content key, and a checksum of the payload. A file
from another model, dtype, KV cache dtype or layout is never loaded; a corrupted one is
deleted when found. When the directory outgrows its cap, the least recently used files go
first.

Files are written by a background thread, so a step never waits on the disk: a stored
block counts as present at once and is served from memory until its file is written.
Loads run on the caller's thread (the tier transfers' worker, beside the steps).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import struct
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

MAGIC = b"KAMADOKV"
VERSION = 1
# magic, version, model fingerprint, content key, payload bytes, payload checksum
HEADER = struct.Struct("<8sI16s16sQ16s")
SUFFIX = ".kvb"
# Blocks waiting for the writer thread; beyond this, new ones are not written (the disk is
# slower than blocks arrive) rather than held in memory.
MAX_PENDING_BYTES = 512 << 20


def _checksum(payload: np.ndarray) -> bytes:
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
        self.num_dropped = 0  # blocks not written because the writer was too far behind
        self.bytes_written = 0  # payload bytes written to files
        self._lock = threading.Lock()  # the index, shared with the writer thread
        self._pending: dict[bytes, torch.Tensor] = {}  # stored, file not written yet
        self._pending_bytes = 0
        self._queue: queue.Queue[tuple[bytes, Callable[[], None] | None]] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._scan()

    def __len__(self) -> int:
        return len(self._ours)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._ours or key in self._pending

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

    def store(
        self, key: bytes, data: torch.Tensor, written: Callable[[], None] | None = None
    ) -> int:
        """Queue a block's bytes (flat uint8, not modified until written) for writing unless
        they are here already; returns the bytes accepted. `written` runs once the writer is
        done with `data` (written or not)."""
        data = data.contiguous().view(-1).view(torch.uint8).cpu()  # a GPU block is copied here
        with self._lock:
            path = self._ours.get(key)
            if path is not None:
                self._files.move_to_end(path)
            size = data.numel()
            full = self._pending_bytes + size > MAX_PENDING_BYTES
            if path is not None or key in self._pending or full or size > self.capacity_bytes:
                self.num_dropped += full
                accepted = 0
            else:
                self._pending[key] = data
                self._pending_bytes += size
                accepted = size
        if not accepted:
            if written is not None:
                written()
            return 0
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk", daemon=True)
            self._writer.start()
        self._queue.put((key, written))
        return accepted

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            key, written = self._queue.get()
            try:
                self._write(key)
            except Exception:  # never let one bad block stop the writer
                log.exception("disk KV tier: writing a block failed")
                with self._lock:
                    data = self._pending.pop(key, None)
                    self._pending_bytes -= 0 if data is None else data.numel()
            finally:
                if written is not None:
                    written()
                self._queue.task_done()

    def _write(self, key: bytes) -> None:
        with self._lock:
            data = self._pending[key]
        payload = data.contiguous().numpy()
        header = HEADER.pack(
            MAGIC, VERSION, self.fingerprint, key, payload.nbytes, _checksum(payload)
        )
        path = self.directory / self._name(key)
        # Written aside and renamed, so a crash never leaves a half file under the real name.
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
            ok = True
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("disk KV tier: cannot write %s: %s", path, e)
            ok = False
        with self._lock:
            del self._pending[key]
            self._pending_bytes -= payload.nbytes
            if ok:
                self.bytes_written += payload.nbytes
                self._add(path, len(header) + payload.nbytes)
                self._ours[key] = path
                self._shrink()

    def load(self, key: bytes) -> torch.Tensor | None:
        """The block's bytes (flat uint8), or None when the file is gone or fails any check."""
        with self._lock:
            pending = self._pending.get(key)
            path = self._ours.get(key)
        if pending is not None:
            return pending.clone()  # its memory is the writer's (a host slot, maybe)
        if path is None:
            return None
        data = torch.empty(self.block_bytes, dtype=torch.uint8)
        try:
            with path.open("rb") as f:
                raw = f.read(HEADER.size)
                size = f.readinto(data.numpy()) if len(raw) == HEADER.size else 0
                extra = f.read(1)
        except OSError:
            raw, size, extra = b"", 0, b""
        if len(raw) < HEADER.size:
            self._discard(path)
            return None
        magic, version, fingerprint, stored_key, stored_size, checksum = HEADER.unpack(raw)
        if (
            (magic, version, fingerprint, stored_key) != (MAGIC, VERSION, self.fingerprint, key)
            or stored_size != self.block_bytes
            or size != self.block_bytes
            or extra
            or checksum != _checksum(data.numpy())
        ):
            self._discard(path)
            return None
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency survives a restart
        return data

    def _discard(self, path: Path) -> None:
        log.warning("disk KV tier: ignoring and removing corrupted file %s", path.name)
        with self._lock:
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

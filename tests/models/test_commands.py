"""`kamado pull` and `kamado models` output and exit codes."""

from __future__ import annotations

import argparse

from kamado.models.commands import cmd_models, cmd_pull


def test_models_lists_named_and_synthetic(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KAMADO_HOME", str(tmp_path))
    assert cmd_models(argparse.Namespace()) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-instruct  [default]" in out
    assert "smollm2-135m-instruct" in out and "491 MB" in out
    assert "not pulled" in out and "llama3-70b" in out and "70.55B" in out


def test_pull_then_models_shows_the_path(fake_model, downloads, capsys):
    assert cmd_pull(argparse.Namespace(name="fake")) == 0
    path = capsys.readouterr().out.strip().split(": ", 1)[1]
    cmd_models()
    assert f"pulled: {path}" in capsys.readouterr().out


def test_models_flags_a_damaged_file(fake_model, downloads, capsys):
    cmd_pull("fake")
    model, _ = fake_model
    from kamado.models.pull import model_file

    model_file(model).write_bytes(b"short")
    cmd_models()
    assert "DAMAGED" in capsys.readouterr().out


def test_pull_unknown_name_fails_with_a_message(capsys):
    assert cmd_pull("nope") == 1
    assert "error: unknown model name 'nope'" in capsys.readouterr().err

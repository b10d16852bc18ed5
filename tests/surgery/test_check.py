"""`kamado surgery check`'s speed rounds, on a real model: what they time and how."""

from __future__ import annotations

import pytest

from kamado.surgery import check

pytestmark = pytest.mark.slow


def test_speed_rounds_time_every_variant_without_speculation(smollm2_path, monkeypatch):
    measured = []

    def throughput(engine, model, batch, prompt_len, gen_len):
        measured.append((engine.speculator, batch, prompt_len))
        return real(engine, model, batch, prompt_len, gen_len)

    real = check.kamado_throughput
    monkeypatch.setattr(check, "kamado_throughput", throughput)
    results = check.run_check(str(smollm2_path), [("int8",)], new_tokens=2, speed_tokens=4)
    # Drafts accepted would depend on each variant's own output, not on its weights.
    assert measured == [(None, 1, check.SPEED_PROMPT)] * 2 * check.SPEED_ROUNDS
    for row in results["variants"]:
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0, row
    assert results["speed_prompt_tokens"] == check.SPEED_PROMPT

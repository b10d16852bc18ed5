"""16-bit matmuls on the CPU take rows in buckets, and the engine warms every bucket."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kamado.config import ModelConfig
from kamado.engine.sampling_params import SamplingParams
from kamado.models.row_buckets import bucket_rows, padded_rows, row_buckets
from kamado.models.transformer import MLP
from tests.engine.conftest import greedy, make_engine, run, tiny_hf_model


def test_a_bucket_holds_every_count_with_at_most_a_quarter_more_rows() -> None:
    for rows in range(1, 5000):
        bucket = bucket_rows(rows)
        assert rows <= bucket < 1.25 * rows or rows == bucket
        assert bucket_rows(bucket) == bucket
    assert [bucket_rows(n) for n in (8, 9, 17, 51, 195)] == [8, 10, 20, 56, 224]
    buckets = row_buckets(2048)
    assert buckets == sorted({bucket_rows(n) for n in range(1, 2049)})
    assert len(buckets) == 40 and buckets[-1] == 2048


def test_only_16_bit_inputs_on_the_cpu_are_padded() -> None:
    x = torch.randn(11, 4)
    assert padded_rows(x) is x
    padded = padded_rows(x.bfloat16())
    assert padded.shape == (12, 4)
    assert torch.equal(padded[:11], x.bfloat16()) and not padded[11:].any()


def test_a_padded_mlp_keeps_its_rows() -> None:
    torch.manual_seed(0)
    mlp = MLP(ModelConfig("qwen3", 64, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=4, num_kv_heads=2, head_dim=8))  # fmt: skip
    x = torch.randn(11, 32)
    want = mlp(x)  # float32: not padded
    got = mlp.bfloat16()(x.bfloat16())
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)


@pytest.fixture()
def recorded_rows(monkeypatch) -> list[int]:
    """Row counts of every nn.Linear call from here on."""
    rows: list[int] = []
    plain = nn.Linear.forward

    def recording(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return plain(self, x)

    monkeypatch.setattr(nn.Linear, "forward", recording)
    return rows


def test_a_bf16_engine_steps_only_at_row_counts_warmed_at_start(tmp_path, recorded_rows):
    tiny_hf_model("qwen3", tmp_path, num_hidden_layers=2)
    engine = make_engine(tmp_path, dtype="bfloat16", max_num_batched_tokens=96)
    warmed = set(recorded_rows)
    assert warmed == set(row_buckets(96)) | set(row_buckets(engine.config.max_num_seqs))
    recorded_rows.clear()
    # Prompts of uneven lengths arrive beside decodes: chunks plus decodes, 13 rows, 37...
    requests = {f"r{i}": ([5 + i] * (3 + 17 * i), greedy(6)) for i in range(5)}
    requests["sampled"] = ([9] * 40, SamplingParams(max_tokens=5, temperature=0.8, seed=1))
    out = run(engine, requests)
    assert all(len(out[r][0]) in (5, 6) for r in requests)
    assert len(set(recorded_rows)) > 3 and set(recorded_rows) <= warmed

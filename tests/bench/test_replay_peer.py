"""`kamado replay compare --peer-command`: kamado and a peer started for the run replay the
same trace; the peer is stopped afterwards, and what it did not report stays unreported.
(The stand-in peer only checks the plumbing; the real comparison is the benchmark.)"""

import json
import sys
import time
from pathlib import Path

import pytest

from kamado.bench.replay import TurnResult, format_table, summarize
from kamado.bench.replay_servers import peer_server
from kamado.bench.trace import generate_trace, write_trace
from kamado.cli import main

FAKE_PEER = Path(__file__).with_name("fake_openai_peer.py")


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """True once `pid` runs no more (exited, or a zombie waiting for its reaper)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if "State:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_server_without_usage_in_its_stream_reports_no_hit_rate_and_counts_chunks():
    peer = [
        TurnResult("a", 0, 0.5, 1.0, content_chunks=16),
        TurnResult("a", 1, 0.1, 0.4, content_chunks=4),
    ]
    s = summarize(peer, wall_s=2.0)
    assert not s["cached_tokens_reported"] and s["prefix_hit_rate"] is None
    assert s["prompt_tokens"] is None and s["generated_tokens_counted_from"] == "stream chunks"
    assert s["generated_tokens_per_s"] == 10.0
    # A server that reports zero cached tokens has a hit rate of zero, not "not reported".
    cold = [TurnResult("a", 0, 0.5, 1.0, 100, 0, 16, usage_reported=True, content_chunks=9)]
    k = summarize(cold, wall_s=2.0)
    assert k["prefix_hit_rate"] == 0.0 and k["generated_tokens_per_s"] == 8.0
    table = format_table({"kamado": k, "peer": s}).splitlines()
    hit_row = next(line for line in table if line.startswith("prefix hit rate, all turns"))
    assert hit_row.split()[-3:] == ["0.0%", "not", "reported"]
    assert "8.0" in next(line for line in table if line.startswith("generated tokens/s"))


def test_a_peer_that_fails_to_start_is_reported_with_its_output(tmp_path):
    with (
        pytest.raises(RuntimeError, match="no model here"),
        peer_server("echo no model here >&2; exit 3 # {port}", tmp_path / "peer.log"),
    ):
        pass
    with pytest.raises(ValueError, match="port"), peer_server("true", tmp_path / "peer.log"):
        pass


def test_kamado_and_a_started_peer_replay_the_same_trace_and_the_peer_is_stopped(
    qwen05_path, tmp_path, capsys
):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "vs-peer.json"
    turns = generate_trace(2, 900, 80, max_tokens=4, think_s=0.0, seed=1)
    write_trace(trace, turns)
    pid_file, requests_file = tmp_path / "peer.pid", tmp_path / "requests"
    # `; true` keeps bash waiting above the peer, so stopping it must reach the whole group.
    peer = f"{sys.executable} {FAKE_PEER} --port {{port}} --pid-file {pid_file}"
    peer += f" --requests-file {requests_file}; true"
    args = ["replay", "compare", str(trace), "--model", str(qwen05_path)]
    args += ["--serve-arg=--max-model-len", "--serve-arg=1536", "--peer-command", peer]
    assert main([*args, "--peer-name", "fake-peer", "--out", str(out)]) == 0

    assert _gone(int(pid_file.read_text()))
    sent = [int(n) for n in requests_file.read_text().split()]
    assert sorted(sent) == sorted(len(t.request["messages"]) for t in turns)
    record = json.loads(out.read_text())
    assert record["benchmark"] == "replay-vs-peer"
    kamado, peer_result = record["results"]["kamado"], record["results"]["peer"]
    assert kamado["errors"] == peer_result["errors"] == 0
    assert kamado["turns"] == peer_result["turns"] == len(turns)
    assert kamado["prefix_hit_rate_follow_ups"] > 0.7
    assert peer_result["name"] == "fake-peer" and peer_result["command"] == peer
    assert peer_result["prefix_hit_rate"] is None and not peer_result["cached_tokens_reported"]
    assert peer_result["generated_tokens_counted_from"] == "stream chunks"
    assert all(t["content_chunks"] == 3 for t in peer_result["per_turn"])
    printed = capsys.readouterr().out
    assert "fake-peer" in printed and "not reported" in printed

"""`kamado bench` runs end to end and keeps what it measured (timings are not asserted)."""

import gc
import json

import pytest

from kamado.bench import fairness, throughput
from kamado.bench.fairness import STREAMS, Gap, Streams
from kamado.cli import main
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore

TINY = "synthetic:tiny-qwen2"


def test_fairness_bench_compares_every_gap_with_the_streams_alone(tmp_path):
    out = tmp_path / "fairness.json"
    command = ["bench", "--fairness", "--model", TINY, "--prompt-len", "300"]
    assert main([*command, "--decode-stall-factor", "1.2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "fairness"
    paced, unpaced = record["results"]
    assert (paced["scheduler"], unpaced["scheduler"]) == (
        "kamado (paced)",
        "unpaced chunked prefill",
    )
    assert (paced["decode_stall_factor"], unpaced["decode_stall_factor"]) == (1.2, None)
    for r in (paced, unpaced):
        assert r["num_gaps"] > 0 and r["worst_ratio"] >= r["p99_ratio"] >= r["median_ratio"] > 0
        assert r["context_after"] > r["context_before"]  # the streams kept decoding throughout
        assert r["staged_splits"] >= 0
        worst = r["worst_gaps"][0]  # the worst gap, with the step that ended it
        assert worst["ratio"] == r["worst_ratio"] and worst["step_ms"] > 0
        for g in r["worst_gaps"] + r["alone_worst_gaps"]:
            # On a CPU no step is launched ahead: the host's work before and after the
            # forward pass and the pass itself all lie inside the gap the step ended. Nor
            # is there a device allocator to count mallocs of.
            assert g["schedule_ms"] > 0 and g["finish_ms"] > 0 and not g["ahead"]
            assert g["device_mallocs"] == 0
            assert g["stolen_ms"] >= 0 and g["waited_ms"] > -1.0  # (see lost_cpu.waited)
            assert g["gap_ms"] >= g["schedule_ms"] + g["step_ms"] + g["finish_ms"]
        steps = [g["step"] for g in r["worst_gaps"]]
        assert len(set(steps)) == len(steps)  # each step once, not once per stream
        # Every step past the target is kept, the worst ones among them.
        columns = r["over_target_columns"]
        over = {row[0]: dict(zip(columns, row, strict=True)) for row in r["over_target"]}
        # (rows are rounded to 3 places: a ratio just past 1.5 reads 1.5)
        assert list(over) == sorted(over) and all(o["ratio"] >= 1.5 for o in over.values())
        assert {g["step"] for g in r["worst_gaps"] if g["ratio"] > 1.5} <= set(over)
        # Gaps where others took little CPU time are a subset of all gaps.
        assert 0.0 <= r["quiet_worst_ratio"] <= r["worst_ratio"]
        assert r["quiet_steps_past_target"] <= len(r["over_target"])
        contexts = [context for context, _, _ in r["decode_only_beside"]]
        assert contexts == sorted(contexts)
        assert all(count >= 1 and ratio > 0 for _, count, ratio in r["decode_only_beside"])
        # Every step beside the prompt is kept, in order, the prompt done by the last one.
        rows = [dict(zip(r["step_columns"], row, strict=True)) for row in r["steps"]]
        numbers = [row["step"] for row in rows]
        assert numbers == list(range(numbers[0], numbers[0] + len(rows)))
        assert rows[-1]["prompt_done"] == 300
        assert all(row["prompt_done"] < 300 for row in rows[:-1])
        by_step = {row["step"]: row for row in rows}
        assert by_step[worst["step"]]["gap_ms"] == round(worst["gap_ms"], 1)
        assert by_step[worst["step"]]["ratio"] == pytest.approx(worst["ratio"], abs=1e-3)
        assert max(row["ratio"] for row in rows) == pytest.approx(r["worst_ratio"], abs=1e-3)
        prompt_steps = [row for row in rows if row["prefill_tokens"]]
        assert all(row["step_ms"] > 0 for row in rows) and prompt_steps
        faults = [row["minor_faults"] for row in rows]
        assert all(isinstance(f, int) and f >= 0 for f in faults)
        alone = r["alone_worst_gaps"]
        assert len(alone) == 3 and alone[0]["ratio"] == r["alone_worst_ratio"]
        assert all(g["prefill_tokens"] == 0 for g in alone)  # the streams alone
    assert len(paced["steps"]) > 1  # the paced prompt took many steps
    # Unpaced, every step beside the prompt carries prompt work: no local normal.
    assert unpaced["local"] is None
    # Unpaced, 300 tokens fit in one step; paced, a prompt takes many steps beside the streams.
    assert paced["num_gaps"] > unpaced["num_gaps"]


def test_the_streams_have_room_for_a_tight_bound_and_say_so_when_they_run_out(monkeypatch):
    default = fairness._stream_room(4096, 1.25)
    assert default == fairness._stream_room(4096, float("inf")) == 2 * 4096 + 1024
    # At 1.1 a 4k prompt took over 9,000 steps on a slow machine: past the default's room.
    assert fairness._stream_room(4096, 1.1) > 9_000 + 1024
    assert default < fairness._stream_room(4096, 1.0) < float("inf")
    # Streams that stop at max_model_len part way through the prompt: a clear error, not
    # a worst gap over the steps they were there for. Here the room is the prompt and one
    # token, the streams' own prompts leave them two tokens of it once they have decoded
    # alone, and a paced prompt of 300 takes more steps than that.
    monkeypatch.setattr(fairness, "_stream_room", lambda prompt_len, factor: prompt_len + 1)
    monkeypatch.setattr(fairness, "STREAM_PROMPT", 301 - fairness.ALONE_STEPS - 3)
    with pytest.raises(RuntimeError, match="the streams reached 301 tokens before the prompt"):
        fairness.run_fairness(TINY, "cpu", "auto", 300, compare=False)


def test_the_normal_gap_is_checked_by_steps_without_prompt_work_per_fifth():
    def gap(step: int, prompt_tokens: int) -> Gap:
        return Gap(0.1, 100 + step, 0.1, 0.0, 0.0, prompt_tokens, 0, 0.0, 2, step, 0, 0, 0.0, 0.0)

    # Ten steps: fifths of two. Decode-only steps in the first and last fifths only.
    ratios = [1.0, 3.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 1.2, 1.4]
    tokens = [0, 5, 5, 5, 5, 5, 5, 5, 0, 0]
    gaps = [(r, gap(i, t)) for i, (r, t) in enumerate(zip(ratios, tokens, strict=True))]
    assert fairness._decode_only_by_fifth(gaps) == [[100, 1, 1.0], [108.5, 2, 1.3]]


def test_each_gap_is_also_measured_against_the_nearest_steps_without_prompt_work():
    def gap(step: int, seconds: float, prompt_tokens: int) -> Gap:
        return Gap(seconds, 100 + step, seconds, 0.0, 0.0, prompt_tokens, 0, 0.0, 2, step, 0,
                   0, 0.0, 0.0)  # fmt: skip

    # Steps 0-29, every third without prompt work; the machine slows by half at step 15,
    # so those steps' gaps go from 0.1 to 0.2 s. Each step ends the gaps of two streams.
    gaps = []
    for step in range(30):
        decode_only = step % 3 == 0
        seconds = (0.1 if step < 15 else 0.2) if decode_only else 0.25
        gaps += [gap(step, seconds, 0 if decode_only else 8)] * 2
    normals = fairness._local_normals(gaps)
    assert normals is not None and len(normals) == len(gaps)
    by_step = dict(zip([g.step for g in gaps], normals, strict=True))
    # Nine of the ten decode-only steps, centred where they can be: the first nine for an
    # early step (five at 0.1 s, four at 0.2), the last nine for a late one (four and five).
    assert by_step[1] == 0.1 and by_step[28] == 0.2
    assert by_step[14] == 0.2  # centred on step 15: steps 3-27
    # Fewer decode-only steps than the window: no local normal (unpaced prefill has none).
    assert fairness._local_normals(gaps[: 2 * 24]) is None


def test_throughput_bench_runs_beside_transformers(tmp_path):
    out = tmp_path / "throughput.json"
    args = ["bench", "--model", TINY, "--prompt-len", "16", "--gen-len", "4", "--out", str(out)]
    assert main(args) == 0
    results = json.loads(out.read_text())["results"]
    engines = {(r["engine"], r["batch"]) for r in results}
    assert engines == {("kamado", 1), ("kamado", 8), ("transformers", 1), ("transformers", 8)}
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in results)


def test_throughput_bench_runs_one_batch_size_when_given(tmp_path, monkeypatch):
    # A long prompt's prefill beside transformers, without batch 8 of it; decoding a token a
    # step, as transformers does; the engines' runs alternated, the median of each kept.
    configs, calls = [], []

    def engine(config: EngineConfig) -> EngineCore:
        configs.append(config)
        return EngineCore(config)

    def recorded(name, fn):
        def run(*args, **kwargs):
            calls.append((name, args[2]))  # (engine, batch)
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(throughput, "EngineCore", engine)
    for name in ("kamado_throughput", "transformers_throughput"):
        monkeypatch.setattr(throughput, name, recorded(name, getattr(throughput, name)))
    out = tmp_path / "throughput.json"
    args = ["bench", "--model", TINY, "--prompt-len", "40", "--gen-len", "4", "--batch", "2",
            "--repeats", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["engine"], r["batch"], r["runs"]) for r in results] == [
        ("kamado", 2, 2), ("transformers", 2, 2)
    ]  # fmt: skip
    assert [c.speculation for c in configs] == ["off"]
    timed = [call for call in calls if call[1] == 2]  # the warm-ups run batch 1
    assert timed == [("kamado_throughput", 2), ("transformers_throughput", 2)] * 2


def test_throughput_rows_keep_the_median_of_each_rate():
    runs = [throughput.Throughput("kamado", "m", 1, 16, 4, p, d) for p, d in
            [(100.0, 9.0), (300.0, 7.0), (200.0, 8.0)]]  # fmt: skip
    row = throughput._median(runs)
    assert (row.prefill_tok_s, row.decode_tok_s, row.runs) == (200.0, 8.0, 3)


def test_contention_bench_times_each_thread_policy_quiet_and_beside_a_busy_process(tmp_path):
    out = tmp_path / "contention.json"
    args = ["bench", "--contention", "--model", TINY, "--prompt-len", "8", "--gen-len", "4"]
    assert main([*args, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["rows"]
    assert len(rows) == 2 * 2 * 3  # quiet and busy, batch 1 and 8, three policies
    assert all(r["decode_tok_s"] > 0 for r in rows)
    pinned_one = [r for r in rows if r["threads"] == "one thread"]
    assert all(r["threads_at_end"] == 1 for r in pinned_one)


def test_agents_bench_replays_turns_with_the_prefix_cache_on_then_off(tmp_path):
    out = tmp_path / "agents.json"
    args = ["bench", "--agents", "3", "--model", TINY, "--prompt-len", "200"]
    args += ["--new-tokens", "40", "--turns", "2", "--gen-len", "4", "--out", str(out)]
    assert main(args) == 0
    r = json.loads(out.read_text())["results"]
    on, off = r["cache_on"], r["cache_off"]
    assert on["turns"] == off["turns"] == 3 * 3  # a cold turn and 2 follow-ups per agent
    # A follow-up recomputes only its new tokens, the previous reply, and a partial block.
    assert on["prefix_hit_rate_follow_ups"] > 0.6 and off["prefix_hit_rate"] == 0

    def prompts(run: dict) -> list[tuple[int, int, int]]:
        return sorted((t["agent"], t["turn"], t["prompt_tokens"]) for t in run["per_turn"])

    assert prompts(on) == prompts(off)  # the same sessions (greedy replies are the same)
    assert r["ttft_speedup_follow_ups"] > 0


def test_spec_verify_bench_times_each_draft_length_beside_a_plain_step(tmp_path):
    out = tmp_path / "spec-verify.json"
    args = ["bench", "--spec-verify", "--model", TINY, "--prompt-len", "32", "--out", str(out)]
    assert main(args) == 0
    rows = json.loads(out.read_text())["results"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4, 16]
    for r in rows:
        assert r["decode_ms"] > 0
        assert [v["k"] for v in r["verify"]] == [1, 2, 4, 8, 16]
        assert all(v["ms"] > 0 for v in r["verify"])


@pytest.mark.slow
def test_spec_bench_compares_every_task_on_and_off(tmp_path):
    out = tmp_path / "spec.json"
    args = ["bench", "--spec", "--model", "smollm2-135m-instruct", "--gen-len", "6"]
    assert main([*args, "--repeats", "1", "--dtype", "float32", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results["summary"]) == {"edit", "agent", "prose"}
    for task in results["summary"].values():
        assert task["identical_outputs"] and task["speedup_median"] > 0
    assert {(r["task"], r["speculation"]) for r in results["runs"]} == {
        (t, s) for t in ("edit", "agent", "prose") for s in ("off", "auto")
    }


def test_spec_bench_checks_where_outputs_first_differ_for_a_rounding_tie():
    from kamado.bench.spec import SpecRun, _first_differences
    from kamado.config import EngineConfig
    from kamado.engine.core import EngineCore
    from kamado.engine.sampling_params import SamplingParams

    off = EngineCore(EngineConfig(model=TINY, dtype="float32", speculation="off"))
    prompt = [5, 6, 7, 8]
    off.add_request("ref", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    reference: list[int] = []
    while off.has_work():
        for delta in off.step():
            reference += delta.new_token_ids
    changed = reference[:2] + [(reference[2] + 1) % 100] + reference[3:]

    def run(mode: str, outputs: list[int]) -> SpecRun:
        return SpecRun("prose", mode, 0, 4, 1.0, 4.0, 4, 1.0, 0, 0, [outputs])

    found = _first_differences(
        off, {"prose": [prompt]}, [run("off", reference), run("auto", changed)], "auto"
    )
    (difference,) = found["prose"]
    assert (difference["position"], difference["off_token"]) == (2, reference[2])
    assert not difference["tie"]  # float32 random weights: the token stood alone
    assert difference["off_top"][0][0] == reference[2]


def test_structured_bench_times_constrained_and_free_decoding_at_each_batch(tmp_path):
    out = tmp_path / "structured.json"
    args = ["bench", "--structured", "--model", "smollm2-135m-instruct", "--gen-len", "6"]
    assert main([*args, "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    runs = results["runs"] if isinstance(results, dict) else results
    assert {(r["batch"], r["constrained"]) for r in runs} == {
        (b, c) for b in (1, 8) for c in (False, True)
    }
    for r in runs:
        assert r["decode_tok_s"] > 0 and r["step_ms"] > 0
        assert (r["mask_compute_ms"] > 0) == r["constrained"]


def test_the_fairness_records_stay_out_of_the_garbage_collectors_scans():
    # A long run keeps tens of thousands of gaps; tracked by the collector, they would
    # lengthen the collections whose pauses the gaps measure.
    engine = EngineCore(EngineConfig(model=TINY, device="cpu", speculation="off"))
    streams = Streams(engine)
    gaps = streams.alone(8)
    gc.collect()
    assert len(gaps) == 8 * STREAMS  # every stream decodes a token every step
    assert not any(gc.is_tracked(row) for row in streams._rows)
    assert all(isinstance(g, Gap) and g.seconds > 0 for g in streams.gaps())
    streams.close()


def test_kv_cache_bench_runs_the_formats_asked_for_beside_the_model_dtype(tmp_path):
    out = tmp_path / "kv.json"
    args = ["bench", "--kv-cache", "--model", TINY, "--dtype", "float32"]
    args += ["--kv-formats", "fp8-static,int8"]
    sizes = ["--kv-cache-gb", "0.01", "--batch", "2", "--prompt-len", "32", "--gen-len", "4"]
    assert main([*args, *sizes, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["rows"]
    assert [r["kv_cache_dtype"] for r in rows] == ["auto", "fp8-static", "int8"]
    auto, static, int8 = rows
    assert static["bytes_per_token"] * 4 == auto["bytes_per_token"]  # float32 on CPU
    assert int8["bytes_per_token"] > static["bytes_per_token"]  # its scales
    assert 0.0 <= static["agreement"] <= 1.0 and 0.0 <= static["top1_agreement"] <= 1.0
    with pytest.raises(SystemExit):  # argparse: a clear message, exit status 2
        main(["bench", "--kv-cache", "--kv-formats", "fp9"])

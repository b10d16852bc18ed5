"""Real pretrained models: greedy output with speculation is token for token the output
without it, on prompts where drafts are accepted (code being rewritten) and where they
mostly are not (prose)."""

import pytest

from kamado import LLM, SamplingParams

pytestmark = pytest.mark.slow

CODE = """def parse_rows(lines):
    rows = []
    for line in lines:
        fields = line.strip().split(",")
        rows.append({"name": fields[0], "size": int(fields[1])})
    return rows
"""
PROMPTS = [
    f"{CODE}\n# The same function, with `rows` renamed to `records`:\n",
    f"Here is a file:\n{CODE}\nRepeat the file exactly:\n",
    "Write a short story about a lighthouse keeper.",
]
NEW_TOKENS = 32


def outputs(path, speculation: str, prompts: list[str]) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype="float32", kv_cache_bytes=64 << 20, speculation=speculation)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)], llm


# SmolLM2 only: the 0.5B model decodes too slowly in float32 on a shared 2-core CPU for
# the suite; `kamado bench --spec` checks its outputs on and off (identical_outputs).
def test_greedy_output_is_unchanged_by_every_proposer(smollm2_path):
    off, _ = outputs(smollm2_path, "off", PROMPTS)
    for proposer in ("ngram", "suffix", "auto"):
        on, llm = outputs(smollm2_path, proposer, PROMPTS)
        assert on == off, proposer
        assert sum(llm.engine.snapshot().spec_accepted_tokens.values()) > NEW_TOKENS // 2


def test_a_stop_string_inside_a_step_s_tokens_cuts_text_and_tokens_alike(smollm2_path):
    """Several tokens arrive per step; those after the one that completed the stop string
    are not part of the output (token ids, text and usage match speculation off)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=["rows"])
    results = {}
    for speculation in ("off", "auto"):
        llm = LLM(
            str(smollm2_path), dtype="float32", kv_cache_bytes=64 << 20, speculation=speculation
        )
        out = llm.generate(PROMPTS[1], params)[0].outputs[0]
        results[speculation] = (out.text, out.token_ids, out.finish_reason)
    assert results["auto"] == results["off"]
    assert results["off"][2] == "stop"

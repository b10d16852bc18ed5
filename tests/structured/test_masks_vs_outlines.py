"""llguidance's token masks beside outlines-core's (an independent engine) on the same schemas.

Both constrain compact JSON ("," and ":" without spaces, outlines' whitespace_pattern="").
Along a valid instance, at every token boundary, the allowed token sets agree except where
the engines are known to differ on purpose:
- forced text: where the grammar leaves only one way on (`{"` at the start, a property name
  after `{"`), llguidance allows only the single canonical token that covers it; outlines
  allows every token that is a prefix of it. llguidance's set is then one token, inside
  outlines'.
- inside strings: llguidance allows `\\u` escapes and tokens that are pieces of multi-byte
  UTF-8 characters; outlines' regex allows neither, but allows the `\\/` escape, which
  llguidance does not. Every such token contains a backslash or a byte >= 0x80.
"""

from __future__ import annotations

import json

import pytest
import torch

from kamado.models import load_tokenizer, resolve_model
from kamado.server.token_text import byte_decoder

pytestmark = pytest.mark.slow

llguidance = pytest.importorskip("llguidance")
outlines_core = pytest.importorskip("outlines_core")

COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

CASES = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 5},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Bob", "age": 42, "tags": ["bc"]},
    ),
    (
        {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "point": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
            },
            "required": ["ok", "point"],
            "additionalProperties": False,
        },
        {"ok": True, "point": {"x": -1.5, "y": 20}},
    ),
    (
        {
            "type": "object",
            "properties": {"sha": {"type": "string", "pattern": "^[0-9a-f]{7}$"}},
            "required": ["sha"],
            "additionalProperties": False,
        },
        {"sha": "3fdc57c"},
    ),
]


BYTE_OF_CHAR = byte_decoder()


@pytest.fixture(scope="module")
def engines(qwen05_path):
    import llguidance.hf

    tok = load_tokenizer(resolve_model(str(qwen05_path)))
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    token_bytes: dict[bytes, list[int]] = {}
    for i in range(len(tok)):
        piece = tok.convert_ids_to_tokens(i)
        if i not in special and piece is not None:
            token_bytes.setdefault(bytes(BYTE_OF_CHAR[c] for c in piece), []).append(i)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    vocab = outlines_core.Vocabulary(eos, token_bytes)
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=eos)
    return tok, special, vocab, llt


def _llg_allowed(matcher, vocab_size: int) -> set[int]:
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    bits = allocate_token_bitmask(1, vocab_size)
    fill_next_token_bitmask(matcher, bits)
    unpacked = ((bits[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)
    return set(torch.nonzero(unpacked[:vocab_size]).flatten().tolist())


def _string_detail(tok, token: int) -> bool:
    raw = tok.convert_ids_to_tokens(token)
    data = bytes(BYTE_OF_CHAR[c] for c in raw)
    return b"\\" in data or any(b >= 0x80 for b in data)


@pytest.mark.parametrize(("schema", "instance"), CASES)
def test_masks_agree_with_outlines_core_along_an_instance(engines, schema, instance):
    from outlines_core.json_schema import build_regex_from_schema

    tok, special, vocab, llt = engines
    guide = outlines_core.Guide(
        outlines_core.Index(build_regex_from_schema(json.dumps(schema), ""), vocab)
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
    matcher = llguidance.LLMatcher(llt, grammar)
    ids = tok.encode(json.dumps(instance, separators=(",", ":")))
    compared = 0
    for k in range(len(ids) + 1):
        ours = _llg_allowed(matcher, len(tok)) - special
        theirs = set(guide.get_tokens()) - special
        only_ours, only_theirs = ours - theirs, theirs - ours
        forced = len(ours) == 1 and ours <= theirs
        assert all(_string_detail(tok, t) for t in only_ours), (k, only_ours)
        assert forced or all(_string_detail(tok, t) for t in only_theirs), (k, only_theirs)
        compared += len(ours & theirs)
        if k < len(ids):
            assert matcher.consume_token(ids[k])
            guide.advance(ids[k])
    assert matcher.is_accepting() and guide.is_finished()
    assert compared > 50  # the sets agreed on are not trivially small

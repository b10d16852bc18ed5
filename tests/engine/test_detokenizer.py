"""Incremental detokenization: multi-byte characters split across tokens, stop strings."""

import pytest

from kamado.engine.detokenizer import TextStream
from kamado.engine.sampling_params import SamplingParams
from kamado.models import load_tokenizer, resolve_model

TEXTS = [
    "naïve café — 東京タワー 🔥🚀 done",
    "def f(x):\n    return {'ключ': x}  # 注释 ⚙️\n",
    "emoji family: 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
]


@pytest.fixture(scope="module")
def tokenizer(qwen05_path):
    return load_tokenizer(resolve_model(str(qwen05_path)))


def stream_in_pieces(tokenizer, ids: list[int], params: SamplingParams, prompt=None):
    stream = TextStream(tokenizer, params, prompt)
    pieces = [stream.add([token]) for token in ids]
    pieces.append(stream.flush())
    return stream, pieces


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_whole_decode_and_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    # The case that matters is present: some token holds only part of a character.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    _, pieces = stream_in_pieces(tokenizer, ids, SamplingParams())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_leading_space_of_the_first_output_token_survives(tokenizer):
    prompt = tokenizer.encode("Hello")
    ids = tokenizer.encode(" world, again")
    _, pieces = stream_in_pieces(tokenizer, ids, SamplingParams(), prompt)
    assert "".join(pieces) == " world, again"


@pytest.mark.parametrize("stop", ["タワー", "🚀", "—", "done"])
def test_stop_string_cuts_before_the_match_even_across_tokens(tokenizer, stop):
    text = TEXTS[0]
    ids = tokenizer.encode(text)
    stream, pieces = stream_in_pieces(tokenizer, ids, SamplingParams(stop=["zzz", stop]))
    assert stream.stopped and stream.stop_reason == stop
    assert "".join(pieces) == text[: text.index(stop)]


def test_text_that_might_begin_a_stop_string_is_held_until_decided(tokenizer):
    params = SamplingParams(stop=["END_OF"])
    stream = TextStream(tokenizer, params)
    released = stream.add(tokenizer.encode("value END"))
    assert released == "value "  # "END" could still become the stop string
    released += stream.add(tokenizer.encode("ING"))
    released += stream.flush()
    assert released == "value ENDING" and not stream.stopped

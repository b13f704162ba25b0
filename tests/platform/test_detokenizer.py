"""Incremental detokenizer on a tiny byte-level BPE tokenizer trained in-process."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.platform.detokenizer import IncrementalDetokenizer
from loraplex.platform.request import SamplingParams

EOS = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Le café est très bon, déjà vu à la crème brûlée.",
    "中文 文本 的 测试 中文",
    "emoji 🙂 and 🚀 and 👍🏽 together 🙂🙂",
    "hello world, hello there; stop here. END of text\n\nnext paragraph",
] * 3
ALPHABET = "abcde .,\n!?éàü中文字🙂🚀👍🏽"


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, ids, params=None, prompt=(), chunks=None):
    """Feeds ids (one by one, or in the given chunk sizes); returns the detokenizer and
    the deltas it released."""
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), params or SamplingParams())
    sizes = chunks or [1] * len(ids)
    deltas, start = [], 0
    for size in sizes:
        deltas.append(detokenizer.append(ids[start : start + size]))
        start += size
    if start < len(ids):
        deltas.append(detokenizer.append(ids[start:]))
    return detokenizer, deltas


def test_multibyte_characters_span_several_tokens(tokenizer):
    ids = encode(tokenizer, "x👍🏽y")
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in ids)


@pytest.mark.parametrize("text", CORPUS[:5] + ["🚀🚀 中文字 👍🏽é", "a\n\nb", "é"])
def test_one_token_at_a_time_matches_full_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    detokenizer, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detokenizer.text == detokenizer.full_text == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert detokenizer.finished_by_stop is None


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = encode(tokenizer, "café 🙂") + [eos] + encode(tokenizer, " 中文") + [eos]
    detokenizer, deltas = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert (EOS in expected) is not skip
    assert "".join(deltas) == detokenizer.full_text == expected


def test_prompt_context_does_not_leak_into_output(tokenizer):
    prompt = encode(tokenizer, "The quick brown 中")
    output = encode(tokenizer, " fox 🙂 jumps")
    detokenizer, deltas = stream(tokenizer, output, prompt=prompt)
    assert "".join(deltas) == " fox 🙂 jumps"


def test_undecodable_bytes_are_released_eventually(tokenizer):
    lone_lead_byte = tokenizer.convert_tokens_to_ids("ä")  # byte 0xE4 in the ByteLevel alphabet
    ids = encode(tokenizer, "ok ") + [lone_lead_byte] * 30 + encode(tokenizer, " done")
    detokenizer, deltas = stream(tokenizer, ids)
    assert detokenizer.full_text == tokenizer.decode(ids)
    assert "".join(deltas) == detokenizer.text == detokenizer.full_text


def test_appends_that_always_end_mid_character_lose_nothing(tokenizer):
    """Each chunk completes one character and starts the next, so the window never ends
    on a character boundary: valid characters in flight are not invalid bytes, however
    long the window stays open (found by the property test below)."""
    text = "?字🙂字?ü字字"
    ids = encode(tokenizer, text)
    detokenizer, deltas = stream(tokenizer, ids, chunks=[3, 4, 1, 3, 2, 4])
    assert "".join(deltas) == detokenizer.text == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_full_text_keeps_an_unfinished_character(tokenizer):
    ids = encode(tokenizer, "ab🚀")
    detokenizer, _ = stream(tokenizer, ids[:-1])
    assert detokenizer.text == "ab"
    assert detokenizer.full_text == tokenizer.decode(ids[:-1])
    assert detokenizer.full_text.endswith("\ufffd")


def test_stop_string_across_token_boundaries(tokenizer):
    text = "hello world, hello there; stop here. END of text"
    ids = encode(tokenizer, text)
    params = SamplingParams(stop=("here. END",))
    detokenizer, deltas = stream(tokenizer, ids, params)
    assert detokenizer.finished_by_stop == "here. END"
    assert detokenizer.text == detokenizer.full_text == "hello world, hello there; stop "
    assert "".join(deltas) == detokenizer.text
    assert not any("here" in delta for delta in deltas[-3:])


def test_include_stop_str_in_output(tokenizer):
    ids = encode(tokenizer, "Le café est très bon, déjà vu")
    params = SamplingParams(stop=("très", "vu"), include_stop_str_in_output=True)
    detokenizer, deltas = stream(tokenizer, ids, params)
    assert detokenizer.finished_by_stop == "très"
    assert detokenizer.text == "Le café est très"
    assert "".join(deltas) == detokenizer.text


def test_earliest_stop_wins_within_one_chunk(tokenizer):
    ids = encode(tokenizer, "abc stop1 def stop2")
    params = SamplingParams(stop=("stop2", "stop1"))
    detokenizer, _ = stream(tokenizer, ids, params, chunks=[len(ids)])
    assert detokenizer.finished_by_stop == "stop1"
    assert detokenizer.text == "abc "


def test_ids_after_a_stop_are_ignored(tokenizer):
    params = SamplingParams(stop=("!",))
    detokenizer, deltas = stream(tokenizer, encode(tokenizer, "hi! more"), params)
    assert detokenizer.text == "hi"
    assert detokenizer.append(encode(tokenizer, " text")) == ""
    assert detokenizer.full_text == "hi"


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    params = SamplingParams(stop=("\n\nEND.",))
    detokenizer = IncrementalDetokenizer(tokenizer, [], params)
    assert detokenizer.append(encode(tokenizer, "one")) == "one"
    assert detokenizer.append(encode(tokenizer, "\n")) == ""
    assert detokenizer.append(encode(tokenizer, "\n")) == ""
    assert detokenizer.append(encode(tokenizer, "EN")) == ""
    assert detokenizer.text == "one"
    assert detokenizer.full_text == "one\n\nEN"
    assert detokenizer.append(encode(tokenizer, "Dless")) == "\n\nENDless"
    assert detokenizer.finished_by_stop is None
    assert detokenizer.text == "one\n\nENDless"


def test_multibyte_stop_string(tokenizer):
    params = SamplingParams(stop=("🙂",))
    ids = encode(tokenizer, "emoji 中 🙂 rest")
    detokenizer, deltas = stream(tokenizer, ids, params)
    assert detokenizer.finished_by_stop == "🙂"
    assert "".join(deltas) == detokenizer.text == "emoji 中 "


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    prompt=st.text(alphabet=ALPHABET, max_size=10),
    data=st.data(),
)
def test_random_chunks_reassemble_the_full_decode(tokenizer, text, prompt, data):
    ids = encode(tokenizer, text)
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    detokenizer, deltas = stream(tokenizer, ids, prompt=encode(tokenizer, prompt), chunks=chunks)
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in delta for delta in deltas)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    text=st.text(alphabet="ab\nc🙂", max_size=30),
    stop=st.text(alphabet="ab\nc🙂", min_size=1, max_size=4),
    include=st.booleans(),
    data=st.data(),
)
def test_random_stops_cut_at_the_first_occurrence(tokenizer, text, stop, include, data):
    ids = encode(tokenizer, text)
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=len(ids)))
    params = SamplingParams(stop=(stop,), include_stop_str_in_output=include)
    detokenizer, deltas = stream(tokenizer, ids, params, chunks=chunks)
    index = text.find(stop)
    if index < 0:
        assert detokenizer.finished_by_stop is None
        assert detokenizer.full_text == text
        assert text.startswith(detokenizer.text)
    else:
        assert detokenizer.finished_by_stop == stop
        assert detokenizer.text == text[: index + len(stop) if include else index]
    assert "".join(deltas) == detokenizer.text


def test_stop_strings_are_not_looked_for_before_min_tokens(tokenizer):
    """`hello` ends within the first tokens: with min_tokens past it, text goes on to the
    next `hello` after min_tokens, the first one stays in the text."""
    text = "hello world, hello there; stop here."
    ids = encode(tokenizer, text)
    first_end = next(i for i in range(1, len(ids)) if "hello" in tokenizer.decode(ids[:i]))
    params = SamplingParams(stop=("hello",), min_tokens=first_end + 1, max_tokens=64)
    detokenizer, deltas = stream(tokenizer, ids, params)
    assert detokenizer.finished_by_stop == "hello"
    assert detokenizer.text == "hello world, "
    assert "".join(deltas) == detokenizer.text
    early = SamplingParams(stop=("hello",))
    assert stream(tokenizer, ids, early)[0].text == ""

"""IncrementalDetokenizer with the tiny byte-level BPE tokenizer (multi-byte UTF-8 split over tokens)."""

from __future__ import annotations

import random

import pytest

from meshlm.engine.detokenizer import IncrementalDetokenizer
from meshlm.model.demo import tiny_sentencepiece_tokenizer, tiny_tokenizer

MIXED = "café 日本語 🎉 naïve"
ALPHABET = ["the", " quick", " fox", "é", "ï", "ß", "日", "本", "語", "🎉", "🙂", "👍🏽", " ", "\n", "42", ",", "Ω"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()  # a tokenizers.Tokenizer: its decode() fits the Decoder protocol


def encode(tok, text: str) -> list[int]:
    return tok.encode(text).ids


def stream(tok, ids: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tok)
    return [d.add(i) for i in ids] + [d.flush()]


def test_mixed_text_splits_characters_over_several_tokens(tok):
    # Guard: the test below is only meaningful if characters really are split.
    ids = encode(tok, MIXED)
    assert len(ids) > len(MIXED.split()) + 10
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_streaming_equals_full_decode_without_replacement_chars(tok):
    ids = encode(tok, MIXED)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == MIXED
    assert not any("\ufffd" in p for p in pieces), pieces
    assert pieces[-1] == ""  # nothing dangling for complete text


def test_text_is_emitted_as_soon_as_a_character_is_complete(tok):
    ids = encode(tok, MIXED)
    d = IncrementalDetokenizer(tok)
    shown = ""
    for k, i in enumerate(ids, 1):
        shown += d.add(i)
        prefix = tok.decode(ids[:k])
        if not prefix.endswith("\ufffd"):
            assert shown == prefix  # no lag beyond the incomplete character
        else:
            assert prefix.startswith(shown)


@pytest.mark.parametrize("seed", range(8))
def test_random_unicode_round_trips(tok, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(30))
    ids = encode(tok, text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_flush_returns_dangling_partial_character(tok):
    ids = encode(tok, "ok 🎉")
    cut = ids[:-1]  # the emoji's last byte never arrives
    d = IncrementalDetokenizer(tok)
    shown = "".join(d.add(i) for i in cut)
    assert shown == "ok "  # the partial emoji is held back...
    tail = d.flush()
    assert tail and set(tail) == {"\ufffd"}  # ...and released as replacement text at the end
    assert shown + tail == tok.decode(cut)
    assert d.flush() == ""  # only once


def test_special_tokens_are_skipped(tok):
    im_start, im_end = 1, 2  # ChatML specials of the tiny tokenizer
    ids = [im_start, *encode(tok, "héllo"), im_end, *encode(tok, " wörld")]
    pieces = stream(tok, ids)
    assert "".join(pieces) == "héllo wörld"
    assert not any("\ufffd" in p for p in pieces)


@pytest.fixture(scope="module")
def sentencepiece():
    return tiny_sentencepiece_tokenizer()  # Llama 2's kind: the decoder strips a string's first space


def test_the_first_output_token_keeps_its_space_after_the_prompt(sentencepiece):
    tok = sentencepiece
    prompt, whole = encode(tok, "Paris is the capital of"), encode(tok, "Paris is the capital of France France")
    out = whole[len(prompt):]
    assert whole[: len(prompt)] == prompt and "".join(stream(tok, out)) == "France France"  # without the prompt
    d = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join([d.add(i) for i in out] + [d.flush()]) == " France France"


def test_a_prompt_ending_inside_a_character_leaves_it_out_of_the_context(tok):
    ids = encode(tok, "ab 日本")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok, prompt_ids=ids[:cut])
    assert not tok.decode(d.ids).endswith("\ufffd")
    # The character's rest shows as replacement characters, as with no context at all; decoded after the
    # prompt's partial bytes, it was held back and then dropped (only "本" came out).
    assert "".join([d.add(i) for i in ids[cut:]] + [d.flush()]) == "".join(stream(tok, ids[cut:]))


@pytest.mark.parametrize("seed", range(3))
def test_with_a_prompt_streaming_still_equals_decoding_the_output(tok, seed):
    rng = random.Random(seed)
    prompt = encode(tok, "".join(rng.choice(ALPHABET) for _ in range(8)))
    out = encode(tok, "".join(rng.choice(ALPHABET) for _ in range(30)))
    d = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join([d.add(i) for i in out] + [d.flush()]) == tok.decode(out)

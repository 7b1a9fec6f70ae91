"""IncrementalDetokenizer with the tiny byte-level BPE tokenizer (multi-byte UTF-8 split over tokens)."""

from __future__ import annotations

import random

import pytest

from meshlm.engine.detokenizer import IncrementalDetokenizer
from meshlm.model.demo import tiny_tokenizer

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

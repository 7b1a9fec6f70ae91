"""TokenBytes and TextCursor with the tiny byte-level BPE tokenizer, which splits most non-ASCII
characters over several tokens: each token's own bytes, its text and its offset in the text."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from meshlm.api.token_bytes import TextCursor, TokenBytes
from meshlm.model.demo import IM_END, tiny_sentencepiece_tokenizer, tiny_tokenizer

MIXED = "café 日本語 🎉 naïve"


@pytest.fixture(scope="module")
def tok():
    return PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer())  # what mlx-lm's wrapper holds


def test_each_token_has_its_own_bytes_and_they_join_to_the_text(tok):
    ids = tok.encode(MIXED)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # guard: characters really are split
    raws = [TokenBytes(tok)(i) for i in ids]
    assert all(shown for _, shown in raws)
    assert b"".join(raw for raw, _ in raws) == MIXED.encode()
    assert [TokenBytes(tok)(i)[0] for i in tok.encode("é")] == [b"\xc3", b"\xa9"]


def test_a_token_starts_where_its_first_character_does(tok):
    tb, cursor = TokenBytes(tok), TextCursor()
    pieces = [cursor.advance(tb(i)[0]) for i in tok.encode(MIXED)]
    assert "".join(text for text, _ in pieces) == MIXED
    for text, offset in pieces:
        assert MIXED[offset : offset + len(text)] == text
    offsets = [offset for _, offset in pieces]
    assert offsets == sorted(offsets) and offsets[-1] < len(MIXED)
    # "é" in two tokens: both at the offset of "é"; the first completes nothing, the second all of it
    cursor = TextCursor()
    assert [cursor.advance(tb(i)[0]) for i in tok.encode("aé")] == [("a", 0), ("", 1), ("é", 1)]


def test_peek_reads_an_alternative_after_the_text_so_far_without_moving(tok):
    tb, cursor = TokenBytes(tok), TextCursor()
    first, second = tok.encode("é")
    cursor.advance(tb(first)[0])
    assert cursor.peek(tb(second)[0]) == "é" and cursor.peek(b"a") == "\ufffda"  # invalid: as the text has it
    assert cursor.offset == 0 and cursor.pending == b"\xc3"


def test_a_special_token_is_its_name_and_not_in_the_text(tok):
    tb = TokenBytes(tok)
    end = tok.convert_tokens_to_ids(IM_END)
    assert tb(end) == (IM_END.encode(), False) and tb.name(end) == IM_END


def test_sentencepiece_words_keep_their_space():
    """Llama 2's kind of tokenizer: "▁France" decodes alone to "France"; its bytes were read from that, so
    the tokens of " France France" joined to "FranceFrance" and their offsets drifted from the text."""
    tok = PreTrainedTokenizerFast(tokenizer_object=tiny_sentencepiece_tokenizer())
    ids = tok.encode("Paris is the capital of France France")
    tb, cursor = TokenBytes(tok), TextCursor()
    raws = [tb(i)[0] for i in ids]
    text = " Paris is the capital of France France"  # its first space is the decoder's to drop
    assert b"".join(raws) == text.encode()
    for raw in raws:
        piece, offset = cursor.advance(raw)
        assert text[offset:offset + len(piece)] == piece


def test_an_id_past_the_tokenizer_has_no_bytes_not_a_crash():
    """Qwen2's embedding has 151,936 rows for 151,665 tokens: ids between pass the vocabulary check, and a
    logprob entry naming one (echo, allowed_token_ids, an alternative) was a 500 (review helper-42)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer())
    assert tok.convert_ids_to_tokens(len(tok) + 10) is None
    assert TokenBytes(tok)(len(tok) + 10) == (b"", True)


def test_an_echoed_prompt_of_sentencepiece_words_keeps_its_offsets():
    """The prompt's first word ("\u2581hi") was read as " hi" while the echoed text starts "hi": every
    text_offset after it was one off (review helper-42)."""
    tok = PreTrainedTokenizerFast(tokenizer_object=tiny_sentencepiece_tokenizer())
    text = "hi there the cat"
    tb, cursor = TokenBytes(tok), TextCursor()
    cursor.leading = text
    pieces = []
    for i in tok.encode(text):
        piece, offset = cursor.advance(tb(i)[0])
        assert text[offset:offset + len(piece)] == piece
        pieces.append(piece)
    assert "".join(pieces) == text
    spaced = TextCursor()
    spaced.leading = " " + text  # a prompt that does begin with a space keeps it
    assert spaced.advance(b" hi") == (" hi", 0)

"""Each token's exact bytes, and what it adds to a choice's text: for logprobs.

A byte-level BPE token can hold part of a UTF-8 character; decoded alone it is
U+FFFD. OpenAI's `bytes` are the token's own bytes (their concatenation over
the tokens decodes to the text), so they come from the vocabulary piece, not
from the decoded string. A `TextCursor` follows one choice's text through
those bytes: where each token starts in it, and which characters it completes.
"""

from __future__ import annotations

import codecs
import re
from typing import Protocol

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


class Vocabulary(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: int) -> str: ...


def _byte_units() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a vocabulary piece."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


class TokenBytes:
    """Token id -> (its bytes, whether the text shows it). A special token (which the detokenizer skips)
    is its name's bytes, shown nowhere in the text. Cached: the API thread asks for every logprob entry."""

    def __init__(self, tokenizer: Vocabulary) -> None:
        self.tokenizer = tokenizer
        self._units = _byte_units()
        self._cache: dict[int, tuple[bytes, bool]] = {}

    def name(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def __call__(self, token_id: int) -> tuple[bytes, bool]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[bytes, bool]:
        text = self.name(token_id)
        if text and not self.tokenizer.decode([token_id], skip_special_tokens=True):
            return text.encode("utf-8"), False  # (a sentencepiece "\u2581" decodes to nothing either way)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # an id of the embedding's padding, past the tokenizer (Qwen2's 151,665
            # tokens of 151,936 rows): no text, as vLLM's detokenizer gives it; it was a 500
            return text.encode("utf-8"), True
        byte = _BYTE_PIECE.fullmatch(piece)
        units = [self._units.get(ch) for ch in piece]
        # A reading of the piece counts only if it decodes to what the tokenizer decodes (U+FFFD for a
        # part of a character): a sentencepiece word or a tokenizer that is not byte-level fails it.
        for raw in ([int(byte[1], 16)] if byte else None, None if None in units else units):
            if raw is not None and bytes(raw).decode("utf-8", "replace") == text:
                return bytes(raw), True
        # A sentencepiece word ("\u2581Paris"): its decoder drops a string's first space, so decoded alone
        # it is "Paris"; in a text it is " Paris", which the detokenizer shows (it decodes after context).
        spaced = piece.replace("\u2581", " ")
        if spaced != piece and (spaced == text or spaced[1:] == text and spaced[0] == " "):
            return spaced.encode("utf-8"), True
        return text.encode("utf-8"), True


class TextCursor:
    """One choice's text as its tokens' bytes arrive: the characters so far, and the bytes of one begun
    but not ended. A token starts where its first character does, so one that completes a character
    has that character's offset, and one holding only its first bytes has the same offset."""

    def __init__(self, specials: bool = False, as_ids: bool = False) -> None:
        self.offset = 0  # characters of the text before the next token's first
        self.pending = b""  # a character's first bytes, not yet completed
        self.specials = specials  # the text shows special tokens' names (skip_special_tokens false)
        self.as_ids = as_ids  # logprobs name tokens `token_id:N` (vLLM's return_tokens_as_token_ids)
        # An echoed prompt as the client sent it, while its tokens are read: a special token's name shows
        # where this text spells it there (not, say, a BOS the tokenizer added).
        self.echoed: str | None = None
        # The text an echoed prompt's tokens must join to (sent or decoded): a sentencepiece word leading it
        # has no space there ("hi", its piece "\u2581hi" read as " hi"), and every offset after was one off.
        self.leading: str | None = None

    def shows(self, name: str) -> bool:
        """Whether the text shows a special token's `name` next."""
        return self.specials or (self.echoed is not None and self.echoed.startswith(name, self.offset))

    def peek(self, raw: bytes) -> str:
        """The characters `raw` would complete after the text so far ("" for a part of one)."""
        return _complete(self.pending + raw)[0]

    def advance(self, raw: bytes) -> tuple[str, int]:
        """Add a token's bytes; its completed characters and its offset in the text."""
        offset = self.offset
        if offset == 0 and not self.pending and self.leading is not None and raw[:1] == b" " \
                and not self.leading.startswith(" "):
            raw = raw[1:]
        text, self.pending = _complete(self.pending + raw)
        self.offset += len(text)
        return text, offset

    def close(self) -> str:
        """End the text here (an echoed prompt's, decoded on its own): a character begun and not ended
        is U+FFFD there, as the text has it, not joined with the bytes that come next."""
        text = self.pending.decode("utf-8", "replace")
        self.pending = b""
        self.offset += len(text)
        return text


def _complete(data: bytes) -> tuple[str, bytes]:
    """`data` decoded up to an unfinished character at its end (invalid bytes as U+FFFD, as the text has
    them); the unfinished character's bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(data, final=False)
    return text, decoder.getstate()[0]

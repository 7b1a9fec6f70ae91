"""Incremental detokenization that never splits a UTF-8 character.

Byte-level BPE tokens can end mid-character; decoding a short window of
recent tokens and holding back text that ends in U+FFFD (the replacement
character) until the next token completes it keeps every emitted piece valid.
The window (prefix_offset..read_offset) follows vLLM's incremental detokenizer,
and so does its start: the prompt's last few tokens. A SentencePiece decoder
(Llama 2, Mistral) strips the space of a string's first token, so the first
output token decoded alone lost its space ("isParis").
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (vLLM's initial offset)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True, prompt_ids: list[int] = (),
                 keep: tuple[int, ...] = ()) -> None:
        """`keep`: special tokens whose text stays even when skipping the others (a thinking model's tags)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep = frozenset(keep) if skip_special_tokens else frozenset()
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        # A prompt of ids may end inside a character: its text would not be a prefix of what follows.
        while context and self._decode(context).endswith("\ufffd"):
            context.pop()
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        if not self.keep or self.keep.isdisjoint(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        # A special token is a whole piece of text: decoding around it is the same as decoding across it
        out, start = [], 0
        for i, t in enumerate(ids):
            if t in self.keep:
                out += [self.tokenizer.decode(ids[start:i], skip_special_tokens=True),
                        self.tokenizer.decode([t], skip_special_tokens=False)]
                start = i + 1
        out.append(self.tokenizer.decode(ids[start:], skip_special_tokens=True))
        return "".join(out)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (maybe empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new

    def flush(self) -> str:
        """Text still held back at the end of the sequence (a dangling partial character)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

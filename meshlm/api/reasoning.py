"""Reasoning output (`--reasoning-parser`): a thinking model's `<think>...</think>` apart from its answer.

Qwen3 and DeepSeek-R1 write their reasoning between `<think>` and `</think>`,
then the answer. vLLM's reasoning parsers hand the first to clients as the
message's `reasoning_content` and only the answer as `content`; so does this,
whole or streamed. Where the reasoning starts is read from the prompt: a chat
template that opens the think block itself (DeepSeek-R1's, Qwen3's thinking
variants) leaves the model inside it from its first token; otherwise a
`<think>` leading the output opens it, and without one the whole output is
the answer (Qwen3 with `enable_thinking: false`). Either parser name means
this one rule. A grammar (a schema, a forced tool call) applies to the answer
once the reasoning is over, as vLLM's structured outputs with a reasoning
parser: engine/grammar.py's `Constraint` follows the think tags by their
token ids, so only where they are single tokens (else it holds the whole
output, which is then not split).
"""

from __future__ import annotations

from meshlm.api.tools import partial_suffix

START, END = "<think>", "</think>"


def think_token_ids(tokenizer) -> tuple[int, int] | None:
    """`<think>` and `</think>` as single tokens (Qwen3's, DeepSeek-R1's), or None: a grammar can wait for
    the reasoning to end only by a token."""
    ids = []
    for tag in (START, END):
        i = tokenizer.convert_tokens_to_ids(tag)
        if not isinstance(i, int) or tokenizer.decode([i], skip_special_tokens=False) != tag:
            return None
        ids.append(i)
    return ids[0], ids[1]


THINK, START_STATE, ANSWER = "think", "start", "answer"  # where a chat's output starts


def prompt_state(prompt_tail: str, continued: str | None = None) -> str:
    """Where the output starts, by the prompt: THINK inside a think block the template opened (DeepSeek-R1's
    `<think>\n` after the assistant's header); ANSWER after one it closed (Qwen3's `enable_thinking: false`
    writes `<think>\n\n</think>\n\n`, and a grammar then holds the output from its first token); else
    START, where a leading `<think>` may open one. Only the template's very end counts (a user's message
    that mentions a tag is followed by the template's own text), or, with `continue_final_message`,
    the assistant's message being continued (`continued`): a think block open or closed in it (as
    vLLM's and mlx-lm's parsers read the last tag)."""
    if continued:
        opened, closed = continued.rfind(START), continued.rfind(END)
        if opened > closed:
            return THINK
        if closed >= 0:
            return ANSWER
    tail = prompt_tail.rstrip()
    if tail.endswith(START):
        return THINK
    return ANSWER if tail.endswith(END) else START_STATE


class ReasoningSplit:
    """One choice's text as it streams in, split into reasoning and answer. A possible start of a tag at
    the end is held back until the next text decides it."""

    def __init__(self, state: str) -> None:
        self.state = state  # THINK, START (a leading <think> may still come) or ANSWER
        self.buffer = ""
        self.reasoned = state == THINK  # whether there was a reasoning part at all

    def feed(self, text: str) -> tuple[str, str]:
        """New (reasoning, answer) text."""
        self.buffer += text
        reasoning = ""
        while True:
            if self.state == "start":
                lead = self.buffer.lstrip()
                if lead.startswith(START):
                    self.buffer, self.state, self.reasoned = lead[len(START):], "think", True
                    continue
                if lead.startswith(END):  # a block closed at once (its opening in the prompt): no reasoning
                    self.buffer, self.state, self.reasoned = lead[len(END):], "answer", True
                    continue
                if START.startswith(lead) or END.startswith(lead):  # nothing yet, or part of a tag: wait
                    return reasoning, ""
                self.state = "answer"
            if self.state == "think":
                at = self.buffer.find(END)
                if at >= 0:
                    reasoning += self.buffer[:at]
                    self.buffer, self.state = self.buffer[at + len(END):], "answer"
                    continue
                keep = partial_suffix(self.buffer, END)
                reasoning += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            answer, self.buffer = self.buffer, ""
            return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        held, self.buffer = self.buffer, ""
        return (held, "") if self.state == "think" else ("", held)


def split(text: str, state: str) -> tuple[str | None, str]:
    """A whole output's (reasoning, answer); reasoning None when there was none."""
    s = ReasoningSplit(state)
    r1, a1 = s.feed(text)
    r2, a2 = s.finish()
    return (r1 + r2 if s.reasoned else None), a1 + a2

"""A thinking model's reasoning apart from its answer (`--reasoning-parser`), whole and streamed in
pieces cut anywhere, tags included."""

from __future__ import annotations

import pytest

from meshlm.api.reasoning import ANSWER, START_STATE as START, THINK, ReasoningSplit, prompt_state, split


@pytest.mark.parametrize("text, thinking, want", [
    ("<think>\nweigh it\n</think>\n\nParis.", START, ("\nweigh it\n", "\n\nParis.")),
    ("  <think>a</think>b", START, ("a", "b")),
    ("Paris.", START, (None, "Paris.")),  # Qwen3 with enable_thinking false: no think block at all
    ("a <think>b</think>", START, (None, "a <think>b</think>")),  # a tag not leading the output is text
    ("weigh it</think>Paris.", THINK, ("weigh it", "Paris.")),  # the template opened the block (DeepSeek-R1)
    ("weigh it, cut off", THINK, ("weigh it, cut off", "")),  # max_tokens within the reasoning
    ("<think>all reasoning", START, ("all reasoning", "")),
    ("", START, (None, "")),
    ("<thi", START, (None, "<thi")),  # a tag's start the output ended on is answer text
    ("</think>Paris", START, ("", "Paris")),  # closed at once: vLLM's parsers answer "Paris" too
    ("<think>a</think>b", ANSWER, (None, "<think>a</think>b")),  # the prompt closed the block: all answer
])
def test_split_whole(text, thinking, want):
    assert split(text, thinking) == want


@pytest.mark.parametrize("text, thinking", [
    ("<think>\nweigh it\n</think>\n\nParis.", START),
    ("  <think>a</think>b", START),
    ("Paris. </thinking> <think>", START),
    ("weigh it</thi</think>Paris</think>.", THINK),
    ("<think></think>", START),
    ("</think>Paris", START),
])
def test_streamed_in_any_pieces_equals_whole(text, thinking):
    want = split(text, thinking)
    for size in range(1, len(text) + 1):
        s = ReasoningSplit(thinking)
        parts = [s.feed(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
        got = ("".join(r for r, _ in parts), "".join(a for _, a in parts))
        assert got == (want[0] or "", want[1]), size


def test_the_prompt_says_where_the_output_starts():
    assert prompt_state("<|im_start|>assistant\n<think>\n") == THINK
    # enable_thinking false: the block is closed, a grammar holds the output from its first token
    assert prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ANSWER
    assert prompt_state("<|im_start|>assistant\n") == START
    # Regression: a user's message mentioning the tag near the prompt's end made the whole answer reasoning.
    assert prompt_state("<|im_start|>user\nExplain <think><|im_end|>\n<|im_start|>assistant\n") == START
    # continue_final_message: the continued assistant message decides, as its last tag says
    assert prompt_state("...<think>L", continued="<think>L") == THINK
    assert prompt_state("...</think>Par", continued="<think>ok</think>Par") == ANSWER
    assert prompt_state("...Hel", continued="Hel") == START

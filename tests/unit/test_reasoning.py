"""A thinking model's reasoning apart from its answer (`--reasoning-parser`), whole and streamed in
pieces cut anywhere, tags included."""

from __future__ import annotations

import pytest

from meshlm.api.reasoning import ReasoningSplit, opens_reasoning, split


@pytest.mark.parametrize("text, thinking, want", [
    ("<think>\nweigh it\n</think>\n\nParis.", False, ("\nweigh it\n", "\n\nParis.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("Paris.", False, (None, "Paris.")),  # Qwen3 with enable_thinking false: no think block at all
    ("a <think>b</think>", False, (None, "a <think>b</think>")),  # a tag not leading the output is text
    ("weigh it</think>Paris.", True, ("weigh it", "Paris.")),  # the template opened the block (DeepSeek-R1)
    ("weigh it, cut off", True, ("weigh it, cut off", "")),  # max_tokens within the reasoning
    ("<think>all reasoning", False, ("all reasoning", "")),
    ("", False, (None, "")),
    ("<thi", False, (None, "<thi")),  # a tag's start the output ended on is answer text
])
def test_split_whole(text, thinking, want):
    assert split(text, thinking) == want


@pytest.mark.parametrize("text, thinking", [
    ("<think>\nweigh it\n</think>\n\nParis.", False),
    ("  <think>a</think>b", False),
    ("Paris. </thinking> <think>", False),
    ("weigh it</thi</think>Paris</think>.", True),
    ("<think></think>", False),
])
def test_streamed_in_any_pieces_equals_whole(text, thinking):
    want = split(text, thinking)
    for size in range(1, len(text) + 1):
        s = ReasoningSplit(thinking)
        parts = [s.feed(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
        got = ("".join(r for r, _ in parts), "".join(a for _, a in parts))
        assert got == (want[0] or "", want[1]), size


def test_the_prompt_says_whether_the_reasoning_starts_open():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not opens_reasoning("<|im_start|>assistant\n")
    # Regression: a user's message mentioning the tag near the prompt's end made the whole answer reasoning.
    assert not opens_reasoning("<|im_start|>user\nExplain <think><|im_end|>\n<|im_start|>assistant\n")

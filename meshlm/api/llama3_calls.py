"""Llama 3.1-3.3's tool-call syntax, which mlx-lm has no parser for.

Their templates ask for `{"name": function name, "parameters": dictionary of argument name and its value}`
with no marker around it: a call is the answer itself, a JSON object at its start (after an optional
`<|python_tag|>`), several joined by `;`. As vLLM's `llama3_json` streams them, an answer that starts
otherwise is text. Stricter than vLLM's whole-answer reading, which takes every object anywhere in the
text as a call and drops the text around them: an answer that is not wholly calls is all content here,
streamed or not (prose quoting a JSON example is no call, and a partial set of calls would be a wrong
answer).
"""

from __future__ import annotations

import json

PYTHON_TAG = "<|python_tag|>"
# The sentence every such template (3.1, 3.2, 3.3) uses to ask for the syntax
_ASKS = '{"name": function name, "parameters": dictionary of argument name and its value}'


def asks_for_it(template: str | None) -> bool:
    return template is not None and _ASKS in template


def call_body(text: str) -> str | None:
    """The text from the first call's `{` on, or None when `text` does not start with a call."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    return body if body.startswith("{") else None


def may_start_a_call(text: str) -> bool | None:
    """For a stream: True once `text` (the answer so far) starts with a call, False once it cannot,
    None while it may still become one (only whitespace, or part of the tag)."""
    head = text.lstrip()
    if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
        return None
    if head.startswith(PYTHON_TAG):
        rest = head[len(PYTHON_TAG):].lstrip()
        return None if not rest else rest.startswith("{")
    return head.startswith("{")


def parse_calls(body: str, decoder: json.JSONDecoder) -> list[dict]:
    """The calls in `body` (from `call_body`) as `{"name", "arguments"}` objects; ValueError when it is not
    wholly JSON objects joined by `;` (or whitespace)."""
    calls, at = [], 0
    while True:
        obj, at = decoder.raw_decode(body, at)
        if not isinstance(obj, dict):
            raise ValueError("a call is not a JSON object")
        # vLLM's parser takes `arguments` where a model writes it instead of the template's `parameters`
        args = obj["arguments"] if obj.get("arguments") is not None else obj.get("parameters", {})
        calls.append({"name": obj.get("name"), "arguments": args})
        at = _skip_space(body, at)
        if at < len(body) and body[at] == ";":
            at = _skip_space(body, at + 1)
        if at == len(body):
            return calls
        if body[at] != "{":
            raise ValueError(f"text after the calls: {body[at:at + 40]!r}")


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at

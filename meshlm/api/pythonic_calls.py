"""The pythonic tool-call syntax without markers (vLLM's `pythonic` parser: Llama 3.2's and Llama 4's
pythonic templates, Gemma 3's prompt): the answer is a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), f(x=1)]`. mlx-lm's `pythonic` parser reads the same list only between
LFM2's `<|tool_call_start|>` markers.

As with Llama 3's JSON (api/llama3_calls.py), an answer is calls only when it is wholly that list; any
other answer is content. The list is parsed, never evaluated: only literals are taken as arguments
(JSON's true/false/null too, which templates render nested values in).
"""

from __future__ import annotations

import ast
import json

# The sentence such templates (and vLLM's pythonic examples) use to ask for the syntax
_ASKS = "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
_JSON_LITERALS = {"true": True, "false": False, "null": None}


def asks_for_it(template: str | None) -> bool:
    return template is not None and _ASKS in template


def call_body(text: str) -> str | None:
    """The text from the list's `[` on, or None when `text` does not start with one."""
    body = text.lstrip()
    return body if body.startswith("[") else None


def may_start_a_call(text: str) -> bool | None:
    """For a stream: True once the answer starts with `[`, False once it cannot, None while only
    whitespace came."""
    head = text.lstrip()
    return None if not head else head.startswith("[")


def parse_calls(body: str, decoder=None) -> list[dict]:
    """The calls in `body` (from `call_body`) as `{"name", "arguments"}` objects; ValueError when it is not
    wholly a list of calls with literal keyword arguments. (`decoder`: unused, as llama3_calls takes one.)"""
    source = body.strip()
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"not a Python list of calls ({type(exc).__name__})") from None
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ValueError("not a non-empty list")
    lines = source.splitlines()
    if (tree.end_lineno, tree.end_col_offset) != (len(lines), len(lines[-1].encode("utf-8"))):
        raise ValueError("text after the list (a comment)")  # Python's parser skips comments: words all the same
    try:
        calls = [_call(node) for node in tree.elts]
    except TypeError as exc:  # a list or dict as a dict key: unhashable
        raise ValueError(f"an argument that is not JSON ({exc})") from None
    for call in calls:
        try:  # a set, bytes, a tuple key: Python literals JSON has no form for
            json.dumps(call["arguments"], allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"arguments that are not JSON ({exc})") from None
    return calls


def _call(node: ast.expr) -> dict:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("an item is not a call with keyword arguments only")
    name = _name(node.func)
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("**arguments")
        arguments[keyword.arg] = _literal(keyword.value)
    return {"name": name, "arguments": arguments}


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{_name(func.value)}.{func.attr}"
    raise ValueError("a call's function is not a name")


def _literal(node: ast.expr):
    if isinstance(node, ast.Name) and node.id in _JSON_LITERALS:
        return _JSON_LITERALS[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("**mapping in an argument")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"an argument is not a literal ({type(exc).__name__})") from None

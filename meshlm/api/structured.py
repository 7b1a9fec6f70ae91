"""A request's output constraint -> one llguidance grammar, compiled (and cached) before it is queued.

Sources, at most one per request (two is a 400: which should win is not ours to guess):
- `response_format`: `json_object` (any JSON object) or `json_schema` (OpenAI's, `strict` or not:
  the output is held to the schema either way); with `auto` tools whose syntax is JSON between markers,
  the schema's answer or calls (api/tools.py, `ToolPlan.answer_or_calls`);
- `auto` tools of which one is `strict` (and nothing above): free text, or text then calls held to their
  functions' schemas (`ToolPlan.text_or_calls`);
- `structured_outputs` (vLLM's extension): `json` (a schema), `regex`, `choice` (one of the strings),
  `grammar` (a Lark grammar in llguidance's dialect);
- tool calls that must happen (`tool_choice` `required` or a named function: api/tools.py), which
  win over `response_format` (it shapes a final answer, and this turn's answer is the call).

Building and compiling run on a worker thread, so a slow grammar never stalls the event loop (a
schema sent as a string is parsed there too, within the body's limits), and llguidance's fuel limits
bound them; whatever llguidance refuses (invalid schema, unsupported keywords, too complex) is a 400
that quotes its reason.
"""

from __future__ import annotations

import asyncio
import re

from meshlm.api.body import BodyLimits, parse_json_string
from meshlm.api.errors import bad_request
from meshlm.api.schemas import ChatCompletionRequest, StructuredOutputs, _Request
from meshlm.api.tools import ToolPlan
from meshlm.engine.grammar import JSON_OPTIONS, GrammarError, Grammars


async def request_grammar(grammars: Grammars | None, req: _Request, limits: BodyLimits,
                          tools: ToolPlan | None = None) -> str | None:
    """The llguidance grammar the request's output must match (checked to compile), or None."""
    sources = _sources(req, limits, tools)
    if not sources:
        return None
    if len(sources) > 1:
        raise bad_request(f"{' and '.join(p for p, _ in sources)} both constrain the output; give one",
                          param=sources[1][0])
    param, build = sources[0]
    if grammars is None:
        raise bad_request("this server was started without constrained output support", param=param)
    try:
        return await asyncio.to_thread(_build_and_check, grammars, build)
    except GrammarError as exc:
        raise bad_request(f"{param}: {exc}", param=param)


def _build_and_check(grammars: Grammars, build) -> str:
    grammar = build(grammars)
    grammars.check(grammar)
    return grammar


def _sources(req: _Request, limits: BodyLimits, tools: ToolPlan | None) -> list[tuple[str, object]]:
    out = []
    tools = tools if isinstance(req, ChatCompletionRequest) else None  # only chat requests take tools
    calls = tools.schema if tools is not None else None
    # A turn that must call a tool has no final answer for `response_format` to shape: that comes in a
    # later turn, as OpenAI takes both (agent SDKs send their output type on every turn, with the tools).
    # vLLM's extension `structured_outputs` is the client's own choice of grammar: with a forced call, a 400.
    rf = req.response_format if calls is None else None
    answer = None
    if rf is not None and rf.type == "json_object":
        answer = {"type": "object"}
    elif rf is not None and rf.type == "json_schema":
        answer = rf.json_schema.schema_
    if answer is not None:
        out.append(("response_format", lambda g: _answer(g, _object_schema(answer), tools)))
    so = req.structured_outputs
    if so is not None:
        # Where a schema string sits in the body: its parse is held to the limits that place has.
        place = ("guided_json", 2) if req.guided_json is not None else ("structured_outputs.json", 3)
        out.append(("structured_outputs", lambda g: _structured(g, so, place, limits)))
    if calls is not None:
        out.append(("tool_choice", lambda g: g.from_json_schema(calls)))
    if not out and tools is not None:
        # `auto` with a strict function: its calls held to their schemas; any constraint the client gave
        # wins over that (with response_format, the union above holds the calls already)
        strict = tools.text_or_calls(JSON_OPTIONS)
        if strict is not None:
            out.append(("tools", lambda g: g.from_lark(strict)))
    return out


def _answer(g: Grammars, schema: dict, tools: ToolPlan | None) -> str:
    """The schema's answer; with `auto` tools, that or calls to them in the model's syntax, as OpenAI allows
    (the schema alone would hold the output from its first token: no call could ever start)."""
    union = tools.answer_or_calls(schema, JSON_OPTIONS) if tools is not None else None
    return g.from_lark(union) if union is not None else g.from_json_schema(schema)


def _object_schema(schema: object) -> object:
    """JSON Schema's boolean schemas as llguidance takes schemas (objects): `true` (or none) allows any
    JSON value; `false` allows nothing, a request that can never be answered."""
    if schema is None or schema is True:
        return {}
    if schema is False:
        raise GrammarError("a `false` schema matches nothing")
    return schema


def _structured(g: Grammars, so: StructuredOutputs, place: tuple[str, int], limits: BodyLimits) -> str:
    if so.json_ is not None:
        schema = so.json_
        if isinstance(schema, str):
            schema = parse_json_string(schema, *place, limits)
        return g.from_json_schema(_object_schema(schema))
    if so.regex is not None:
        return g.from_regex(so.regex)
    if so.choice is not None:
        return g.from_regex("|".join(f"(?:{re.escape(c)})" for c in so.choice))
    return g.from_lark(so.grammar)

"""Tool calling: what the model is shown, what its output is held to, and how calls are read back.

`tool_choice`:
- `none` (or no tools): plain chat; the tools are not rendered.
- `auto` (the default when tools are given): the tools go through the model's chat template and the
  model's own tool-call syntax is parsed out of its text with mlx-lm's parser for that template
  (`mlx_lm.tool_parsers`), or meshlm's for syntaxes without markers (`llama3_calls`: Llama 3's bare
  JSON; `pythonic_calls`: a bare list of calls). A template that cannot render tools, or asks for a
  syntax none of them reads, gets the FALLBACK_PROMPT as a system message instead, and its calls are
  read in that prompt's `<tool_call>{json}</tool_call>` syntax.
- `required`: the output is grammar-constrained to a JSON array of calls
  `[{"name": ..., "arguments": {...}}]`, each valid against its function's parameters (one call
  unless `parallel_tool_calls`), as vLLM does.
- a named function: the output is constrained to that function's arguments object, streamed as it
  comes (as OpenAI and vLLM do).

A response whose calls are whole has `tool_calls` and `finish_reason: "tool_calls"`. Output cut short by
max_tokens or a stop string keeps the reason that cut it: a named call then has the arguments written so
far (as OpenAI's API returns them), `required` no call and no content (as vLLM: its array cannot be read).
"""

from __future__ import annotations

import decimal
import json
import logging
import math
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Callable

from meshlm.api import llama3_calls, pythonic_calls
from meshlm.api.schemas import ChatCompletionRequest, NamedToolChoice
from meshlm.model.chat_templates import rendering_template, template_texts
from meshlm.platform import import_mlx_lm

json_tools = import_mlx_lm("mlx_lm.tool_parsers.json_tools")

log = logging.getLogger(__name__)

# The fallback syntax is mlx-lm's `json_tools` one (Hermes-style), so its parser reads it.
FALLBACK_START, FALLBACK_END = json_tools.tool_call_start, json_tools.tool_call_end
FALLBACK_PROMPT = (
    "You can call the functions described below. To call one, answer with nothing but\n"
    f'{FALLBACK_START}{{"name": <function name>, "arguments": <arguments as a JSON object>}}{FALLBACK_END}\n'
    "(one such block per call). Otherwise answer normally.\n\nFunctions:\n{tools}"
)


# meshlm's readers of syntaxes without markers, by the name native_syntax gives them
LEADING = {"llama3": llama3_calls, "pythonic": pythonic_calls}


def _any_object() -> dict:
    return {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    tools: tuple[dict, ...]  # OpenAI tool objects, as the template receives them
    named: str | None = None
    parallel: bool = True
    start: str | None = None  # the tool-call syntax parsed in `auto` mode
    end: str | None = None
    parser: Callable | None = field(default=None, compare=False)
    short_ids: bool = False  # call ids of 9 letters and digits, which Mistral's templates require back
    # No markers: a call is the answer itself (llama3_calls: Llama 3's JSON; pythonic_calls: a Python list),
    # read by this module's call_body, may_start_a_call and parse_calls
    leading: object | None = field(default=None, compare=False)

    @property
    def schema(self) -> dict | None:
        """The JSON schema the output is held to (None: free text, `auto`)."""
        if self.mode == "named":
            return self._parameters()[self.named]
        if self.mode != "required":
            return None
        call, defs = self._one_call()
        return {"type": "array", "items": call, "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "$defs": defs}

    def _one_call(self) -> tuple[dict, dict]:
        """One call to any of the tools, `{"name": ..., "arguments": ...}`, and the `$defs` its refs need."""
        params = self._parameters()
        # Each function's parameters sit in the root's `$defs`, their local refs rebased there: nested in
        # place, a `#/$defs/...` (or `#`) ref inside them would point into the combined schema instead.
        defs = {f"tool-{n}": _rebase(p, f"/$defs/tool-{n}") for n, p in params.items()}
        call = {"anyOf": [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                           "properties": {"name": {"const": n}, "arguments": {"$ref": f"#/$defs/tool-{n}"}}}
                          for n in params]}
        return call, defs

    def _parameters(self) -> dict[str, dict]:
        """Each tool's `parameters` schema by name (a function without any takes any object)."""
        return {t["function"]["name"]: t["function"].get("parameters") or _any_object() for t in self.tools}

    def answer_or_calls(self, answer: dict, json_options: dict) -> str | None:
        """`auto` tools with a `response_format`: a Lark grammar (llguidance's) for either the answer the
        schema `answer` describes or calls in the model's syntax, each held to its function's `parameters`
        (what OpenAI allows). Only for a syntax of JSON calls between text markers (the fallback prompt's
        and mlx-lm's json_tools, Hermes' and Qwen's); None for any other, whose calls this cannot spell."""
        if not self._spells_calls():
            return None
        calls = "call+" if self.parallel else "call"
        return "\n".join([
            "start: answer | calls",
            f"answer: %json {_embedded(answer, json_options)}",
            f"calls: {calls}",
            f"call: {json.dumps(self.start)} call_rest",
            *self._call_rules(json_options),
        ])

    def text_or_calls(self, json_options: dict) -> str | None:
        """`auto` tools of which one is `strict`: a Lark grammar for free text, or text then calls in the
        model's syntax held to their functions' `parameters`, so that a strict function's arguments match
        its schema (OpenAI's promise; its client parses them into the function's model). None where
        `answer_or_calls` would be None, or where no function is strict (free text as before)."""
        if not self._spells_calls() or not any(t["function"].get("strict") for t in self.tools):
            return None
        more = " more*" if self.parallel else ""
        return "\n".join([
            f"start: prose | lead call_rest{more}",
            "prose: /(?s:.*)/",
            # ends at the first start marker, which it takes: a marker in the text always begins a call
            f"lead[stop={json.dumps(self.start)}]: /(?s:.*)/",
            f"more: {json.dumps(self.start)} call_rest",
            *self._call_rules(json_options),
        ])

    def _spells_calls(self) -> bool:
        """A syntax these grammars can spell: JSON calls between text markers."""
        return self.mode == "auto" and self.parser is json_tools.parse_tool_call and bool(self.start and self.end)

    def _call_rules(self, json_options: dict) -> list[str]:
        """One call after its start marker: optional newlines around the JSON, then the end marker."""
        call, defs = self._one_call()
        return [f'call_rest: "\\n"? body "\\n"? {json.dumps(self.end)}',
                f"body: %json {_embedded({**call, '$defs': defs}, json_options)}"]

    # -- reading calls back ------------------------------------------------
    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls in OpenAI's shape) from the whole output of one choice."""
        if self.mode != "auto":
            return None, self._forced_calls(text)
        return self._parsed_calls(text)

    def _forced_calls(self, text: str) -> list[dict]:
        """`required`: the calls, or none if the output was cut short (max_tokens, a stop string or token):
        the grammar's JSON is complete only at its end, so a cut array never parses, and it is not content
        either (the model was not free to write it). Named: the call, its arguments as far as they go."""
        if self.mode == "named":
            return [_call(self.named, text, self.short_ids)] if text else []
        items = _json_or_text(text, _EXACT)
        if not isinstance(items, list):
            return []
        found = [_usable(c, self.names, self.short_ids) for c in items]
        return found if found and None not in found else []

    def finish_reason(self, reason: str | None, calls: list[dict]) -> str | None:
        """The finish_reason of a choice that made `calls`: "tool_calls" once they are whole, else the
        reason that cut them (a named call's arguments cut by max_tokens or a stop string; in `auto`, any
        end but the model's own)."""
        if self.mode == "auto":
            return "tool_calls" if reason == "stop" else reason
        if self.mode == "named" and not isinstance(_json_or_text(calls[0]["function"]["arguments"], _EXACT),
                                                   dict):
            return reason
        return "tool_calls"  # whole: `required` calls are returned only then

    def _parsed_calls(self, text: str) -> tuple[str | None, list[dict]]:
        """`auto`: the calls in the model's own syntax; the text around them is the content, verbatim
        (a stream has sent the text before the first call as it came; vLLM does not strip it either)."""
        if self.leading:
            return self._leading_calls(text)
        if self.start is None or self.start not in text:
            return text, []
        outside, calls, rest = [], [], text
        while self.start in rest:
            at = rest.index(self.start)
            outside.append(rest[:at])
            body = rest[at + len(self.start):]
            cut = body.find(self.end) if self.end else -1
            segment, rest = (body, "") if cut < 0 else (body[:cut], body[cut + len(self.end):])
            try:
                parsed = self.parser(segment, list(self.tools))
            except Exception as exc:  # the model's own text: anything can be wrong with it
                log.info("unparsable tool call left as text (%s: %s)", type(exc).__name__, exc)
                return text, []
            found = self._usable_all(parsed if isinstance(parsed, list) else [parsed], segment)
            if found is None:
                return text, []
            calls += found
        return "".join(outside) + rest or None, self._at_most_one(calls)

    def _leading_calls(self, text: str) -> tuple[str | None, list[dict]]:
        """A syntax without markers: the answer is wholly calls (content None, as vLLM), or all content."""
        body = self.leading.call_body(text)
        if body is None:
            return text, []
        try:
            parsed = self.leading.parse_calls(body, _DECODER)
        except (ValueError, RecursionError, TypeError) as exc:  # the model's own text: anything can be wrong
            log.info("tool call left as text (%s: %.200s)", type(exc).__name__, exc)
            return text, []
        found = self._usable_all(parsed, body)
        return (text, []) if found is None else (None, self._at_most_one(found))

    def _usable_all(self, parsed: list, segment: str) -> list[dict] | None:
        """The calls, or None unless every one is usable: a partial set of calls would be a wrong answer."""
        found = [_usable(c, self.names, self.short_ids) for c in parsed]
        if not found or None in found:
            log.info("tool call left as text: not a call to one of the request's tools: %.200r", segment)
            return None
        return found

    def _at_most_one(self, calls: list[dict]) -> list[dict]:
        if not self.parallel and len(calls) > 1:  # the client asked for one at most: the first, as vLLM does
            log.info("parallel_tool_calls is false: %d of the model's %d calls dropped", len(calls) - 1, len(calls))
            return calls[:1]
        return calls

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)


def _embedded(schema: dict, json_options: dict) -> str:
    """A schema inlined in a Lark grammar (`%json`), with JSON's layout options; the schema's own
    x-guidance options win, as for a schema compiled alone."""
    return json.dumps({**schema, "x-guidance": {**json_options, **schema.get("x-guidance", {})}}, ensure_ascii=False)


# JSON Schema keywords whose value is a schema or a list of schemas, and those whose value maps names to
# schemas; every other keyword's value is data (`const`, `enum`, `default`...), never rewritten.
_SUBSCHEMA = frozenset({"items", "prefixItems", "additionalItems", "additionalProperties", "unevaluatedItems",
                        "unevaluatedProperties", "contains", "propertyNames", "not", "if", "then", "else",
                        "allOf", "anyOf", "oneOf"})
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                             "dependencies"})


def _rebase(schema: object, base: str) -> object:
    """A copy of `schema` with each local ref (`#` or `#/...`) prefixed by the JSON pointer `base`, for a
    schema moved from a document's root to `base`. Other refs (`#anchor`, URLs) are left alone, and so is a
    schema with an `$id`: it is a resource of its own, against which its `#...` refs resolve wherever it is."""
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    out = dict(schema)
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + base + ref[1:]
    for key in _SUBSCHEMA.intersection(schema):
        value = schema[key]
        out[key] = [_rebase(s, base) for s in value] if isinstance(value, list) else _rebase(value, base)
    for key in _SUBSCHEMA_MAPS.intersection(schema):
        if isinstance(schema[key], dict):
            out[key] = {name: _rebase(s, base) for name, s in schema[key].items()}
    return out


def _is_object(arguments: str) -> bool:
    return isinstance(_json_or_text(arguments), dict)


def _usable(parsed: object, names: frozenset[str], short_ids: bool = False) -> dict | None:
    """The OpenAI call for one parsed call, or None when it is not a call the client can run: not an
    object, no string name, a name not among the request's tools, or arguments not a JSON object
    (missing arguments are `{}`: a function without parameters is often called so). `short_ids`: a
    Mistral model's own id (9 letters and digits) is kept, as mlx-lm's server keeps it."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or parsed["name"] not in names:
        return None
    args = parsed.get("arguments", {})
    if not (_is_object(args) if isinstance(args, str) else isinstance(args, dict)):
        return None
    if not isinstance(args, str):
        try:  # arguments are a JSON string: NaN and Infinity (or 1e999, parsed to inf) are not JSON
            args = _dumps_exact(args)
        except (ValueError, TypeError):  # TypeError: a parser's value JSON has no form for
            return None
    call = _call(parsed["name"], args, short_ids)
    own = parsed.get("id")
    if short_ids and isinstance(own, str) and len(own) == SHORT_ID_CHARS and own.isascii() and own.isalnum():
        call["id"] = own
    return call


SHORT_ID_CHARS = 9
_ID_ALPHABET = string.ascii_letters + string.digits


def _call(name: str, arguments: str, short_ids: bool = False) -> dict:
    call_id = ("".join(secrets.choice(_ID_ALPHABET) for _ in range(SHORT_ID_CHARS)) if short_ids
               else f"call_{uuid.uuid4().hex[:24]}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _short_id(call_id: str | None) -> str | None:
    """A past call's id as Mistral's templates take it: its last 9 letters and digits (as vLLM truncates
    them); one with fewer is left for the template to refuse, naming it."""
    if call_id is None:
        return None
    kept = "".join(c for c in call_id if c.isascii() and c.isalnum())
    return kept[-SHORT_ID_CHARS:] if len(kept) >= SHORT_ID_CHARS else call_id


def _past_arguments(arguments: str) -> object:
    """A past call's arguments for the template: an object where they are JSON, and `{}` where a client
    sent none ("" or "null", as vLLM maps them): templates iterate them as a mapping."""
    if not arguments.strip() or arguments.strip() == "null":
        return {}
    return _json_or_text(arguments)


def plan_tools(req: ChatCompletionRequest, tokenizer) -> ToolPlan | None:
    """None when the request has no tools or `tool_choice` is none."""
    if not req.tools or req.tool_choice == "none":
        return None
    tools = tuple(t.model_dump(exclude_none=True) for t in req.tools)
    parallel, short_ids = req.parallel_tool_calls is not False, _mistral(tokenizer)
    if isinstance(req.tool_choice, NamedToolChoice):
        return ToolPlan("named", tools, named=req.tool_choice.function.name, parallel=parallel, short_ids=short_ids)
    if req.tool_choice == "required":
        return ToolPlan("required", tools, parallel=parallel, short_ids=short_ids)
    syntax = native_syntax(tokenizer, with_tools=True)
    if syntax == "mlx-lm":
        return ToolPlan("auto", tools, parallel=parallel, start=tokenizer.tool_call_start,
                        end=tokenizer.tool_call_end, parser=tokenizer.tool_parser, short_ids=short_ids)
    if syntax in LEADING:
        return ToolPlan("auto", tools, parallel=parallel, leading=LEADING[syntax], short_ids=short_ids)
    return ToolPlan("auto", tools, parallel=parallel, start=FALLBACK_START, end=FALLBACK_END,
                    parser=json_tools.parse_tool_call, short_ids=short_ids)


def native_syntax(tokenizer, with_tools: bool) -> str | None:
    """How tools and past calls reach the model: through its template, the one that renders this request
    (`tool_use` of a named set when tools are passed), when it describes tools and their syntax is read
    by mlx-lm's parser ("mlx-lm") or one of meshlm's without markers ("llama3", "pythonic"; --tool-call-parser
    names one whatever the template). Otherwise (None) meshlm's
    fallback prompt and syntax: a template showing tools in a syntax nothing reads had the model's calls
    come back as text, and a named set's `default` dropped past calls."""
    template = rendering_template(tokenizer, with_tools)
    if template is None or "tools" not in template:
        return None
    forced = getattr(tokenizer, "_meshlm_tool_syntax", None)  # --tool-call-parser
    if forced is not None:
        return forced
    if getattr(tokenizer, "tool_parser", None) is not None:
        return "mlx-lm"
    return leading_syntax(template)


def leading_syntax(template: str | None) -> str | None:
    """The name (a key of LEADING) of the marker-less syntax `template` asks for, if any."""
    return next((name for name, reader in LEADING.items() if reader.asks_for_it(template)), None)


def _mistral(tokenizer) -> bool:
    """Mistral's templates refuse a past call whose id is not 9 letters and digits."""
    return getattr(getattr(tokenizer, "tool_parser", None), "__module__", "") == "mlx_lm.tool_parsers.mistral"


def keep_tool_markers(req, plan: ToolPlan | None, tokenizer):
    """`req`, decoding its special tokens when its tool-call markers are special tokens (Mistral's
    `[TOOL_CALLS]`): skipped from the text, they left the calls as content. As vLLM's parsers do, unless
    the client set skip_special_tokens itself."""
    if plan is None or plan.mode != "auto" or "skip_special_tokens" in req.model_fields_set:
        return req
    for marker in (plan.start, plan.end):
        if marker and tokenizer.decode(tokenizer.encode(marker, add_special_tokens=False),
                                       skip_special_tokens=True) != marker:
            return req.model_copy(update={"skip_special_tokens": False})
    return req


def _template_knows_developer(tokenizer) -> bool:
    return any("developer" in t for t in template_texts(tokenizer))


def template_messages(req: ChatCompletionRequest, plan: ToolPlan | None, tokenizer) -> tuple[list[dict], dict]:
    """Messages (and extra template arguments) for the chat template."""
    native = native_syntax(tokenizer, with_tools=plan is not None) is not None
    developer = _template_knows_developer(tokenizer)
    ids = _short_id if _mistral(tokenizer) else (lambda i: i)
    messages = []
    for m in req.messages:
        # OpenAI's `developer` is the system message of its newer models; a template that does not know the
        # role rendered it as a turn of an unknown speaker, after its own default system prompt
        role = "system" if m.role == "developer" and not developer else m.role
        msg: dict = {"role": role, "content": m.text()}
        if m.tool_calls:
            calls = [{"id": ids(c.id), "type": "function",
                      "function": {"name": c.function.name, "arguments": _past_arguments(c.function.arguments)}}
                     for c in m.tool_calls]
            if native:
                msg["tool_calls"] = calls
            else:  # a template without tools support sees the calls in the fallback syntax
                msg["content"] += "".join(
                    f"{FALLBACK_START}{json.dumps(c['function'], ensure_ascii=False)}{FALLBACK_END}" for c in calls)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = ids(m.tool_call_id)
        if m.name is not None:
            msg["name"] = m.name
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None and m.role == "assistant":
            msg["reasoning_content"] = reasoning
        messages.append(msg)
    if plan is None:
        return messages, {}
    if native:
        return messages, {"tools": list(plan.tools)}
    prompt = FALLBACK_PROMPT.replace("{tools}", "\n".join(json.dumps(t["function"], ensure_ascii=False)
                                                          for t in plan.tools))
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages, {}


def _finite(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):  # 1e999: JSON's syntax, but no client's JSON parser holds it either
        raise ValueError(f"{number} overflows a double")
    return value


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_not_json)
# What a forced call's grammar wrote: JSON by construction, where a number may still be past a double
# (1e999 is JSON's syntax; the grammar bounds no exponent), which _DECODER would refuse and so drop the
# calls: its numbers are kept exact instead, and written back as numbers (_dumps_exact).
_EXACT = json.JSONDecoder(parse_float=decimal.Decimal, parse_int=decimal.Decimal, parse_constant=_not_json)


def _dumps_exact(value: object) -> str:
    """JSON as json.dumps writes it (", " and ": "), numbers exactly as parsed: 1.4E+425 stays a number
    (json.dumps has no form for it but Infinity, which is not JSON)."""
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dict):  # a key that is not a string as json.dumps writes it: 1 -> "1", None -> "null"
        return "{" + ", ".join(f"{json.dumps(k if isinstance(k, str) else json.dumps(k), ensure_ascii=False)}: "
                               f"{_dumps_exact(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_dumps_exact(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _json_or_text(text: str, decoder: json.JSONDecoder = _DECODER) -> object:
    """`text` parsed as JSON, or `text` itself where it is not JSON (a model's or a client's string: templates
    expect past calls' arguments as objects). Nested past the parser's stack is not JSON either, nor NaN,
    Infinity or, with `_DECODER`, a number past a double, which Python's parser takes as infinity: calls made
    of them went out with arguments such as '{"a": Infinity}' (`_EXACT` keeps such numbers exact instead)."""
    try:
        return decoder.decode(text)
    except (ValueError, RecursionError):
        return text


class ToolStream:
    """One streamed choice's deltas: a named call streams its arguments as they come; `required` calls
    are sent at the end, once their JSON is known to be complete; `auto` streams text until the tool-call
    syntax starts (a possible start of it is held back), then sends the parsed calls at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.buffer = ""  # text not sent yet
        self.in_call = False
        self.text_only = False  # a `leading` syntax's answer that did not start with a call
        self.calls: list[dict] = []  # the calls made (a named call: its arguments so far)

    def feed(self, text: str) -> list[dict]:
        p = self.plan
        if p.mode == "named":
            if not self.calls:
                self.calls = [_call(p.named, text)]
                head = {**self.calls[0], "function": dict(self.calls[0]["function"])}  # not the one appended to
                return [{"tool_calls": [{"index": 0, **head}]}]
            self.calls[0]["function"]["arguments"] += text
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
        self.buffer += text
        if p.mode != "auto" or self.in_call:  # held back until finish()
            return []
        if p.leading:
            return self._leading()
        at = self.buffer.find(p.start)
        if at >= 0:
            self.in_call = True
            head, self.buffer = self.buffer[:at], self.buffer[at:]
            return [{"content": head}] if head else []
        keep = partial_suffix(self.buffer, p.start)
        head, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return [{"content": head}] if head else []

    def _leading(self) -> list[dict]:
        """A syntax whose call is the answer itself: held back while the answer may still start with one."""
        if not self.text_only:
            starts = self.plan.leading.may_start_a_call(self.buffer)
            if starts is None:
                return []
            if starts:
                self.in_call = True
                return []
            self.text_only = True
        head, self.buffer = self.buffer, ""
        return [{"content": head}] if head else []

    def finish(self) -> list[dict]:
        """Deltas for what was held back; sets `calls` to the calls made."""
        if self.plan.mode == "named":
            return []
        content, calls = self.plan.calls(self.buffer) if self.plan.mode != "auto" or self.in_call \
            else (self.buffer or None, [])
        out = [{"content": content}] if content else []
        if calls:
            out.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        self.calls = calls
        self.buffer = ""
        return out


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0

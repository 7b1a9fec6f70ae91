"""ToolPlan and ToolStream without a model: which model-written calls are calls, and what is content."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from meshlm.api.tools import FALLBACK_END, FALLBACK_START, ToolPlan, ToolStream, json_tools

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
G = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}


def auto_plan(*tools: dict) -> ToolPlan:
    return ToolPlan("auto", tools or (F, G), start=FALLBACK_START, end=FALLBACK_END, parser=json_tools.parse_tool_call)


def called(body: str) -> str:
    return f"{FALLBACK_START}{body}{FALLBACK_END}"


def names_and_arguments(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("body", [
    "[1,2]", "5", '"x"', "null", "[]",  # JSON, but not a call object
    '{"name":"zzz","arguments":{}}',  # a function the request did not offer
    '{"arguments":1}', '{"name":1,"arguments":{}}',  # no string name
    '{"name":"f","arguments":1}', '{"name":"f","arguments":"[1]"}', '{"name":"f","arguments":"{"}',  # no object
    '[{"name":"f","arguments":{}},{"name":"zzz","arguments":{}}]',  # one bad call spoils the set
    '{"name":"f","arguments":"' + "[" * 100_000 + '"}',  # deeper than json can parse
    # not JSON a client can parse: they went out as arguments '{"a": Infinity}', '{"a": NaN}'
    '{"name":"f","arguments":{"a":1e999}}', '{"name":"f","arguments":{"a":NaN}}',
    '{"name":"f","arguments":{"a":-Infinity}}', '{"name":"f","arguments":"{\\"a\\": NaN}"}',
])
def test_text_that_is_not_a_usable_call_stays_content(body):
    text = "a" + called(body)
    assert auto_plan().calls(text) == (text, [])


def test_a_bad_call_after_a_good_one_leaves_all_of_it_as_content():
    text = called('{"name":"f","arguments":{}}') + called('{"name":"zzz"}')
    assert auto_plan().calls(text) == (text, [])


@pytest.mark.parametrize("body, want", [
    ('{"name":"f","arguments":{"a":[1]}}', [("f", '{"a": [1]}')]),
    ('{"name":"f","arguments":"{\\"a\\":1}"}', [("f", '{"a":1}')]),  # a JSON-object string is passed through
    ('{"name":"f"}', [("f", "{}")]),  # no arguments: a function without parameters
    ('[{"name":"f","arguments":{}},{"name":"g","arguments":{}}]', [("f", "{}"), ("g", "{}")]),
])
def test_calls_to_the_requests_tools_are_returned(body, want):
    content, calls = auto_plan().calls(called(body))
    assert content is None and names_and_arguments(calls) == want
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def stream_all(plan: ToolPlan, pieces: list[str]) -> tuple[str | None, list[dict]]:
    """What a streaming client accumulates: (content, calls), a call's deltas joined by its index."""
    s = ToolStream(plan)
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content = "".join(d.get("content") or "" for d in deltas) or None
    calls: dict[int, dict] = {}
    for delta in (c for d in deltas for c in d.get("tool_calls") or ()):
        call = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
        call["function"]["name"] += delta["function"].get("name") or ""
        call["function"]["arguments"] += delta["function"].get("arguments") or ""
    assert names_and_arguments(s.calls) == names_and_arguments(list(calls.values()))
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("body", ["[1,2]", "5", '{"name":"zzz"}', '{"arguments":1}'])
def test_a_stream_leaves_the_same_text_as_content(body):
    text = called(body)
    assert stream_all(auto_plan(), [text[i:i + 3] for i in range(0, len(text), 3)]) == (text, [])
    json.dumps(stream_all(auto_plan(), [text]))  # nothing unserialisable reaches the wire


CALL = called('{"name":"f","arguments":{}}')


@pytest.mark.parametrize("text, content", [
    (" hi \n" + CALL, " hi \n"),  # the text before a call, verbatim (was stripped, unlike the stream's)
    (CALL + " bye", " bye"),  # after the last call (was dropped)
    ("a" + CALL + "\nb\n" + CALL + "c", "a\nb\nc"),
    (CALL + CALL, None),
])
def test_the_text_around_calls_is_the_content_whole_or_streamed(text, content):
    plan = auto_plan()
    got = plan.calls(text)
    assert (got[0], len(got[1])) == (content, text.count(FALLBACK_START))
    for step in (1, 2, 5, len(text)):
        streamed = stream_all(plan, [text[i:i + step] for i in range(0, len(text), step)])
        assert (streamed[0], names_and_arguments(streamed[1])) == (content, names_and_arguments(got[1]))


ADDR = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
PERSON = {"type": "function", "function": {"name": "person", "parameters": {  # as openai.pydantic_function_tool
    "$defs": {"Addr": ADDR}, "type": "object", "additionalProperties": False, "required": ["home", "work"],
    "properties": {"home": {"$ref": "#/$defs/Addr"}, "work": {"anyOf": [{"$ref": "#/$defs/Addr"}, {"type": "null"}]},
                   "default": {"$ref": "#/definitions/Zip"},  # a property named like a data keyword
                   "note": {"const": {"$ref": "#"}}},  # data that looks like a ref: not rewritten
    "definitions": {"Zip": {"type": "integer"}}}}}
TREE = {"type": "function", "function": {"name": "tree", "parameters": {  # a ref to its own root
    "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "additionalProperties": False}}}


def test_required_keeps_each_tools_refs_pointing_into_that_tool():
    """Nested under `anyOf`, `#/$defs/Addr` pointed at the combined schema's root, where there is none."""
    schema = ToolPlan("required", (PERSON, TREE, F)).schema
    ok = [{"name": "person", "arguments": {"home": {"city": "x"}, "work": None, "default": 3,
                                           "note": {"$ref": "#"}}},
          {"name": "tree", "arguments": {"kids": [{"kids": []}, {}]}}, {"name": "f", "arguments": {"z": 1}}]
    jsonschema.validate(ok, schema)
    for name, bad in [("person", {"home": {"city": 1}, "work": None}),  # Addr is checked
                      ("person", {"home": {"city": "x"}, "work": None, "default": "3"}),  # so is Zip
                      ("person", {"home": {"city": "x"}, "work": None, "note": 1}),
                      ("tree", {"kids": [{"kids": [{"x": 1}]}]})]:  # the tree's own root, not the array
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": name, "arguments": bad}], schema)


def test_required_leaves_the_refs_of_a_schema_with_an_id_to_that_schema():
    """Regression: a function whose parameters have an `$id` is its own resource, so its `#/$defs/User`
    resolves inside it; rebased to `#/$defs/tool-user/$defs/User` it pointed nowhere, and the request got
    a 400 that the same tool named by tool_choice, or as a response schema, did not."""
    user = {"type": "function", "function": {"name": "user", "parameters": {
        "$id": "https://example.com/user.json", "type": "object", "properties": {"u": {"$ref": "#/$defs/User"}},
        "required": ["u"], "$defs": {"User": {"type": "object", "properties": {"id": {"type": "integer"}},
                                              "required": ["id"]}}}}}
    schema = ToolPlan("required", (user, F)).schema
    assert schema["$defs"]["tool-user"]["properties"]["u"]["$ref"] == "#/$defs/User"
    jsonschema.validate([{"name": "user", "arguments": {"u": {"id": 7}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "user", "arguments": {"u": {"id": "7"}}}], schema)


NAMED = ToolPlan("named", (F, G), named="f")
REQUIRED = ToolPlan("required", (F, G))


@pytest.mark.parametrize("text", ['[{"name": "f", "arguments": {}}', "[{", ""])
def test_a_required_call_cut_short_is_no_call_and_no_content(text):
    """By max_tokens, a stop string or a stop token: the raw '[{' was content."""
    assert REQUIRED.calls(text) == (None, [])
    assert stream_all(REQUIRED, [text[i:i + 2] for i in range(0, len(text), 2)]) == (None, [])


@pytest.mark.parametrize("text", ['{"a": "x', "{"])
def test_a_named_call_cut_short_keeps_its_arguments_so_far_and_the_reason_that_cut_it(text):
    """As OpenAI's API: the arguments written so far, streamed as they came; it finished "tool_calls"
    with arguments '{', which a client then failed to parse."""
    content, calls = NAMED.calls(text)
    assert content is None and names_and_arguments(calls) == [("f", text)]
    assert names_and_arguments(stream_all(NAMED, [text[i:i + 2] for i in range(0, len(text), 2)])[1]) == [("f", text)]
    for reason in ("length", "stop"):
        assert NAMED.finish_reason(reason, calls) == reason
    assert NAMED.calls("") == (None, [])


@pytest.mark.parametrize("plan, text, want", [
    (NAMED, '{"a": "x"}', [("f", '{"a": "x"}')]),
    (REQUIRED, '[{"name": "g", "arguments": {"b": 1}}, {"name": "f", "arguments": {}}]',
     [("g", '{"b": 1}'), ("f", "{}")]),
])
def test_a_complete_forced_call_is_a_call_streamed_or_not(plan, text, want):
    content, calls = plan.calls(text)
    assert content is None and names_and_arguments(calls) == want
    assert plan.finish_reason("length", calls) == "tool_calls"  # its JSON closed on the last token allowed
    streamed = stream_all(plan, [text[i:i + 3] for i in range(0, len(text), 3)])
    assert streamed[0] is None and names_and_arguments(streamed[1]) == want


@pytest.mark.parametrize("plan, text, want", [
    (NAMED, '{"a": 14e424, "b": [1.50, 2]}', [("f", '{"a": 14e424, "b": [1.50, 2]}')]),
    (REQUIRED, '[{"name": "f", "arguments": {"a": 14e424, "b": 3.14159265358979323846}}]',
     [("f", '{"a": 1.4E+425, "b": 3.14159265358979323846}')]),
])
def test_a_forced_call_keeps_a_number_past_a_double(plan, text, want):
    """The grammar bounds no exponent, and 1e999 is JSON. A `required` array holding one was dropped whole
    (no call, no content, finish_reason stop), a named call finished `stop` (helper-57: 8 and 12 of 40
    seeds on the tiny model). The call is made, its numbers as exact as written."""
    content, calls = plan.calls(text)
    assert content is None and names_and_arguments(calls) == want
    assert plan.finish_reason("stop", calls) == "tool_calls"
    assert json.loads(calls[0]["function"]["arguments"])["a"] == float("inf")  # what Python's client then holds
    streamed = stream_all(plan, [text[i:i + 3] for i in range(0, len(text), 3)])
    assert streamed[0] is None and names_and_arguments(streamed[1]) == want


def test_auto_with_parallel_tool_calls_false_returns_the_first_call_only():
    text = called('{"name": "f", "arguments": {"a": "x"}}') + called('{"name": "g", "arguments": {}}')
    plan = dataclasses.replace(auto_plan(), parallel=False)
    assert names_and_arguments(plan.calls(text)[1]) == [("f", '{"a": "x"}')]
    assert names_and_arguments(stream_all(plan, [text[i:i + 4] for i in range(0, len(text), 4)])[1]) == [("f", '{"a": "x"}')]
    assert len(auto_plan().calls(text)[1]) == 2


def test_a_developer_message_is_the_system_message_unless_the_template_knows_the_role():
    """OpenAI's `developer` role went to the template as is: ChatML-style templates then added their own default
    system prompt and rendered a turn of an unknown speaker (another prompt, another answer)."""
    from types import SimpleNamespace

    from meshlm.api.schemas import ChatCompletionRequest
    from meshlm.api.tools import template_messages

    req = ChatCompletionRequest.model_validate({"messages": [{"role": "developer", "content": "Be a pirate."},
                                                             {"role": "user", "content": "hi"}]})
    plain = SimpleNamespace(chat_template="{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}")
    messages, _ = template_messages(req, None, plain)
    assert [m["role"] for m in messages] == ["system", "user"]
    knows = SimpleNamespace(chat_template="{% if m.role == 'developer' %}...{% endif %}")
    assert [m["role"] for m in template_messages(req, None, knows)[0]] == ["developer", "user"]


def test_past_calls_arguments_and_mistral_ids_as_templates_take_them():
    from meshlm.api.tools import _past_arguments, _short_id

    assert _past_arguments("") == _past_arguments("  ") == _past_arguments("null") == {}  # vLLM's mapping
    assert _past_arguments('{"a": 1}') == {"a": 1} and _past_arguments("not json") == "not json"
    assert _short_id("call_0123456789abcdef01234567") == "f01234567" and _short_id("abcDEF123") == "abcDEF123"
    assert _short_id("c-1") == "c-1" and _short_id(None) is None  # too short: the template names it


def llama3_plan(**kw) -> ToolPlan:
    from meshlm.api import llama3_calls

    return ToolPlan("auto", (F, G), leading=llama3_calls, **kw)


def pythonic_plan(**kw) -> ToolPlan:
    from meshlm.api import pythonic_calls

    return ToolPlan("auto", (F, G), leading=pythonic_calls, **kw)


@pytest.mark.parametrize("text, want", [
    ('[f(a="x")]', [("f", '{"a": "x"}')]),
    (' \n[f(a="x"), g()]\n', [("f", '{"a": "x"}'), ("g", "{}")]),
    ("[f(a=true, b=null, c=[1, {'k': 2.5}], d=-3)]", [("f", '{"a": true, "b": null, "c": [1, {"k": 2.5}], "d": -3}')]),
])
def test_pythonic_calls_are_the_whole_answer(text, want):
    """vLLM's `pythonic` (Llama 3.2's and 4's pythonic templates): a bare list of calls, which mlx-lm reads
    only between LFM2's markers."""
    for step in (1, 3, len(text)):
        streamed = stream_all(pythonic_plan(), [text[i:i + step] for i in range(0, len(text), step)])
        assert (streamed[0], names_and_arguments(streamed[1])) == (None, want)
    assert names_and_arguments(pythonic_plan().calls(text)[1]) == want


@pytest.mark.parametrize("text", [
    "Sunny.", 'Call [f(a="x")]', '[f(a="x")] then text', "[f(1)]", "[f(**kw)]", "[]", "[1, 2]", "[zzz()]",
    "[f(a=__import__('os').system('true'))]",  # parsed, never evaluated: not a literal
    "[f(a={1, 2})]", "[f(a=b'x')]", "[f(a=1e999)]", "[f(a=[" + "[" * 5000 + "]))]", "[f(a=",
    "[f(a={[1]: 2})]",  # an unhashable key: a TypeError, which was a 500
    "[f(a=1)]  # then words", "[f(a=1)]\n# I have called f",  # Python's parser skips comments: words all the same
])
def test_pythonic_answers_that_are_not_wholly_calls_are_content(text):
    plan = pythonic_plan()
    assert plan.calls(text) == (text, [])
    assert stream_all(plan, [text[i:i + 4] for i in range(0, len(text), 4)]) == (text, [])


LLAMA_CALL = '{"name": "f", "parameters": {"a": "x"}}'


@pytest.mark.parametrize("text, want", [
    (LLAMA_CALL, [("f", '{"a": "x"}')]),
    ("\n " + LLAMA_CALL + " \n", [("f", '{"a": "x"}')]),
    ("<|python_tag|>" + LLAMA_CALL, [("f", '{"a": "x"}')]),  # the tag, when special tokens are decoded
    (LLAMA_CALL + "; " + '{"name": "g", "arguments": {}}', [("f", '{"a": "x"}'), ("g", "{}")]),  # vLLM's join
    (LLAMA_CALL + "\n" + '{"name": "g"}', [("f", '{"a": "x"}'), ("g", "{}")]),
])
def test_llama3_json_calls_are_the_whole_answer(text, want):
    """Llama 3.1-3.3 answer a call as a bare {"name", "parameters"} object, which mlx-lm has no parser for:
    such models got meshlm's fallback prompt instead of their own template's tools."""
    for plan in (llama3_plan(), llama3_plan(parallel=False)):
        expected = want if plan.parallel else want[:1]
        content, calls = plan.calls(text)
        assert content is None and names_and_arguments(calls) == expected
        for step in (1, 3, len(text)):
            streamed = stream_all(plan, [text[i:i + step] for i in range(0, len(text), step)])
            assert (streamed[0], names_and_arguments(streamed[1])) == (None, expected)


@pytest.mark.parametrize("text", [
    "Sunny in Paris.", "  It is {warm}", "<|python_tag|> no call", "[" + LLAMA_CALL + "]",
    LLAMA_CALL + " and then some text",  # not wholly calls: all of it is text (vLLM's whole reading: a call)
    LLAMA_CALL + '; {"name": "zzz", "parameters": {}}',  # one call to no offered tool spoils the set
    '{"name": "f", "parameters": {"a": 1e999}}', '{"answer": 42}', "{", "<|python_tag|>{" + "[" * 100_000,
])
def test_llama3_json_answers_that_are_not_wholly_calls_are_content_whole_or_streamed(text):
    plan = llama3_plan()
    assert plan.calls(text) == (text, [])
    for step in (1, 4, len(text)):
        assert stream_all(plan, [text[i:i + step] for i in range(0, len(text), step)]) == (text, [])


def test_llama3_json_streams_text_once_it_cannot_be_a_call():
    s = ToolStream(llama3_plan())
    assert s.feed("  ") == [] and s.feed("<|pyth") == []  # may still become the tag and a call
    assert s.feed("on_tag|>Hi") == [{"content": "  <|python_tag|>Hi"}]
    assert s.feed(" there") == [{"content": " there"}]
    s = ToolStream(llama3_plan())
    assert s.feed("Hi") == [{"content": "Hi"}] and s.feed(' {"name": "f"}') == [{"content": ' {"name": "f"}'}]
    assert s.finish() == [] and s.calls == []


def test_a_llama3_template_is_rendered_with_its_tools_and_read_in_its_syntax():
    from types import SimpleNamespace

    from meshlm.api.schemas import ChatCompletionRequest
    from meshlm.api.tools import native_syntax, plan_tools

    asks = 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    llama = SimpleNamespace(chat_template="{% if tools %}" + asks + "{% endif %}", tool_parser=None)
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [F]})
    assert native_syntax(llama, with_tools=True) == "llama3" and plan_tools(req, llama).leading
    other = SimpleNamespace(chat_template="{% if tools %}call <fn>{% endif %}", tool_parser=None)
    assert native_syntax(other, with_tools=True) is None and not plan_tools(req, other).leading


def test_answer_or_calls_only_for_json_calls_between_markers():
    """The grammar spells calls only in a syntax it knows: JSON between text markers (the fallback's,
    mlx-lm's json_tools). Any other syntax, and forced modes, keep the schema alone."""
    import llguidance

    from meshlm.engine.grammar import JSON_OPTIONS

    answer = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    lark = auto_plan().answer_or_calls(answer, JSON_OPTIONS)
    assert "start: answer | calls" in lark and "calls: call+" in lark
    assert "calls: call\n" in dataclasses.replace(auto_plan(), parallel=False).answer_or_calls(answer, JSON_OPTIONS)
    llguidance.LLMatcher.grammar_from_lark(lark)  # well-formed
    assert dataclasses.replace(auto_plan(), parser=lambda text, tools: None).answer_or_calls(answer, {}) is None
    assert dataclasses.replace(auto_plan(), start=None, leading=object()).answer_or_calls(answer, {}) is None
    assert REQUIRED.answer_or_calls(answer, {}) is None and NAMED.answer_or_calls(answer, {}) is None


def test_text_or_calls_holds_strict_calls_to_their_schemas_and_leaves_text_free():
    """`strict: true` in `auto` was not enforced: a call missing a required field reached OpenAI's client,
    whose parse raised pydantic's ValidationError (helper-57). Checked token by token with llguidance on a
    real tokenizer (the demo-model exporter's tiny one)."""
    import llguidance
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    from meshlm.engine.grammar import JSON_OPTIONS
    from meshlm.model.demo import tiny_tokenizer

    strict = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}}}
    assert auto_plan(F, G).text_or_calls(JSON_OPTIONS) is None  # no strict function: free text as before
    assert REQUIRED.text_or_calls(JSON_OPTIONS) is None
    tok = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer())
    ll = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))

    def allowed(plan: ToolPlan, text: str) -> bool:
        m = llguidance.LLMatcher(ll, plan.text_or_calls(JSON_OPTIONS), log_level=0)
        return all(m.consume_token(i) for i in tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    plan = auto_plan(strict, G)
    one = '{"name": "f", "arguments": {"a": "x"}}'
    assert allowed(plan, "Just an answer, no call.") and allowed(plan, "x < y, and <tool> or <tool_cal is text")
    assert allowed(plan, f"Let me look. {FALLBACK_START}{one}{FALLBACK_END}")
    assert allowed(plan, f"{FALLBACK_START}\n{one}\n{FALLBACK_END}{FALLBACK_START}" + '{"name": "g", "arguments": {}}'
                   + FALLBACK_END)
    assert not allowed(plan, f"{FALLBACK_START}" + '{"name": "f", "arguments": {"b": 1}}' + FALLBACK_END)
    assert not allowed(plan, f"{FALLBACK_START}" + '{"name": "h", "arguments": {}}' + FALLBACK_END)
    assert not allowed(plan, f"{FALLBACK_START}{one}{FALLBACK_END} and more text")
    single = dataclasses.replace(plan, parallel=False)
    assert not allowed(single, f"{FALLBACK_START}{one}{FALLBACK_END}{FALLBACK_START}{one}{FALLBACK_END}")

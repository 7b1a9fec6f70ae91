"""Structured outputs and tool calls over a real socket, with the official client where it has a helper.

On a random-weight model only the grammar can make output valid, so every check here is a check of
the constraint. Schemas bound their strings and numbers: a random model would otherwise write one
string until max_tokens (the output would be a valid prefix, cut off with finish_reason "length").
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.slow

Word = Annotated[str, Field(max_length=8)]


class Owner(BaseModel):
    id: int = Field(ge=1, le=999)
    email: str = Field(pattern=r"^[a-z]{1,6}@[a-z]{1,6}\.(com|org)$")


class Pet(BaseModel):
    name: Word
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)
    tags: list[Word] = Field(min_length=1, max_length=3)
    owner: Owner


PET_SCHEMA = to_strict_json_schema(Pet)  # what the official client sends for `parse`
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


CONTEXT = ("--max-model-len", "2048")  # the fallback tools prompt alone is ~450 tokens of the tiny tokenizer


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, *CONTEXT, "--max-batch-size", "16", log_dir=tmp_path_factory.mktemp("so"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def parse_pets(url: str, n: int, temperature: float = 1.0) -> list:
    c = openai_client(url)
    model = c.models.list().data[0].id

    def one(seed: int):
        r = c.beta.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Describe a pet."}],
                                          response_format=Pet, max_tokens=200, temperature=temperature, seed=seed)
        return r.choices[0].message.parsed

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def test_openai_parse_returns_a_valid_object_20_of_20(server):
    pets = parse_pets(server.url, 20)
    assert all(isinstance(p, Pet) for p in pets)
    assert len({p.model_dump_json() for p in pets}) > 1  # sampled, not one canned answer


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


COMPLEX = {"type": "object", "properties": {
    "mode": {"enum": ["fast", "slow", 42]},
    "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                               "y": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["x", "y"], "additionalProperties": False},
    "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "note": {"type": ["string", "null"], "maxLength": 6}},
    "required": ["mode", "point", "ids", "code", "note"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_with_enum_nesting_bounded_arrays_and_a_pattern_is_honoured(client, stream):
    for seed in range(4):
        body = {"messages": ASK, "response_format": json_schema_format(COMPLEX), "max_tokens": 200,
                "temperature": 1.0, "seed": seed, "stream": stream}
        text = chat_text(client, body)
        jsonschema.validate(json.loads(text), COMPLEX)


def chat_text(client: httpx.Client, body: dict) -> str:
    if not body.get("stream"):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        return choice["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["stop"]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


def test_completions_take_structured_outputs_regex_choice_and_grammar(client):
    def text(so: dict, **kw) -> list[str]:
        r = client.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 40, "structured_outputs": so,
                                                  "temperature": 1.0, "seed": 3, **kw})
        assert r.status_code == 200, r.text
        return [c["text"] for c in r.json()["choices"]]

    assert all(re.fullmatch(r"[a-z]{2,6}@[a-z]{2,5}\.(com|net)", t)
               for t in text({"regex": r"[a-z]{2,6}@[a-z]{2,5}\.(com|net)"}, n=3))
    assert all(t in ("red pill", "blue (pill)?", "none") for t in text({"choice": ["red pill", "blue (pill)?", "none"]}, n=4))
    assert text({"grammar": 'start: "x" NUM\nNUM: /[0-9]{1,3}/'})[0][0] == "x"
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
    assert json.loads(text({"json": schema})[0]) in ({"a": True}, {"a": False})
    # JSON Schema's `true` (any value), as a boolean or as JSON text, as response_format takes it.
    assert text({"json": True}) and text({"json": "true"})


FORCED_FOREVER = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
                  "$ref": "#/$defs/n"}  # every object must hold another: llguidance's forced tokens never end


@pytest.mark.parametrize("so", [{"regex": r"<\|im_end\|>"}, {"choice": ["<|im_end|>"]}, {"json": FORCED_FOREVER}],
                         ids=["special-token-text-regex", "special-token-text-choice", "forced-forever"])
def test_a_grammar_llguidance_cannot_follow_is_the_requests_400_not_a_server_503(client, so):
    """llguidance's mask allows the special token <|im_end|> for a grammar spelling its text, then refuses
    it; the schema's first token passes its mask, then the matcher runs out of items. Neither is a server
    fault a retry would mend (503 said so), and the engine serves on."""
    body = {"prompt": "hi", "max_tokens": 12, "structured_outputs": so}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_error", r.text
    assert "the grammar cannot go on" in r.json()["error"]["message"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "grammar_error", events[-1]
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_penalties_and_bans_do_not_unmask_forbidden_tokens(client, temperature):
    """Every logit processor on top of a grammar: the repetition penalty once turned the forbidden
    tokens of the prompt into NaN, which won, and a fuzzed request got "oooooooo" back with a 200 as
    its JSON-schema output."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a"], "additionalProperties": False}
    body = {"prompt": "hello, ok, oooo", "max_tokens": 24, "temperature": temperature, "seed": 1, "n": 2,
            "repetition_penalty": 4, "presence_penalty": 1.5, "frequency_penalty": 1.0, "min_tokens": 3,
            "logit_bias": {"5": 3.5, "7": -100}, "response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": schema}}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), schema)


SAMPLING = {"temperature": [0, 1e-38, 0.7, 1.5], "top_p": [0.3, 1.0], "top_k": [0, 1, 5], "min_p": [0, 0.2],
            "repetition_penalty": [1, 1.3, 4, 0.5], "presence_penalty": [0, 1.5, -2], "frequency_penalty": [0, 2],
            "logit_bias": [{}, {"5": 3.5, "7": -100}], "min_tokens": [0, 3], "n": [1, 2], "logprobs": [None, 2],
            "seed": [1, 2]}
CHOSEN = ["yes", "no (sir)?", "maybe"]


@pytest.mark.parametrize("seed", range(4))
def test_every_mix_of_sampling_parameters_keeps_output_in_the_grammar(client, seed):
    """Seeded combinations of every logit processor and filter over each kind of constraint: whatever
    the mix, a finished output is in the grammar (the processors that once broke it are tested above;
    this guards the combinations nobody listed)."""
    rng = random.Random(seed)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    kinds = {"json": (schema, lambda t: jsonschema.validate(json.loads(t), schema)),
             "regex": ("(ab|cd){1,6}", lambda t: re.fullmatch("(ab|cd){1,6}", t) or pytest.fail(t)),
             "choice": (CHOSEN, lambda t: t in CHOSEN or pytest.fail(t))}
    for _ in range(12):
        kind = rng.choice(sorted(kinds))
        so, valid = kinds[kind]
        params = {k: rng.choice(v) for k, v in rng.sample(sorted(SAMPLING.items()), rng.randint(2, 8))}
        body = {"prompt": "oooo hello {x}, ok", "max_tokens": 40, "structured_outputs": {kind: so}, **params}
        r = client.post("/v1/completions", json={k: v for k, v in body.items() if v is not None})
        assert r.status_code == 200, (body, r.text)
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] in ("stop", "length"), (body, choice)
            if choice["finish_reason"] == "stop":
                valid(choice["text"])


def test_vllm_guided_names_constrain_like_structured_outputs(client):
    """guided_choice / guided_regex / guided_json (vLLM's older names, which many clients still send) were
    silently ignored, so the output was unconstrained; they now mean structured_outputs."""
    def texts(**kw) -> list[str]:
        r = client.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 40, "temperature": 1.0,
                                                  "seed": 5, "n": 3, **kw})
        assert r.status_code == 200, r.text
        return [c["text"] for c in r.json()["choices"]]

    assert all(t in ("yes", "no") for t in texts(guided_choice=["yes", "no"]))
    assert all(re.fullmatch("(ab|cd){1,4}", t) for t in texts(guided_regex="(ab|cd){1,4}"))
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
    assert all(json.loads(t) in ({"a": True}, {"a": False}) for t in texts(guided_json=schema))
    both = client.post("/v1/completions", json={"prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}})
    assert both.status_code == 400 and "one constraint" in both.json()["error"]["message"]


def test_constrained_and_free_rows_share_batches_with_logprobs_stops_and_seeds(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            free = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
            bound = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": 7, "logprobs": 2,
                     "structured_outputs": {"regex": "(ab|cd){1,12}"}}
            stopped = {**bound, "seed": 8, "stop": ["cd"]}
            return await asyncio.gather(*[c.post("/v1/completions", json=b)
                                          for b in (free, bound, stopped, free, bound, stopped)])

    rs = asyncio.run(run())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    texts = [r.json()["choices"][0]["text"] for r in rs]
    assert texts[0] == texts[3] and texts[1] == texts[4] and texts[2] == texts[5]  # greedy, seeded
    assert re.fullmatch("(ab|cd){1,12}", texts[1])
    assert "cd" not in texts[2] and re.fullmatch("(ab)*", texts[2])  # cut at the stop string
    lp = rs[1].json()["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]).startswith(texts[1]) and all(v <= 0 for v in lp["token_logprobs"])  # + EOS


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_are_well_formed(server, stream, choice):
    c = openai_client(server.url)
    model = c.models.list().data[0].id
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        # One call: a random model given an unbounded array of calls may not close it within max_tokens.
        kw = dict(model=model, messages=ASK, tools=[WEATHER, NOOP], tool_choice=tool_choice, max_tokens=120,
                  temperature=1.0, seed=seed, parallel_tool_calls=False)
        if stream:
            calls: dict[int, dict] = {}
            finish = content = None
            for chunk in c.chat.completions.create(**kw, stream=True):
                d = chunk.choices[0].delta
                if d.content is not None:  # the opening chunk's "" made the client's helpers assemble ""
                    content = (content or "") + d.content
                for tc in d.tool_calls or ():
                    call = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                    call["id"] = call["id"] or tc.id
                    call["name"] += (tc.function.name or "") if tc.function else ""
                    call["arguments"] += (tc.function.arguments or "") if tc.function else ""
                finish = chunk.choices[0].finish_reason or finish
            got = [(v["name"], v["arguments"], v["id"]) for _, v in sorted(calls.items())]
        else:
            r = c.chat.completions.create(**kw)
            finish, content = r.choices[0].finish_reason, r.choices[0].message.content
            got = [(t.function.name, t.function.arguments, t.id) for t in r.choices[0].message.tool_calls]
        assert finish == "tool_calls" and got and content is None
        for name, arguments, call_id in got:
            assert call_id
            schema = {"get_weather": WEATHER, "noop": NOOP}[name]["function"]["parameters"]
            jsonschema.validate(json.loads(arguments), schema)
            if choice == "named":
                assert name == "get_weather"


class GetWeather(BaseModel):
    city: Word
    days: int = Field(ge=1, le=7)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_wins_over_response_format_as_with_openai(server, choice):
    """An agent SDK sends its output type with the tools on every turn (openai-agents: `output_type`). A turn
    that must call a tool has no final answer for `response_format` to shape; OpenAI takes both, and the
    call is made. It was a 400 ('both constrain the output')."""
    c = openai_client(server.url)
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "GetWeather"}}
    for seed in range(3):
        r = c.chat.completions.parse(model=c.models.list().data[0].id, messages=ASK, response_format=Pet,
                                     tools=[openai.pydantic_function_tool(GetWeather)], tool_choice=tool_choice,
                                     parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None and message.parsed is None
        assert [type(t.function.parsed_arguments) for t in message.tool_calls] == [GetWeather]


def test_auto_with_a_strict_function_still_answers_freely(client):
    """`strict` functions in `auto` are held to their schemas by a grammar that leaves text free
    (tests/unit/test_tools.py checks what it allows); a random model, which writes no call, answers in
    text through it, the same whole and streamed."""
    tool = openai.pydantic_function_tool(GetWeather)  # strict, as OpenAI's client sends it
    assert tool["function"]["strict"] is True
    for seed in range(4):
        body = {"messages": ASK, "tools": [tool], "max_tokens": 12, "temperature": 1.0, "seed": seed}
        whole, streamed = chat_answer(client, body, False), chat_answer(client, body, True)
        assert whole == streamed and whole["content"] and not whole["calls"], (whole, streamed)


class Addr(BaseModel):
    city: Word


class Person(BaseModel):
    name: Word
    home: Addr
    work: Addr | None


@pytest.mark.parametrize("stream", [False, True])
def test_required_takes_a_tool_whose_schema_has_defs_and_refs(server, stream):
    """openai.pydantic_function_tool of a model with a nested model gives `$defs` and `#/$defs/...` refs;
    `required` nested each schema in the combined one, where the refs pointed nowhere (a 400)."""
    c = openai_client(server.url)
    kw = dict(model=c.models.list().data[0].id, messages=ASK, tools=[openai.pydantic_function_tool(Person)],
              tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0)
    if stream:
        chunks = list(c.chat.completions.create(**kw, stream=True))
        calls = [tc.function for ch in chunks for tc in ch.choices[0].delta.tool_calls or () if ch.choices]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    else:
        r = c.chat.completions.create(**kw)
        calls, finish = [t.function for t in r.choices[0].message.tool_calls or ()], [r.choices[0].finish_reason]
    assert finish == ["tool_calls"] and [f.name for f in calls] == ["Person"]
    Person.model_validate_json(calls[0].arguments)


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", NAMED_WEATHER], ids=["required", "named"])
def test_a_forced_call_cut_short_by_a_stop_string_finishes_stop(client, stream, tool_choice):
    """A named call came back finished ("tool_calls") with arguments '{'; `required` gave the raw '[{'
    as content. Now "stop": a named call with its arguments so far (as OpenAI's API), `required` with no
    call and no content (its cut array is neither a call nor the model's words)."""
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": tool_choice, "stop": ['"'], "max_tokens": 60,
            "temperature": 0}
    got = chat_answer(client, body, stream)
    assert (got["content"], got["finish"]) == (None, "stop"), got
    if tool_choice == "required":
        assert got["calls"] == []
    else:
        assert [name for name, _ in got["calls"]] == ["get_weather"] and got["calls"][0][1].strip() == "{", got


@pytest.mark.parametrize("tool_choice", ["required", NAMED_WEATHER], ids=["required", "named"])
def test_max_tokens_cuts_a_forced_call_or_not_the_same_streamed_or_not(client, tool_choice):
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": tool_choice, "parallel_tool_calls": False,
            "max_tokens": 100, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body).json()
    whole, n = r["choices"][0]["message"]["tool_calls"], r["usage"]["completion_tokens"]  # n counts the EOS
    calls = [(t["function"]["name"], t["function"]["arguments"]) for t in whole]
    for stream in (False, True):
        # One token short of the EOS, the JSON is complete: a call, not "length".
        assert chat_answer(client, {**body, "max_tokens": n - 1}, stream) == {
            "content": None, "finish": "tool_calls", "calls": calls}
        cut = chat_answer(client, {**body, "max_tokens": n - 2}, stream)
        assert (cut["content"], cut["finish"]) == (None, "length"), cut
        if tool_choice == "required":
            assert cut["calls"] == []
        else:  # the arguments so far: all but the last token's
            (name, partial), = cut["calls"]
            assert name == calls[0][0] and calls[0][1].startswith(partial) and partial != calls[0][1], cut


def test_a_tool_round_trip_is_templated(client):
    first = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                                                      "max_tokens": 100, "temperature": 0}).json()
    call = first["choices"][0]["message"]["tool_calls"][0]
    history = ASK + [first["choices"][0]["message"],
                     {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 21}'}]
    second = client.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER], "max_tokens": 8,
                                                       "temperature": 0})
    assert second.status_code == 200, second.text
    grew = second.json()["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]
    assert grew > len(call["function"]["arguments"]) // 4  # the call and the tool's answer are in the prompt


def test_tool_choice_auto_on_a_template_without_tools_falls_back(client):
    """The tiny model's ChatML template cannot render tools: the fallback prompt is used, and free text
    comes back as content (a random model does not call tools on its own)."""
    r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "max_tokens": 8,
                                                  "temperature": 0, "logprobs": True})
    plain = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"] + 20
    assert r.json()["choices"][0]["finish_reason"] == "length"


def forced_text(client: httpx.Client, text: str, tools: list[dict], stream: bool, **kw) -> dict:
    """The chat answer (content, tool calls, finish_reason) when the model is made to write `text`
    (`tool_choice` auto: the tiny model's template falls back to the `<tool_call>` syntax)."""
    body = {"messages": ASK, "tools": tools, "structured_outputs": {"regex": re.escape(text)}, "max_tokens": 100,
            "temperature": 0, **kw}
    return chat_answer(client, body, stream)


def chat_answer(client: httpx.Client, body: dict, stream: bool) -> dict:
    """One choice as a client sees it, whole or accumulated from a stream that must end with [DONE]."""
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {"content": choice["message"]["content"], "finish": choice["finish_reason"],
                "calls": [(t["function"]["name"], t["function"]["arguments"])
                          for t in choice["message"].get("tool_calls") or ()]}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    choices = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
    calls: dict[int, list[str]] = {}
    for tc in (tc for c in choices for tc in c["delta"].get("tool_calls") or ()):
        call = calls.setdefault(tc["index"], ["", ""])
        call[0] += tc["function"].get("name") or ""
        call[1] += tc["function"].get("arguments") or ""
    return {"content": "".join(c["delta"].get("content") or "" for c in choices) or None,
            "finish": [c["finish_reason"] for c in choices if c["finish_reason"]][-1],
            "calls": [tuple(v) for _, v in sorted(calls.items())]}


ANY_F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tools_with_response_format_give_the_schemas_answer_or_calls(client, stream):
    """OpenAI allows either with `auto` tools. The schema held the output from its first token, so the
    model could never start its tool-call syntax: tools were silently never called (helper-57; agent SDKs
    send their output type with the tools on every turn). Now every answer is one or the other, and a
    random model writes both over a few seeds."""
    kinds = set()
    for seed in range(24):
        body = {"messages": ASK, "tools": [WEATHER, NOOP], "response_format": json_schema_format(PET_SCHEMA),
                "max_tokens": 160, "temperature": 1.0, "seed": seed, "parallel_tool_calls": False}
        got = chat_answer(client, body, stream)
        if got["calls"]:
            assert got["finish"] == "tool_calls" and got["content"] is None, got
            for name, arguments in got["calls"]:
                jsonschema.validate(json.loads(arguments), {"get_weather": WEATHER, "noop": NOOP}[name]
                                    ["function"]["parameters"])
            kinds.add("calls")
        elif got["finish"] == "stop":
            Pet.model_validate_json(got["content"])
            kinds.add("answer")
    assert kinds == {"answer", "calls"}, kinds


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", ["[1,2]", "5", '"x"', '{"name":"zzz"}', '{"arguments":1}',
                                  '{"name":"f","arguments":"[1]"}'])
def test_model_text_that_is_not_a_call_to_a_requested_tool_stays_content(client, stream, body):
    """JSON that is not a call object was a 500 (a stream cut mid-body); a call to a function not in
    `tools`, or one without a name, came back as a call."""
    text = f"<tool_call>{body}</tool_call>"
    assert forced_text(client, text, [ANY_F], stream) == {"content": text, "finish": "stop", "calls": []}


@pytest.mark.parametrize("text, content", [
    (' hi \n<tool_call>{"name":"f","arguments":{}}</tool_call>', " hi \n"),
    ('<tool_call>{"name":"f","arguments":{}}</tool_call> after', " after"),
])
def test_text_around_a_call_is_the_same_content_streamed_or_not(client, text, content):
    """The text before a call was stripped only when not streamed; the text after the last call was lost."""
    for stream in (False, True):
        assert forced_text(client, text, [ANY_F], stream) == {"content": content, "finish": "tool_calls",
                                                              "calls": [("f", "{}")]}


def test_a_model_written_call_reaches_the_openai_client(server):
    c = openai_client(server.url)
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=ASK, tools=[ANY_F], max_tokens=60,
                                  temperature=0, extra_body={"structured_outputs": {
                                      "regex": re.escape('<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>')}})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls] == [
        ("f", {"a": 1})]


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": json_schema_format({"type": "strin"})}, "response_format", "strin"),
    ({"response_format": json_schema_format({"type": "object", "if": {}, "then": {}})}, "response_format", "if"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", ""),
    ({"structured_outputs": {"regex": "a\\"}}, "structured_outputs", "lone backslash"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "((a{1000}){1000}){1000}"}}, "structured_outputs", "too complex"),
    ({"structured_outputs": {"choice": ["x" * 300_000]}}, "structured_outputs", "too large"),
    ({"response_format": json_schema_format({"$ref": "#"})}, "response_format", "no token can begin it"),
    ({"structured_outputs": {"json": "false"}}, "structured_outputs", "`false` schema matches nothing"),
    ({"structured_outputs": {"json": False}}, "structured_outputs", "`false` schema matches nothing"),
    ({"structured_outputs": {"regex": r"[^\x00-\x{10FFFF}]"}}, "structured_outputs", "no token can begin it"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "both"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", ""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "nope"),
    ({"tool_choice": "required"}, None, "tools"),
    ({"tools": [WEATHER, WEATHER]}, None, "unique"),
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice", "both"),
])
def test_bad_constraints_are_400(client, body, param, words):
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and "<state>" not in err["message"], err  # not llguidance's parser dump
    if param:
        assert (err["param"] or "").startswith(param)


@pytest.mark.parametrize("flags", [
    ("--tensor-parallel", "2", "--worker-timeout", "5"),
    ("--speculative", "ngram", "--no-adaptive-speculation", "--num-speculative-tokens", "4", "--ngram-min", "1"),
], ids=["tp2", "ngram-speculation"])
def test_constrained_greedy_output_is_identical_to_one_process(server, tiny_model, tmp_path, flags):
    bodies = [{"messages": [{"role": "user", "content": f"Pet number {i}"}], "max_tokens": 160, "temperature": 0,
               "response_format": json_schema_format(PET_SCHEMA)} for i in range(3)]
    bodies += [{"messages": ASK, "tools": [WEATHER, NOOP], "tool_choice": "required", "max_tokens": 120,
                "temperature": 0, "parallel_tool_calls": False}]

    def answers(url: str) -> list:
        with httpx.Client(base_url=url, timeout=120) as c:
            rs = [c.post("/v1/chat/completions", json=b).json()["choices"][0] for b in bodies]
        return [(r["message"]["content"], [t["function"] for t in r["message"].get("tool_calls") or []]) for r in rs]

    want = answers(server.url)
    other = ServerProcess(tiny_model, *CONTEXT, *flags, log_dir=tmp_path)
    try:
        got = answers(other.url)
    finally:
        other.stop()
    assert got == want
    for content, _ in want[:3]:
        Pet.model_validate_json(content)


def test_demo_model_parses_and_answers_json_mode(tmp_path_factory):
    from meshlm.model.demo import demo_model_dir

    srv = ServerProcess(demo_model_dir(), "--max-model-len", "1024", log_dir=tmp_path_factory.mktemp("demo"))
    try:
        assert all(isinstance(p, Pet) for p in parse_pets(srv.url, 20))
        c = openai_client(srv.url)
        r = c.chat.completions.create(model=c.models.list().data[0].id, response_format={"type": "json_object"},
                                      messages=[{"role": "user", "content": "Reply with a JSON object with the "
                                                 "keys city and country, for Paris."}], max_tokens=200, temperature=0)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    finally:
        srv.stop()

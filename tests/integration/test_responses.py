"""OpenAI's Responses API (`/v1/responses`) over a real socket, with the official client: the same output
as the chat completion it amounts to, whole and streamed, with tools, schemas, reasoning, and 400s for
what this server cannot do."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, "--max-model-len", "2048", log_dir=tmp_path_factory.mktemp("responses"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat(client, model, messages, **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


@pytest.mark.parametrize("max_tokens", [6, 40])
def test_a_response_is_the_chat_completion_it_amounts_to(client, model, max_tokens):
    want = chat(client, model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                max_tokens=max_tokens)
    got = client.responses.create(model=model, instructions="Be brief.", input="Hi", temperature=0,
                                  max_output_tokens=max_tokens)
    assert got.output_text == want.choices[0].message.content
    cut = want.choices[0].finish_reason == "length"
    assert got.status == ("incomplete" if cut else "completed")
    assert (got.incomplete_details.reason if cut else got.incomplete_details) == ("max_output_tokens" if cut else None)
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.usage.output_tokens == want.usage.completion_tokens
    assert got.usage.total_tokens == want.usage.total_tokens and got.usage.output_tokens_details.reasoning_tokens == 0
    assert [item.type for item in got.output] == ["message"] and got.output[0].role == "assistant"
    assert got.output[0].status == ("incomplete" if cut else "completed")
    assert got.model == model and got.id.startswith("resp")
    # The values that sampled it (they were null when the request left them out): the tiny model has no
    # generation_config defaults, so OpenAI's
    plain = client.responses.create(model=model, input="Hi", max_output_tokens=2)
    assert (plain.temperature, plain.top_p, got.temperature) == (1.0, 1.0, 0.0)


def same_logprobs(got, want, tol: float = 1e-4) -> None:
    """The same tokens and alternatives; logprobs within `tol` (another batch composition rounds apart)."""
    flat = lambda xs: [(x.token, x.bytes, [(t.token, t.bytes) for t in x.top_logprobs]) for x in xs]  # noqa: E731
    assert flat(got) == flat(want)
    for g, w in zip(got, want):
        assert abs(g.logprob - w.logprob) < tol and all(abs(a.logprob - b.logprob) < tol
                                                        for a, b in zip(g.top_logprobs, w.top_logprobs))


@pytest.mark.parametrize("stop", [None, ["ab"]], ids=["plain", "stop-string"])  # the second: text held back
def test_logprobs_are_the_chat_completions_whole_and_streamed(client, model, stop):
    kw = dict(model=model, input="Tell me a story.", temperature=0, max_output_tokens=12,
              include=["message.output_text.logprobs"], top_logprobs=2, extra_body={"stop": stop} if stop else None)
    want = chat(client, model, [{"role": "user", "content": "Tell me a story."}], max_tokens=12, logprobs=True,
                top_logprobs=2, stop=stop).choices[0].logprobs.content
    whole = client.responses.create(**kw)
    got = whole.output[0].content[0].logprobs
    same_logprobs(got, want)
    assert len(want) > 0 and all(len(x.top_logprobs) == 2 for x in got)
    events = list(client.responses.create(**kw, stream=True))
    deltas = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    for streamed in (deltas, done.logprobs, events[-1].response.output[0].content[0].logprobs):
        same_logprobs(streamed, want)
    plain = client.responses.create(**{**kw, "include": None})  # not included: none, as OpenAI's
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == whole.output_text


def test_streamed_events_build_the_same_response(client, model):
    kw = dict(model=model, input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}],
              temperature=0, max_output_tokens=20)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and kinds[-1].endswith(whole.status)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    shape = lambda r: [(i.type, i.status) for i in r.output]  # noqa: E731
    assert shape(events[-1].response) == shape(whole)
    # The client's own accumulation of the events (it needs `response.completed`: a schema makes this random
    # model end its output).
    kw["text"] = {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}}
    kw["max_output_tokens"] = 60
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == client.responses.create(**kw).output_text
    jsonschema.validate(json.loads(final.output_text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_is_a_function_call_item(client, model, stream):
    kw = dict(model=model, input="What is the weather in Paris?", tools=[WEATHER], max_output_tokens=60,
              tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    if stream:
        events = list(client.responses.create(**kw, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        response = events[-1].response
        assert events[-1].type == "response.completed"
        assert deltas == response.output[-1].arguments
    else:
        response = client.responses.create(**kw)
    call = response.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_function_round_trip_prompts_as_chat_does(client, model):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris", "days": 1}'}
    got = client.responses.create(model=model, tools=[WEATHER], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Weather?"}, call,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    want = chat(client, model, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=8)
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.output_text == (want.choices[0].message.content or "")


def test_text_format_json_schema_holds_the_output(client, model):
    r = client.responses.create(model=model, input="A number?", max_output_tokens=40, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "n", "schema": SCHEMA,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_a_thinking_model_answers_with_a_reasoning_item(tmp_path):
    from meshlm.model.demo import make_tiny

    model = make_tiny(tmp_path / "thinky", "qwen3", think=True)
    srv = ServerProcess(model, "--reasoning-parser", "qwen3", log_dir=tmp_path)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        name = c.models.list().data[0].id
        # The reply's start given as `<think>` (vLLM's continue_final_message passes on to the chat request),
        # and a bias on </think> (513) makes this random model end its reasoning soon.
        extra = {"logit_bias": {"513": 8}, "add_generation_prompt": False, "continue_final_message": True}
        messages = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "<think>"}]
        kw = dict(model=name, temperature=0, max_output_tokens=30, extra_body=extra, input=messages)
        whole = httpx.post(srv.url + "/v1/chat/completions", json={
            "messages": messages, "temperature": 0, "max_tokens": 30, **extra}, timeout=60).json()
        whole = whole["choices"][0]["message"]
        r = c.responses.create(**kw)
        events = list(c.responses.create(**kw, stream=True))
        # Cut inside the reasoning: whole and streamed, the same items with the same statuses.
        cut = {**kw, "max_output_tokens": 2, "extra_body": {**extra, "logit_bias": {"513": -100}}}
        shape = lambda resp: [(i.type, i.status) for i in resp.output]  # noqa: E731
        cut_whole, cut_stream = c.responses.create(**cut), list(c.responses.create(**cut, stream=True))[-1].response
        # A continued final message is stored as that message, grown (not a second assistant turn).
        follow = c.responses.create(model=name, previous_response_id=r.id, input="More?", max_output_tokens=2)
        merged = httpx.post(srv.url + "/v1/chat/completions", json={"max_tokens": 2, "messages": [
            messages[0], {"role": "assistant", "content": "<think>" + r.output_text},
            {"role": "user", "content": "More?"}]}, timeout=60).json()
    finally:
        srv.stop()
    assert shape(cut_whole) == shape(cut_stream) == [("reasoning", "incomplete")]
    assert follow.usage.input_tokens == merged["usage"]["prompt_tokens"]
    reasoning = [i for i in r.output if i.type == "reasoning"]
    assert whole["reasoning_content"] and reasoning[0].content[0].text == whole["reasoning_content"]
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == whole["reasoning_content"]
    assert r.output_text == (whole["content"] or "")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text


@pytest.mark.parametrize("body, words", [
    ({"input": "x", "previous_response_id": "resp_1"}, "No response with id 'resp_1'"),
    ({"input": "x", "conversation": "conv_1"}, "conversation objects are not kept"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item references are not supported"),
    ({"input": []}, "at least one item"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "text only"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
    ({"input": [{"type": "computer_call"}]}, "computer_call"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "functions only"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "nope"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "needs name and schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "needs schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["file_search_call.results"]}, "cannot be included"),
    ({"input": "x", "truncation": "auto"}, "auto"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "effort"),
    # chat's names: dropped as unknown fields, they were 200s with an unconstrained answer, one of n, no cap
    ({"input": "x", "structured_outputs": {"choice": ["yes", "no"]}}, "`structured_outputs` is a chat"),
    ({"input": "x", "guided_choice": ["yes", "no"]}, "/v1/chat/completions"),
    ({"input": "x", "response_format": {"type": "json_object"}}, "use `text.format`"),
    ({"input": "x", "n": 3}, "one output"),
    ({"input": "x", "max_tokens": 3}, "use `max_output_tokens`"),
    # chat's parameters a response has no place for, and ones chat itself refuses: passed on by name only
    # (20 of them), every other field was dropped, a 200 without a word (review helper-53)
    ({"input": "x", "logprobs": True}, "include `message.output_text.logprobs`"),
    ({"input": "x", "prompt_logprobs": 2}, "no prompt logprobs"),
    ({"input": "x", "return_token_ids": True}, "no token ids"),
    ({"input": "x", "echo": True}, "`echo` is a chat"),
    ({"input": "x", "use_beam_search": True}, "`use_beam_search` is not supported"),
    ({"input": "x", "priority": 5}, "`priority` is not supported"),
    ({"input": "x", "best_of": 3}, "best_of other than n"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "model": "gpt-9"}, "does not exist"),
    ({"input": "w " * 3000}, "context length"),
    ({"input": "w " * 2100}, "context length"),  # counted in tokens, not refused by its length alone
])
def test_what_cannot_be_done_is_a_400_naming_it(server, body, words):
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code in (400, 404) and words in r.json()["error"]["message"], r.text
    if words == "context length":  # chat's name for the prompt was given ("messages")
        assert r.json()["error"]["param"] == "input", r.text
    assert (r.status_code == 404) == ("model" in body or "previous_response_id" in body)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
    ({"input": "x", "logprobs": True}, "logprobs"),
    ({"input": "x", "use_beam_search": True}, "use_beam_search"),
])
def test_a_refusal_names_its_param(server, body, param):
    """Refusals made while the response became a chat request had `param: null` (review helper-53)."""
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chats_other_parameters_pass_on_and_a_null_stream_is_the_default(server, model):
    """`truncate_prompt_tokens` and `documents` reached the chat request only if named in a list of 20, so
    a response ignored them; `stream: null` was a 400 (review helper-53)."""
    def usage(**extra) -> int:
        r = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "model": model, "input": "the cat sat on the mat", "max_output_tokens": 2, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]

    whole = usage(stream=None)
    assert whole > 3 and usage(truncate_prompt_tokens=3) == 3
    assert usage(service_tier="auto", prompt_cache_key="k") == whole  # unknown to chat too: ignored there


def test_a_stored_response_is_continued_fetched_and_deleted(client, model):
    """store (OpenAI's default): previous_response_id continues the conversation as if it had been sent
    whole (the earlier instructions not carried over, as OpenAI's); GET returns the response, DELETE
    forgets it; store false keeps nothing."""
    first = client.responses.create(model=model, instructions="Be brief.", input="Hi", temperature=0,
                                    max_output_tokens=6)
    second = client.responses.create(model=model, previous_response_id=first.id, input="And then?",
                                     temperature=0, max_output_tokens=6, stream=True)
    second = [e for e in second][-1].response
    want = chat(client, model, [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": first.output_text},
                                {"role": "user", "content": "And then?"}], max_tokens=6)
    assert second.usage.input_tokens == want.usage.prompt_tokens and second.output_text == \
        want.choices[0].message.content
    assert second.previous_response_id == first.id and second.store
    got = client.responses.retrieve(second.id)  # a streamed response is kept too
    assert got.output_text == second.output_text and got.usage.input_tokens == second.usage.input_tokens
    third = client.responses.create(model=model, previous_response_id=second.id, input="Why?", temperature=0,
                                    max_output_tokens=4)  # a chain of three
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, previous_response_id=first.id, input="x")
    unkept = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    assert not unkept.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(second.id)


def test_input_items_list_what_a_response_was_answered_from(client, model, server):
    """`client.responses.input_items.list` (a 404 before): the earlier responses' inputs and outputs, then
    its own input, newest first by default, with ids, paged by `after` and `limit`."""
    first = client.responses.create(model=model, input="Hi", temperature=0, max_output_tokens=3)
    second = client.responses.create(
        model=model, previous_response_id=first.id, temperature=0, max_output_tokens=3,
        input=[{"role": "user", "content": "And?"},
               {"type": "message", "role": "user", "id": "msg_mine", "content": [{"type": "input_text", "text": "Go"}]}])
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message"] * 4
    assert [i.role for i in items] == ["user", "assistant", "user", "user"]
    assert items[0].content[0].text == "Hi" and items[0].content[0].type == "input_text"
    assert items[1].id == first.output[0].id and items[1].content[0].text == first.output_text
    assert items[2].content[0].text == "And?" and items[3].id == "msg_mine"
    assert len({i.id for i in items}) == 4 and items[1].status == first.output[0].status  # as answered
    assert [items[k].status for k in (0, 2, 3)] == ["completed"] * 3
    newest = client.responses.input_items.list(second.id)  # desc, OpenAI's default
    assert [i.id for i in newest.data] == [i.id for i in reversed(items)] and not newest.has_more
    page = client.responses.input_items.list(second.id, order="asc", limit=2, after=items[0].id)
    assert [i.id for i in page.data] == [items[1].id, items[2].id] and page.has_more
    assert page.first_id == items[1].id and page.last_id == items[2].id
    assert [i.id for i in client.responses.input_items.list(first.id).data] == [items[0].id]
    for query, words in (({"limit": 0}, "limit must be"), ({"order": "up"}, "order must be"),
                         ({"after": "msg_none"}, "no input item")):
        r = httpx.get(f"{server.url}/v1/responses/{second.id}/input_items", params=query, timeout=10)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = httpx.get(f"{server.url}/v1/responses/resp_none/input_items", timeout=10)
    assert r.status_code == 404, r.text
    r = httpx.post(server.url + "/v1/responses", json={"input": [{"role": "user", "content": "x", "id": 7}]})
    assert r.status_code == 400 and "input.0.id must be a string" in r.text


def test_a_function_call_continued_by_previous_response_id(client, model):
    first = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                    max_output_tokens=60)
    call = first.output[-1]
    got = client.responses.create(model=model, previous_response_id=first.id, tools=[WEATHER], temperature=0,
                                  max_output_tokens=8, input=[{"type": "function_call_output",
                                                               "call_id": call.call_id, "output": "sunny"}])
    want = chat(client, model, [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=8)
    assert got.usage.input_tokens == want.usage.prompt_tokens


def test_usage_counts_the_prompt_tokens_written_to_and_read_from_the_prefix_cache(server, model):
    """usage.input_tokens_details holds cache_write_tokens (the official SDK's types require it): the
    prompt's whole blocks this request added to the prefix cache; the same input again reads them
    (cached_tokens) and writes none. The bodies validate against the SDK's Response type, streamed too."""
    from openai.types.responses import Response

    body = {"model": model, "input": "count the blocks " * 40, "max_output_tokens": 2}
    first = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    again = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    for r in (first, again):
        Response.model_validate(r)
    written, cached = first["usage"]["input_tokens_details"], again["usage"]["input_tokens_details"]
    # (The chat template's opening may be cached already, from this module's other requests.)
    assert 0 < written["cache_write_tokens"] <= first["usage"]["input_tokens"] - written["cached_tokens"]
    assert cached["cached_tokens"] >= written["cache_write_tokens"] and cached["cache_write_tokens"] == 0
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "input": "a new prompt " * 40,
                                                                      "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    final = Response.model_validate(events[-1]["response"])
    assert final.usage.input_tokens_details.cache_write_tokens > 0


def test_a_response_that_fails_while_streaming_is_an_event_the_client_reads(server, model):
    """A structured output whose constraints leave no token fails mid-stream: before, `response.failed`
    carried chat's own code (`no_token_to_sample`), which the SDK's types refuse, and said `store: true`
    of a response never kept."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": model, "input": "hi", "stream": True, "max_output_tokens": 5,
            "text": {"format": {"type": "json_object"}}, "bad_words": ["{"]}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    failed = TypeAdapter(ResponseStreamEvent).validate_python(events[-1])
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "invalid_prompt"
    assert failed.response.error.message.startswith("no_token_to_sample: ")
    assert failed.response.store is False
    assert httpx.get(f"{server.url}/v1/responses/{failed.response.id}").status_code == 404


def test_retrieving_a_response_as_a_stream_is_a_clear_400(server):
    """OpenAI streams only background responses again; the stored JSON made the client's
    `responses.retrieve(id, stream=True)` yield nothing (helper-57)."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    made = c.responses.create(model=c.models.list().data[0].id, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        list(c.responses.retrieve(made.id, stream=True))
    assert c.responses.retrieve(made.id).id == made.id

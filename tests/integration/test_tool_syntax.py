"""Which tool-call syntax a request is shown and read in, with real templates' shapes: Llama 3.1's bare
JSON (meshlm's own parser), a template showing tools in a syntax nothing reads, Mistral's `[TOOL_CALLS]` as a
special token and its 9-character call ids, and --chat-template replacing the model's syntax."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest

from conftest import ServerProcess

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
FALLBACK_WORDS = "You can call the functions described below"  # meshlm's FALLBACK_PROMPT

# Llama 3.1's shape: the tools in the user turn as JSON, calls as a bare {"name", "parameters"} object, one
# past call a message, tool results in an `ipython` turn.
LLAMA31 = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined and message.tool_calls %}"
    "{%- if message.tool_calls | length != 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set call = message.tool_calls[0].function %}"
    "{{- '<|im_start|>assistant\n{\"name\": \"' + call.name + '\", \"parameters\": ' }}"
    "{{- call.arguments | tojson }}{{- '}<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + ('ipython' if message.role == 'tool' else message.role) + '\n' }}"
    "{%- if tools is not none and message.role == 'user' %}{{- 'Given the following functions, please respond "
    "with a JSON for a function call with its proper arguments that best answers the given prompt. Respond in "
    "the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}. Do not "
    "use variables. ' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}"
    "{%- endif %}{{- message.content if message.content is string else '' }}{{- '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# The pythonic shape (Llama 3.2's and 4's pythonic templates, vLLM's examples): a bare list of calls.
PYTHONIC = (
    "{%- if tools %}{{- '<|im_start|>system\\nIf you decide to invoke any of the function(s), you MUST put it in the "
    "format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]. ' }}"
    "{{- tools | tojson }}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{{- message.content if message.content is string else '' }}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A template that shows tools in a syntax neither mlx-lm nor meshlm reads.
UNREAD = (
    "{%- if tools %}{{- 'Tools: ' }}{{- tools | tojson }}{{- ' Call one as <<name(arguments)>>.' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' }}"
    "{{- message.content if message.content is string else '' }}{{- '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Mistral v0.3's shape: [AVAILABLE_TOOLS], calls as [TOOL_CALLS][{...}], ids of 9 letters and digits.
MISTRAL = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS]["
    "{%- for tc in message.tool_calls %}"
    "{%- if tc.id is not string or tc.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}, "
    "\"id\": \"{{ tc.id }}\"}{%- if not loop.last %}, {% endif %}{%- endfor %}]<|im_end|>"
    "{%- elif message.role == 'assistant' %}{{ message.content }}<|im_end|>"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id is not string or message.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "[TOOL_RESULTS]{\"content\": {{ message.content | tojson }}, \"call_id\": \"{{ message.tool_call_id }}\"}"
    "[/TOOL_RESULTS]{%- endif %}{%- endfor %}"
)
HERMES = (
    "{%- if tools %}{{- '<|im_start|>system\\nHermes tools: <tools>' }}{%- for t in tools %}{{- t | tojson }}"
    "{%- endfor %}{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- set tool_call = tool_call.function %}{{- '<tool_call>{\"name\": \"' + tool_call.name + '\"}</tool_call>' }}"
    "{%- endfor %}{%- else %}{{- message.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def model_with(src, dst, template: str, special_tool_calls: bool = False):
    """A copy of the tiny model with `template`; `special_tool_calls`: its special token 0 is
    `[TOOL_CALLS]`, as in Mistral-7B-Instruct-v0.3's tokenizer."""
    shutil.copytree(src, dst)
    if special_tool_calls:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            text = (dst / name).read_text()
            assert "<|endoftext|>" in text
            (dst / name).write_text(text.replace("<|endoftext|>", "[TOOL_CALLS]"))
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("syntax")
    logs = tmp_path_factory.mktemp("logs")
    llama = model_with(tiny_model, root / "llama31", LLAMA31)
    unread = model_with(tiny_model, root / "unread", UNREAD)
    pythonic = model_with(tiny_model, root / "pythonic", PYTHONIC)
    mistral = model_with(tiny_model, root / "mistral", MISTRAL, special_tool_calls=True)
    common = ("--max-model-len", "1024")
    out = {"llama31": ServerProcess(llama, *common, log_dir=logs),
           "unread": ServerProcess(unread, *common, log_dir=logs),
           "pythonic": ServerProcess(pythonic, *common, log_dir=logs),
           # vLLM's command line: the template's tools shown, its calls read as Hermes's
           "forced": ServerProcess(unread, *common, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                   log_dir=logs),
           "mistral": ServerProcess(mistral, *common, log_dir=logs),
           # the Mistral model told to speak Hermes: its own parser must not read the calls
           "override": ServerProcess(mistral, *common, "--chat-template", HERMES, log_dir=logs)}
    yield out
    for s in out.values():
        s.stop()


def prompt_text(server: ServerProcess, body: dict) -> str:
    r = httpx.post(server.url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    return httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]


def answer(server: ServerProcess, forced: dict, stream: bool = False, **body) -> dict:
    """The chat answer when the model is made to write what `forced` (a structured_outputs) spells."""
    body = {"messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 200,
            "structured_outputs": forced, **body}
    if not stream:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {"content": choice["message"]["content"], "finish": choice["finish_reason"],
                "calls": [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                          for c in choice["message"].get("tool_calls") or ()]}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    calls: dict[int, list] = {}
    for tc in (tc for d in deltas for tc in d["delta"].get("tool_calls") or ()):
        call = calls.setdefault(tc["index"], [None, "", ""])
        call[0] = tc.get("id") or call[0]
        call[1] += tc["function"].get("name") or ""
        call[2] += tc["function"].get("arguments") or ""
    return {"content": "".join(d["delta"].get("content") or "" for d in deltas) or None,
            "finish": [d["finish_reason"] for d in deltas if d["finish_reason"]][-1],
            "calls": [(i, n, json.loads(a)) for i, n, a in calls.values()]}


def test_a_template_with_tools_but_no_parser_gets_the_fallback_syntax(servers):
    """A template that shows tools in a syntax nothing reads: the calls it asks for would come back as text,
    so the model is shown meshlm's fallback syntax, which is read."""
    unread = servers["unread"]
    text = prompt_text(unread, {"messages": ASK, "tools": [WEATHER]})
    assert FALLBACK_WORDS in text and "<<name(arguments)>>" not in text
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    got = answer(unread, {"regex": re.escape(call)})
    assert got["finish"] == "tool_calls" and [c[1:] for c in got["calls"]] == [("get_weather", {"city": "Paris"})]
    # A past call goes back in the syntax the model was shown
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt_text(
        unread, {"messages": history, "tools": [WEATHER]})


def test_tool_call_parser_names_the_syntax_whatever_the_template(servers):
    """vLLM's --tool-call-parser (and --enable-auto-tool-choice) were unknown flags: a template whose syntax
    nothing infers could only get the fallback prompt."""
    forced = servers["forced"]
    assert "tool calls: mlx-lm's json_tools (--tool-call-parser)" in forced.log.read_text()
    text = prompt_text(forced, {"messages": ASK, "tools": [WEATHER]})
    assert "<<name(arguments)>>" in text and FALLBACK_WORDS not in text  # the template's own tools
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    got = answer(forced, {"regex": re.escape(call)})
    assert got["finish"] == "tool_calls" and [c[1:] for c in got["calls"]] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [False, True])
def test_a_pythonic_template_gets_its_tools_and_its_bare_list_is_read(servers, stream):
    """Templates asking for a bare `[f(a=1)]` list (vLLM's `pythonic`) were shown the fallback prompt:
    mlx-lm reads that list only between LFM2's markers."""
    pythonic = servers["pythonic"]
    assert "the pythonic syntax of the model's chat template" in pythonic.log.read_text()
    text = prompt_text(pythonic, {"messages": ASK, "tools": [WEATHER]})
    assert "you MUST put it in the format of [func_name1" in text and FALLBACK_WORDS not in text
    got = answer(pythonic, {"regex": re.escape('[get_weather(city="Paris", days=2)]')}, stream)
    assert got["finish"] == "tool_calls" and got["content"] is None, got
    assert [c[1:] for c in got["calls"]] == [("get_weather", {"city": "Paris", "days": 2})]
    got = answer(pythonic, {"regex": re.escape('Sunny [get_weather(city="Paris")]')}, stream)
    assert got["calls"] == [] and got["content"] == 'Sunny [get_weather(city="Paris")]'


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_models_get_their_own_template_and_their_json_calls_are_read(servers, stream):
    """Llama 3.1-3.3's templates ask for a bare {"name", "parameters"} object, which mlx-lm has no parser
    for: such models were shown meshlm's fallback prompt instead of the tools as they were trained on."""
    llama = servers["llama31"]
    assert "the llama3 syntax of the model's chat template" in llama.log.read_text()
    text = prompt_text(llama, {"messages": ASK, "tools": [WEATHER]})
    assert FALLBACK_WORDS not in text and "Respond in the format" in text and '"get_weather"' in text
    got = answer(llama, {"regex": re.escape(LLAMA_CALL)}, stream)
    assert got["finish"] == "tool_calls" and got["content"] is None, got
    assert [c[1:] for c in got["calls"]] == [("get_weather", {"city": "Paris"})]
    two = LLAMA_CALL + "; " + LLAMA_CALL.replace("Paris", "Rome")
    got = answer(llama, {"regex": re.escape(two)}, stream)
    assert [c[1:] for c in got["calls"]] == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    # An answer that is not a call is content, whole, streamed or not
    got = answer(llama, {"regex": re.escape("Sunny, " + LLAMA_CALL)}, stream)
    assert got == {"content": "Sunny, " + LLAMA_CALL, "finish": "stop", "calls": []}


def test_a_llama3_round_trip_renders_the_past_call_and_its_result(servers):
    llama = servers["llama31"]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = prompt_text(llama, {"messages": history, "tools": [WEATHER]})
    assert LLAMA_CALL + "<|im_end|>\n<|im_start|>ipython\nsunny" in text and "<tool_call>" not in text
    # The template takes one call a message; two are its 400, naming it, as vLLM's
    two = [{**history[1]["tool_calls"][0], "id": f"call_{i}"} for i in (1, 2)]
    r = httpx.post(llama.url + "/v1/chat/completions", json={
        "messages": ASK + [{"role": "assistant", "content": None, "tool_calls": two}], "tools": [WEATHER]})
    assert r.status_code == 400 and "single tool-calls" in r.text, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_special_token_tool_marker_keeps_the_call(servers, stream):
    """Mistral's [TOOL_CALLS] is a special token: skip_special_tokens took it out of the text, and the
    call came back as content. The call's id is 9 letters and digits, which Mistral's template needs."""
    mistral = servers["mistral"]
    assert "[AVAILABLE_TOOLS]" in prompt_text(mistral, {"messages": ASK, "tools": [WEATHER]})
    forced = {"grammar": 'start: <[0]> ' + json.dumps('[{"name": "get_weather", "arguments": {"city": "Paris"}}]')}
    got = answer(mistral, forced, stream)
    assert got["finish"] == "tool_calls" and got["content"] is None, got
    ((call_id, name, arguments),) = got["calls"]
    assert (name, arguments) == ("get_weather", {"city": "Paris"})
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id), call_id
    # The client's own choice wins: the marker then stays out, and the text is content
    plain = answer(mistral, forced, stream, skip_special_tokens=True)
    assert plain["calls"] == [] and plain["content"].startswith('[{"name": "get_weather"')


def test_a_mistral_round_trip_takes_the_ids_it_was_given_and_longer_ones(servers):
    """Mistral's template refuses ids that are not 9 letters and digits: meshlm's own `call_<24 hex>`
    came back as a 400. Longer ids are cut to their last 9, as vLLM does."""
    mistral = servers["mistral"]
    for call_id, sent in (("abcDEF123", "abcDEF123"), ("call_0123456789abcdef01234567", "89abcdef01234567"[-9:])):
        history = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
        text = prompt_text(mistral, {"messages": history, "tools": [WEATHER]})
        # empty arguments are {} (as vLLM maps them): templates iterate them as a mapping
        assert f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{}}, "id": "{sent}"}}]' in text
        assert f'"call_id": "{sent}"' in text
        r = httpx.post(mistral.url + "/v1/chat/completions", json={"messages": history, "tools": [WEATHER],
                                                                   "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_chat_template_replaces_the_models_tool_syntax(servers):
    """--chat-template kept the parser of the model's own template: the Mistral model told to speak
    Hermes had its `<tool_call>` calls come back as text."""
    override = servers["override"]
    assert "tool calls: the json_tools syntax of --chat-template" in override.log.read_text()
    assert "Hermes tools: <tools>" in prompt_text(override, {"messages": ASK, "tools": [WEATHER]})
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    got = answer(override, {"regex": re.escape(call)})
    assert got["finish"] == "tool_calls" and [c[1:] for c in got["calls"]] == [("get_weather", {"city": "Paris"})]
    assert not re.fullmatch(r"[A-Za-z0-9]{9}", got["calls"][0][0])  # not Mistral's ids any more

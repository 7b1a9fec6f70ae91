"""Named chat templates (tokenizer_config.json's list: `default` and `tool_use`, as Hermes-2-Pro ships):
a request with tools is rendered by `tool_use`, in the model's own tool syntax, not meshlm's fallback."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest

from conftest import ServerProcess

# Hermes-2-Pro's shape: the tools in the system turn, calls as <tool_call>{json}</tool_call>.
TOOL_USE = (
    "{{- '<|im_start|>system\\nYou are a function calling AI model. <tools> ' }}"
    "{%- for tool in tools %}{{- tool.function.name + ': ' + tool.function.description + ' ' }}{%- endfor %}"
    "{{- '</tools> For each call return <tool_call>{\"name\": <function-name>, \"arguments\": <args-dict>}"
    "</tool_call><|im_end|>\\n' }}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>{\"name\": \"' + tool_call.name + '\"}</tool_call>' }}{%- endfor %}"
    "{%- else %}{{- message.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def with_named_templates(src, dst, tool_use: str = TOOL_USE):
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": config["chat_template"]},
                               {"name": "tool_use", "template": tool_use}]
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def named(tiny_model, tmp_path_factory):
    return with_named_templates(tiny_model, tmp_path_factory.mktemp("named") / "model")


@pytest.fixture(scope="module")
def server(named, tmp_path_factory):
    srv = ServerProcess(named, "--max-model-len", "512", log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    srv.stop()


def test_the_tool_parser_comes_from_the_tool_use_template(named):
    from mlx_lm import load

    from meshlm.model.chat_templates import adopt_tool_parser

    _, tok = load(str(named))
    assert tok.tool_parser is None  # mlx-lm reads string templates only
    assert adopt_tool_parser(tok) == "json_tools"
    assert (tok.tool_call_start, tok.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tok.tool_parser('{"name": "f", "arguments": {}}') == {"name": "f", "arguments": {}}
    assert adopt_tool_parser(tok) is None  # once


def prompt_text(server: ServerProcess, body: dict) -> str:
    r = httpx.post(server.url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_a_request_with_tools_is_rendered_by_the_tool_use_template(server):
    with_tools = prompt_text(server, {"messages": ASK, "tools": [WEATHER]})
    assert "You are a function calling AI model. <tools> get_weather: Weather in a city </tools>" in with_tools
    assert "You can call the functions described below" not in with_tools  # meshlm's fallback prompt
    plain = prompt_text(server, {"messages": ASK})
    assert "function calling" not in plain and plain.startswith("<|im_start|>user\nWeather in Paris?")
    assert "tool calls: the json_tools syntax of the model's tool_use chat template" in server.log.read_text()


def test_a_call_in_the_models_syntax_reaches_the_openai_client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=ASK, tools=[WEATHER], max_tokens=200,
                                  temperature=0, extra_body={"structured_outputs": {"regex": re.escape(call)}})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    (got,) = r.choices[0].message.tool_calls
    assert (got.function.name, json.loads(got.function.arguments)) == ("get_weather", {"city": "Paris"})
    # The call goes back to the model in its own syntax, through the tool_use template.
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [got.model_dump()]},
                     {"role": "tool", "tool_call_id": got.id, "content": "sunny"}]
    text = prompt_text(server, {"messages": history, "tools": [WEATHER]})
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather"}</tool_call><|im_end|>' in text


def test_a_tool_use_template_that_never_ends_stops_the_start(tiny_model, tmp_path, caplog):
    from mlx_lm import load

    from meshlm.api.prompts import check_own_template

    endless = "{% for i in range(100000) %}{% for j in range(600) %}{% endfor %}{% endfor %}{{ tools }}"
    path = with_named_templates(tiny_model, tmp_path / "endless", tool_use=endless)
    _, tok = load(str(path))
    with pytest.raises(ValueError, match="the model's tool_use chat template did not render .* within 0.5 s"):
        check_own_template(tok, {}, 512, within=0.5)
    _, tok = load(str(with_named_templates(tiny_model, tmp_path / "raises", tool_use="{{ raise_exception('no') }}")))
    check_own_template(tok, {}, 512)  # served: chats without tools work
    assert "tool_use chat template does not render a user's message (TemplateError: no): every chat request " \
           "with tools will fail" in caplog.text


def test_past_calls_stay_in_the_prompt_when_the_default_template_renders(server):
    """With tool_choice none (or no tools) a named set renders its `default` template, which knows no
    tool calls: past calls vanished from the prompt. They are written in the fallback syntax then."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    for body in ({"messages": history, "tools": [WEATHER], "tool_choice": "none"}, {"messages": history}):
        text = prompt_text(server, body)
        assert "function calling" not in text  # the default template
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    # with tools, the tool_use template renders them its own way
    assert '<tool_call>{"name": "get_weather"}</tool_call>' in prompt_text(server, {"messages": history, "tools": [WEATHER]})

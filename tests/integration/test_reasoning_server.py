"""A thinking model's reasoning against real servers (review helper-40): think tags that are special
tokens, a think block the prompt closed (Qwen3's `enable_thinking: false`) or that a continued message
holds, the reasoning of past turns given back to the template, and vLLM's `reasoning` / `include_reasoning`.
Where the tags fall in the text: tests/unit/test_reasoning.py."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from conftest import ServerProcess

THINK, END = 512, 513  # the tiny thinking model's <think> and </think>, after its 512 trained tokens
# Qwen3's shape: a closed block for enable_thinking false, past reasoning rendered back.
TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content %}{{- '<think>' + m.reasoning_content + '</think>' }}"
    "{%- endif %}{{- m.content or '' }}"
    "{%- if not (loop.last and m.role == 'assistant' and not add_generation_prompt) %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
DIGIT = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
    "additionalProperties": False}}}
OPEN = {"messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "<think>"}],
        "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 40, "temperature": 0}


def special_tags(src, dst):
    """A copy whose think tags are special tokens (as in some thinking models' tokenizers)."""
    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    for t in tok["added_tokens"]:
        if t["content"] in ("<think>", "</think>"):
            t["special"] = True
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from meshlm.model.demo import make_tiny

    root = tmp_path_factory.mktemp("thinking")
    plain = make_tiny(root / "plain", "qwen3", think=True)
    special = special_tags(plain, root / "special")
    logs = tmp_path_factory.mktemp("logs")
    args = ("--reasoning-parser", "qwen3", "--chat-template", TEMPLATE, "--max-model-len", "512")
    out = {"plain": ServerProcess(plain, *args, log_dir=logs), "special": ServerProcess(special, *args, log_dir=logs)}
    yield out
    for s in out.values():
        s.stop()


def chat(server: ServerProcess, body: dict, stream: bool = False) -> dict:
    """The message (or the deltas accumulated) of the one choice."""
    if not stream:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    out: dict = {}
    for d in deltas:
        for k in ("content", "reasoning_content", "reasoning"):
            if d.get(k) is not None:
                out[k] = out.get(k, "") + d[k]
    return {"content": out.get("content") or None, **{k: out[k] for k in ("reasoning_content", "reasoning") if k in out}}


@pytest.mark.parametrize("stream", [False, True])
def test_special_think_tags_split_the_reasoning_from_a_schemas_answer(servers, stream):
    """Special-token tags were skipped from the text the split reads: the reasoning ran into the content,
    which was then not JSON."""
    special = servers["special"]
    assert httpx.post(special.url + "/detokenize", json={"tokens": [END]}).json()["prompt"] == "</think>"
    body = {**OPEN, "logit_bias": {str(END): 8}, "response_format": DIGIT}
    got = chat(special, body, stream)
    assert set(json.loads(got["content"])) == {"n"}
    assert got["reasoning_content"] and "</think>" not in got["reasoning_content"] + got["content"]
    assert got == chat(servers["plain"], body, stream)  # the same weights with plain tags: the same answer


@pytest.mark.parametrize("stream", [False, True])
def test_a_block_the_prompt_closed_leaves_the_whole_output_to_the_grammar(servers, stream):
    """enable_thinking false writes <think>\\n\\n</think>: a grammar still allowed <think> first, and a model
    that wanted it reasoned anyway."""
    body = {"messages": [{"role": "user", "content": "Why?"}], "chat_template_kwargs": {"enable_thinking": False},
            "max_tokens": 40, "temperature": 0, "logit_bias": {str(THINK): 30}, "response_format": DIGIT}
    for name in ("plain", "special"):
        got = chat(servers[name], body, stream)
        assert "reasoning_content" not in got and set(json.loads(got["content"])) == {"n"}, got


def test_a_continued_message_says_whether_its_reasoning_is_over(servers):
    """Only a prompt ending in <think> opened the block: a continued message with reasoning already
    under way ("<think>hm") was answered as content, `</think>` and all (vLLM's and mlx-lm's parsers read
    the last tag)."""
    first = OPEN["messages"][0]
    under_way = chat(servers["plain"], {**OPEN, "messages": [first, {"role": "assistant", "content": "<think>hm"}],
                                        "max_tokens": 6})
    assert under_way["content"] is None and under_way["reasoning_content"]  # a random model never closes it
    over = chat(servers["plain"], {**OPEN, "messages": [first, {"role": "assistant", "content": "<think>hm</think>Th"}],
                                   "max_tokens": 6})
    assert "reasoning_content" not in over and over["content"]


def test_reasoning_names_past_reasoning_and_include_reasoning(servers):
    plain = servers["plain"]
    got = chat(plain, OPEN)
    assert got["reasoning"] == got["reasoning_content"] and got["reasoning"]  # vLLM's and mlx-lm's name too
    hidden = chat(plain, {**OPEN, "include_reasoning": False})
    assert "reasoning" not in hidden and "reasoning_content" not in hidden and hidden["content"] is None
    # An assistant turn's reasoning reaches the template (Qwen3's renders it back in tool loops)
    history = [{"role": "user", "content": "Why?"},
               {"role": "assistant", "content": "Because.", "reasoning_content": "weighing it"},
               {"role": "user", "content": "Sure?"}]
    r = httpx.post(plain.url + "/tokenize", json={"messages": history})
    text = httpx.post(plain.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert "<think>weighing it</think>Because." in text
    r = httpx.post(plain.url + "/tokenize", json={"messages": [
        history[0], {"role": "assistant", "content": "Because.", "reasoning": "weighing it"}, history[2]]})
    assert httpx.post(plain.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"] == text

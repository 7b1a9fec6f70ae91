"""Input checks below the HTTP layer: JSON limits, token ids, the length bound, sampling defaults."""

from __future__ import annotations

import asyncio
import json

import pytest

from meshlm.api.body import BodyLimits, check_limits, parse_json_string, parse_json_sync
from meshlm.api.errors import APIError
from meshlm.api.prompts import PromptBuilder, longest_token_chars
from meshlm.api.schemas import CompletionRequest
from meshlm.api.serving import SamplingDefaults


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body, words", [
    (b'{"a": NaN}', "not valid JSON"),
    (b'{"a": -Infinity}', "not valid JSON"),
    (b'[1]', "JSON object"),
    (b'{"a": ' + b"1" * 400 + b"}", ""),
    (b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", "nests deeper than 32"),
    (b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nests deeper"),
    (b'{"a": [1, 2, 18446744073709551616]}', "out of range"),
    (b'{"a": {"b": [{"c": -18446744073709551616}]}}', "a.b[0].c: integer out of range"),
    (b'{"prompt": "\xff"}', "not valid JSON (UTF-8)"),
    (b'{"prompt": "\xed\xa0\x80"}', "not valid JSON (UTF-8)"),  # an encoded surrogate
    (b'{"\xc3": 1}', "not valid JSON (UTF-8)"),  # a sequence cut short, in a key
])
def test_json_limits(body, words):
    err = refused(parse_json_sync, body, BodyLimits())
    assert words in err.message


def test_json_within_limits_passes_untouched():
    data = {"prompt": list(range(100_000)), "seed": 2**64 - 1, "x": [[[[1.5, "s", None]]]]}
    assert parse_json_sync(json.dumps(data).encode(), BodyLimits()) == data


@pytest.mark.parametrize("text, words", [
    ("[" * 100_000 + "]" * 100_000, "nests deeper than 32"),  # RecursionError in json.loads
    ("[" * 480 + "]" * 480, "nests deeper than 32 levels (at guided_json[0]"),
    ('{"type": "number", "maximum": NaN}', "guided_json is not valid JSON"),
    ('{"type": "number", "minimum": -Infinity}', "guided_json is not valid JSON"),
    ('{"type": "integer", "maximum": ' + "9" * 5000 + "}", "out of range"),
    ('{"enum": [18446744073709551616]}', "out of range"),
    ('{"type": ', "guided_json is not valid JSON"),
    ('{"enum": ["\ud800"]}', "guided_json is not valid JSON (UTF-8)"),  # a lone surrogate a str can hold
])
def test_a_json_string_in_the_body_is_held_to_the_body_limits(text, words):
    err = refused(parse_json_string, text, "guided_json", 2, BodyLimits())
    assert words in err.message and err.param == "guided_json", err.message


def accepts(fn, *args) -> bool:
    try:
        fn(*args)
    except APIError:
        return False
    return True


@pytest.mark.parametrize("levels", [31, 32])
def test_a_json_string_nests_as_deep_as_the_same_json_in_its_place(levels):
    """Sent as a string or as JSON in the same place, a schema meets the same depth limit."""
    value = "[" * levels + "]" * levels
    as_json = accepts(parse_json_sync, b'{"guided_json": ' + value.encode() + b"}", BodyLimits())
    as_string = accepts(parse_json_string, value, "guided_json", 2, BodyLimits())
    assert as_json == as_string == (levels == 31)
    if as_string:
        assert parse_json_string(value, "guided_json", 2, BodyLimits()) == json.loads(value)


def test_depth_walk_is_iterative_and_names_the_path():
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    err = refused(check_limits, {"messages": deep}, 32)
    assert err.param == "messages"


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def encode(self, text, add_special_tokens=True):
        return [self.vocab.get(ch, 0) for ch in text]


def builder(max_len: int = 10) -> PromptBuilder:
    return PromptBuilder(FakeTokenizer({"a": 1, "bb": 2, "<|special|>": 3}), vocab_size=8, max_model_len=max_len)


def test_longest_token_includes_special_tokens():
    assert longest_token_chars(FakeTokenizer({"a": 1, "<|special|>": 3})) == 11


@pytest.mark.parametrize("prompt, where", [
    ([1, 8], "prompt[1]"), ([-1], "prompt[0]"), ([[1], [2, 3, 99]], "prompt[1][2]"), ([[]], "prompt[0]"),
])
def test_ids_outside_the_vocabulary_name_their_position(prompt, where):
    req = CompletionRequest(prompt=prompt)
    with pytest.raises(APIError) as info:
        asyncio.run(builder().completion(req))
    assert where in info.value.message and info.value.param == "prompt"


def test_text_that_cannot_fit_is_refused_without_tokenizing():
    b = builder(max_len=10)  # at most 10 tokens x 11 characters x margin 4 = 440 characters
    b.tokenizer.encode = lambda *a, **k: pytest.fail("tokenized")
    b._fast = None
    with pytest.raises(APIError) as info:
        asyncio.run(b.completion(CompletionRequest(prompt="a" * 441)))
    assert info.value.code == "context_length_exceeded"


def test_a_templated_chat_that_cannot_fit_is_refused_without_tokenizing():
    """Regression: only the messages' text was bounded, so megabytes of a past tool call's arguments (or
    tool definitions, or 200,000 short messages) were tokenized in full before the same 400. The templated
    text is bounded too, before it is tokenized. A template that leaves messages out is not held to them."""
    from meshlm.api.schemas import ChatCompletionRequest

    b = builder(max_len=10)  # 440 characters at most
    b.tokenizer.apply_chat_template = lambda messages, **kw: "".join(
        m["content"] + "".join(c["function"]["arguments"] for c in m.get("tool_calls") or ()) for m in messages)
    b.tokenizer.chat_template = "{{ messages }}"  # renders tools itself: calls stay calls
    b._fast = None
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "a" * 441}}
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [call]}]})
    b.tokenizer.encode = lambda *a, **k: pytest.fail("tokenized")
    with pytest.raises(APIError) as info:
        asyncio.run(b.chat(req))
    assert info.value.code == "context_length_exceeded"
    b.tokenizer.apply_chat_template = lambda messages, **kw: messages[-1]["content"]  # the last message only
    b.tokenizer.encode = FakeTokenizer(b.tokenizer.vocab).encode
    many = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}] * 50})
    assert asyncio.run(b.chat(many)) == [1]  # 50 messages, more than the context's 10 tokens: it fits


def test_tokenized_ids_are_checked_too():
    b = builder()
    b.tokenizer.encode = lambda text, add_special_tokens=True: [1, 50]  # a tokenizer larger than the model
    b._fast = None
    with pytest.raises(APIError) as info:
        asyncio.run(b.completion(CompletionRequest(prompt="ab")))
    # the client sent text: its `prompt[1]` (or a chat's `messages[6]`) was read as an index into the request
    assert info.value.message.startswith("prompt: the tokenizer made token 1 of the prompt id 50, outside the ")
    assert "tokenizer holds more tokens than its embedding" in info.value.message


def test_fast_backend_matches_the_tokenizer(tmp_path):
    from mlx_lm.tokenizer_utils import load

    from meshlm.model.demo import make_tiny

    tok = load(make_tiny(tmp_path / "m", "llama", layers=1, hidden=32, heads=2, kv_heads=1))
    b = PromptBuilder(tok, vocab_size=512, max_model_len=4096)
    assert b._fast is not None
    for text in ["hello world", "<|im_start|>user\nhi<|im_end|>", "émoji 😀 and numbers 12345", ""]:
        assert b._encode_many([text], True) == [list(tok.encode(text))]
        assert b._encode_many([text], False) == [list(tok.encode(text, add_special_tokens=False))]


def test_sampling_defaults_resolution():
    assert SamplingDefaults.resolve({}).source == "OpenAI defaults"
    model = SamplingDefaults.resolve({"temperature": 0.2, "top_p": 0.9})
    assert (model.temperature, model.top_p, model.source) == (0.2, 0.9, "generation_config.json")
    flag = SamplingDefaults.resolve({"temperature": 0.2, "top_k": 5}, temperature=0.7)
    assert (flag.temperature, flag.top_k, flag.source) == (0.7, 5, "server flags over generation_config.json")
    for bad in ({"temperature": 7}, {"top_p": "high"}):
        with pytest.raises(ValueError):
            SamplingDefaults.resolve(bad)
    # top_k 2.5 was taken, and failed every sampled request ('Cannot index mlx array using the given type')
    with pytest.raises(ValueError, match=r"wrong type \(generation_config.json\): top_k 2.5 \(an integer\)"):
        SamplingDefaults.resolve({"top_k": 2.5})
    with pytest.raises(ValueError, match="top_p '0.9'"):  # was "'<' not supported between 'int' and 'str'"
        SamplingDefaults.resolve({"top_p": "0.9"})
    assert SamplingDefaults.resolve({"top_k": 50.0}).top_k == 50
    assert SamplingDefaults.resolve({"repetition_penalty": 1.05}).repetition_penalty == 1.05
    assert SamplingDefaults.resolve({}).repetition_penalty == 1.0
    for bad in (0, -1, 11, True):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingDefaults.resolve({"repetition_penalty": bad})


def test_a_content_part_that_is_not_text_is_refused_saying_so():
    """An image_url part was refused as 'messages.0.content.str: Input should be a valid string'."""
    from pydantic import ValidationError

    from meshlm.api.schemas import ChatCompletionRequest

    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(ValidationError, match="content parts of type 'image_url' are not supported"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    ok = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts[:1]}]})
    assert ok.messages[0].text() == "what is this?"


def test_a_tool_message_names_the_call_it_answers():
    """A tool answer without tool_call_id was taken (OpenAI: 400 'Missing required parameter')."""
    from pydantic import ValidationError

    from meshlm.api.schemas import ChatCompletionRequest

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    for missing in ({}, {"tool_call_id": ""}, {"tool_call_id": None}):
        with pytest.raises(ValidationError, match="role 'tool' needs tool_call_id"):
            ChatCompletionRequest.model_validate({"messages": [*history, {"role": "tool", "content": "1", **missing}]})
    ok = ChatCompletionRequest.model_validate(
        {"messages": [*history, {"role": "tool", "content": "1", "tool_call_id": "call_1"}]})
    assert ok.messages[2].tool_call_id == "call_1"


def test_an_assistant_refusal_part_in_the_history_is_its_text():
    """The client's own assistant-message type has refusal parts; chat refused them as 'not text' (the
    Responses API took them)."""
    from meshlm.api.schemas import ChatCompletionRequest

    history = [{"role": "user", "content": "do it"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."},
                                                 {"type": "text", "text": " Sorry."}]},
               {"role": "user", "content": "please"}]
    req = ChatCompletionRequest.model_validate({"messages": history})
    assert req.messages[1].text() == "I can't. Sorry."


def _bos_model(path):
    """A tiny model whose tokenizer puts a BOS (id 0) before every text, as Llama's tokenizers do."""
    from meshlm.model.demo import make_tiny

    model = make_tiny(path, "llama", layers=1, hidden=32, heads=2, kv_heads=1)
    tok_json = json.loads((model / "tokenizer.json").read_text())
    tok_json["post_processor"] = {  # a BOS before every text, as Llama's tokenizers add one
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
    (model / "tokenizer.json").write_text(json.dumps(tok_json))
    return model


def test_a_completions_add_special_tokens_false_leaves_out_the_bos(tmp_path):
    """vLLM's add_special_tokens on completions was dropped as an unknown field: a prompt that already
    began with the BOS got it twice (review helper-42)."""
    from mlx_lm.tokenizer_utils import load

    b = PromptBuilder(load(_bos_model(tmp_path / "m")), vocab_size=512, max_model_len=4096)
    (with_bos,) = asyncio.run(b.completion(CompletionRequest(prompt="hi")))
    (without,) = asyncio.run(b.completion(CompletionRequest(prompt="hi", add_special_tokens=False)))
    assert with_bos[0] == 0 and with_bos[1:] == without and 0 not in without


def test_a_chats_add_special_tokens_true_adds_the_bos_on_top_of_the_template(tmp_path):
    """vLLM's add_special_tokens on chat (default false: the template writes them) was ignored as an
    unknown field, while /tokenize of the same messages honoured it (review helper-53)."""
    from mlx_lm.tokenizer_utils import load

    from meshlm.api.schemas import ChatCompletionRequest, TokenizeChatRequest

    b = PromptBuilder(load(_bos_model(tmp_path / "m")), vocab_size=512, max_model_len=4096)
    messages = [{"role": "user", "content": "hi"}]
    plain = asyncio.run(b.chat(ChatCompletionRequest(messages=messages)))
    special = asyncio.run(b.chat(ChatCompletionRequest(messages=messages, add_special_tokens=True)))
    assert special[0] == 0 and special[1:] == plain and plain[0] != 0
    assert asyncio.run(b.chat(TokenizeChatRequest(messages=messages, add_special_tokens=True))) == special

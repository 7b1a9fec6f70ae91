"""OpenAI's Responses API request (`POST /v1/responses`), and the chat completion request it amounts to.

A response here is a chat completion under another shape: the input items
become chat messages (instructions first, a system message, then the
conversation `previous_response_id` closes, api/response_store.py), function
tools and `text.format` become chat's `tools` and `response_format`, and the
chat path then does everything (template, tool calls, structured output,
reasoning split). What needs state this server does not keep
(`conversation` objects, `background` runs, item references, stored prompts)
or tools meshlm does not run (web search, files, code) is refused with a 400
naming it.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator,
                      model_validator)

from meshlm.api.schemas import MAX_TOOLS, ChatCompletionRequest, _refuse, nulls_as_defaults

MAX_METADATA = 16  # OpenAI's limit: pairs, keys up to 64 characters, values up to 512
# `include` values this server gives: encrypted reasoning needs nothing (it only matters to a server that
# keeps reasoning hidden; this one returns the text itself), and the message's logprobs.
LOGPROBS = "message.output_text.logprobs"
_INCLUDABLE = frozenset({"reasoning.encrypted_content", LOGPROBS})
_ROLES = ("user", "assistant", "system", "developer")
# Every other field a response request carries (vLLM's extensions, OpenAI's older sampling parameters) is
# passed on to the chat request, which honours, refuses or ignores it as it would its own: only the 20 kept
# by name once were, and the rest gave 200s without a word, `use_beam_search` and `truncate_prompt_tokens`
# alike. These few chat parameters shape a chat answer that a response has no place for, so they are refused.
_CHAT_SHAPE = {
    "logprobs": "include `message.output_text.logprobs` (and give `top_logprobs`)",
    "echo": "a response does not repeat its input",
    "prompt_logprobs": "a response carries no prompt logprobs",
    "return_token_ids": "a response carries no token ids",
    "return_tokens_as_token_ids": "a response carries no token ids",
    "suffix": "send it to /v1/completions, which refuses it too",
}
# The one chat name a response's own fields do not declare but `chat_body` sets itself (streaming needs the
# usage); OpenAI's Responses `stream_options` (include_obfuscation) means nothing to chat.
_STREAM_OPTIONS = "stream_options"
_NULL_STREAM = frozenset({"stream"})
_TEXT_PARTS = ("input_text", "output_text", "text")
_RESPONSES_NAME = {  # what a response request says instead of a chat parameter
    "n": "a response has one output: send one request per answer",
    "max_tokens": "use `max_output_tokens`",
    "max_completion_tokens": "use `max_output_tokens`",
    "response_format": "use `text.format`",
    "messages": "use `input`",
    "guided_json": "use `text.format` with a json_schema",
    "structured_outputs": "use `text.format` with a json_schema, or /v1/chat/completions for the other kinds",
}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # passed on to the chat request (`chat_body`)

    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA)
    # Kept for previous_response_id and GET (api/response_store.py); null or omitted: true, OpenAI's default
    store: StrictBool | None = None
    previous_response_id: str | None = Field(None, max_length=200)
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    user: str | None = None
    # Server-side state, tools and prompts this server does not have.
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    background: Any = None
    # Chat's names for what a response says otherwise, or cannot say: dropped as unknown fields, they gave
    # 200s with another answer than asked for (an unconstrained one, one choice of n, no length cap).
    n: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    response_format: Any = None
    messages: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_stream_is_default(cls, data: Any) -> Any:
        """`stream: null` is OpenAI's nullable default (its SDK sends None as null), as on chat."""
        return nulls_as_defaults(data, _NULL_STREAM)

    @field_validator("conversation")
    @classmethod
    def _no_conversations(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("conversation objects are not kept by this server: continue one with "
                             "`previous_response_id`, or send it whole in `input`")
        return value

    @field_validator("prompt", "max_tool_calls")
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        return _refuse(info.field_name, value)

    @field_validator("n", "max_tokens", "max_completion_tokens", "response_format", "messages",
                     "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    @classmethod
    def _chat_only(cls, value: Any, info) -> Any:
        if value is None:
            return value
        instead = _RESPONSES_NAME.get(info.field_name, "send it to /v1/chat/completions, which takes it")
        raise ValueError(f"`{info.field_name}` is a chat completions parameter, not a Responses one: {instead}")

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: Any) -> Any:
        return value if value in (None, False) else _refuse("background", value)

    @field_validator("input")
    @classmethod
    def _some_input(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("needs at least one item")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, item in (value or {}).items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError("keys may be at most 64 characters and values at most 512")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str] | None) -> list[str] | None:
        other = sorted(set(value or ()) - _INCLUDABLE)
        if other:
            raise ValueError(f"{', '.join(repr(v)[:60] for v in other)} cannot be included by this server")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value == "auto":  # dropping the conversation's start silently is not this server's call
            raise ValueError("'auto' is not supported by this server: the input must fit the context")
        return value

    @field_validator("reasoning")
    @classmethod
    def _no_effort(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if (value or {}).get("effort") is not None:
            raise ValueError("`effort` is not supported by this server (a thinking model's template may take "
                             "`chat_template_kwargs`, as Qwen3's `enable_thinking`)")
        return value

    def chat_body(self, history: tuple[dict, ...] = ()) -> dict[str, Any]:
        """The chat completion request this response amounts to (validated as one by the caller), after the
        conversation `history` (previous_response_id's). Raises ValueError naming what cannot be."""
        extra = self.model_extra or {}
        for name, instead in _CHAT_SHAPE.items():
            if extra.get(name) not in (None, False):
                raise ValueError(f"`{name}` is a chat completions parameter, not a Responses one: {instead}")
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            **{k: v for k, v in extra.items() if k != _STREAM_OPTIONS and k not in _CHAT_SHAPE},
            "model": self.model, "messages": system + list(history) + self.input_messages(),
            "stream": self.stream,
            "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # the completed response carries the usage
        if self.logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self.tools:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function" or not isinstance(self.tool_choice.get("name"), str):
                raise ValueError("tool_choice: an object must be {\"type\": \"function\", \"name\": ...}")
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice["name"]}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        verbosity = (self.text or {}).get("verbosity")
        if verbosity not in (None, "medium"):
            raise ValueError("text.verbosity: only 'medium' is supported by this server")
        return {k: v for k, v in body.items() if v is not None}

    @property
    def logprobs(self) -> bool:
        """The message's logprobs are asked for: `include`d, as OpenAI's (`top_logprobs` alone is a count)."""
        return LOGPROBS in (self.include or ())

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (without the instructions)."""
        messages: list[dict[str, Any]] = []
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message" if "role" in item else None)
            where = f"input.{i}"
            if item.get("id") is not None and not (isinstance(item["id"], str) and 0 < len(item["id"]) <= 200):
                raise ValueError(f"{where}.id must be a string of 1 to 200 characters")  # listed as given
            if kind == "message":
                role = item.get("role")
                if role not in _ROLES:
                    raise ValueError(f"{where}.role must be one of {', '.join(_ROLES)}")
                messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", where), "type": "function",
                        "function": {"name": _string(item, "name", where),
                                     "arguments": _string(item, "arguments", where)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # calls made beside (or after) a text
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                                 "content": _text(item.get("output"), f"{where}.output")})
            elif kind == "reasoning":
                continue  # an earlier turn's reasoning: chat templates leave it out of the prompt too
            elif kind == "item_reference":
                raise ValueError(f"{where}: item references are not supported by this server: send the items "
                                 "themselves, or continue a response with `previous_response_id`")
            else:
                raise ValueError(f"{where}: items of type {str(kind)[:40]!r} are not supported by this server")
        return messages


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as one string; anything but text is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise ValueError(f"{where}.{j}: parts of type {str(kind)[:40]!r} are not supported: this server "
                             "takes text only")
    return "".join(out)


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ValueError(f"tools.{i}: tools of type {str(tool.get('type'))[:40]!r} are not supported: this "
                         "server calls functions only")
    fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fields}


def _response_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        missing = [k for k in ("name", "schema") if fmt.get(k) is None]
        if missing:  # both required by the Responses API (chat's json_schema defaults them)
            raise ValueError(f"text.format of type json_schema needs {' and '.join(missing)}")
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise ValueError("text.format.type must be text, json_object or json_schema")


def named_field(req: ResponsesRequest, message: str) -> str | None:
    """The field a `chat_body` refusal names first (`text.verbosity: ...`, `` `echo` is ...``), for the
    error's `param`; None where it names none the request has."""
    m = re.match(r"`?([A-Za-z_]\w*(?:\.\w+)*)`?[: ]", message)
    if m is None:
        return None
    top = m.group(1).split(".")[0]
    return m.group(1) if top in req.model_fields_set or top in (req.model_extra or {}) else None


def chat_request(req: ResponsesRequest, history: tuple[dict, ...] = ()) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request, and the conversation it continues as messages (`history`, then the input: what a
    stored response keeps, instructions aside). Raises ValueError (what cannot be a chat request) or
    pydantic's ValidationError (what chat refuses)."""
    body = req.chat_body(history)
    conversation = body["messages"][1 if req.instructions else 0:]
    return ChatCompletionRequest.model_validate(body), conversation

"""OpenAI request shapes (pydantic), with every numeric parameter bounded.

Unknown fields are accepted and ignored, as OpenAI's own server does for
`user`. Known OpenAI parameters that would change what the model generates and
that meshlm does not implement are refused with a 400 naming them, never
silently ignored; so are vLLM's extensions of that kind, unless given their
default. vLLM's older `guided_*` names mean `structured_outputs`. Ranges follow
OpenAI's documentation where it gives one (README.md lists them all).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator,
                      model_validator)

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 1000  # per stop string; matching costs O(new text) per token whatever the length
MAX_LOGIT_BIAS = 1024  # entries
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 256  # each checked against the output's end every step
MAX_N = 16

MAX_TOOLS = 128  # OpenAI's limit
MAX_CHOICES = 1024  # structured_outputs.choice entries
MAX_DOCUMENTS = 1024  # chat `documents`

# OpenAI parameters that change the output and are not implemented (yet): refusing them beats a wrong 200.
_UNSUPPORTED = ("functions", "function_call", "audio", "web_search_options", "reasoning_effort")
# vLLM's extensions of the same kind, refused unless given their default (`_VLLM_DEFAULTS`).
# `priority` is vLLM's for its priority scheduling policy; under first-come-first-served it refuses any other
# value too.
_UNSUPPORTED_VLLM = ("use_beam_search", "spaces_between_special_tokens", "chat_template", "guided_whitespace_pattern",
                     "logits_processors", "structural_tag", "priority")
_VLLM_DEFAULTS = {"use_beam_search": False, "spaces_between_special_tokens": True, "priority": 0}
# Parameters OpenAI's API (and its SDKs, which send `None` as null) types as nullable, meaning the default.
_NULL_MEANS_DEFAULT = frozenset({"n", "presence_penalty", "frequency_penalty", "stream", "logprobs", "echo"})
# What meshlm passes to the chat template itself, or what changes how it is called: not a template variable
# a client may set through `chat_template_kwargs`.
_TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                 "continue_final_message", "tokenize", "chat_template", "return_dict",
                                 "return_tensors", "return_assistant_tokens_mask", "padding", "truncation",
                                 "max_length", "tokenizer_kwargs"})
# vLLM's older names for `structured_outputs` (still sent by many clients): the same constraints.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def nulls_as_defaults(data: Any, names: frozenset[str]) -> Any:
    """A body without the `names` sent as null (OpenAI types them nullable, meaning the default)."""
    if isinstance(data, dict) and any(data.get(k, 0) is None for k in names):
        return {k: v for k, v in data.items() if v is not None or k not in names}
    return data


def _refuse(name: str, value: Any) -> Any:
    if value is not None:
        raise ValueError(f"`{name}` is not supported by this server")
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0, le=2)  # None: the model's or the server's default
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)  # vLLM's extension; -1 and 0 turn it off
    min_p: StrictFloat | None = Field(None, ge=0, le=1)
    seed: StrictInt | None = None
    stop: Union[str, list[str], None] = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)  # vLLM's, both endpoints: only n
    presence_penalty: StrictFloat = Field(0.0, ge=-2, le=2)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2, le=2)
    # vLLM's extension. At least 1e-6: a logit divided by ~1e-38 is inf in float32, and the row NaN.
    repetition_penalty: StrictFloat | None = Field(None, ge=1e-6, le=10)  # None: the model's default, else 1
    logit_bias: dict[str, StrictFloat] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)  # vLLM's extension
    allowed_token_ids: list[StrictInt] | None = Field(None, min_length=1)  # vLLM's: only these may be sampled
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        None, max_length=MAX_BAD_WORDS)  # vLLM's: words never generated
    min_tokens: StrictInt = Field(0, ge=0)  # vLLM's extension
    ignore_eos: StrictBool = False  # vLLM's extension; benchmarks use it
    speculative: StrictBool = True  # meshlm's: false keeps this request out of speculative decoding
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    user: str | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    response_format: "ResponseFormat | None" = None
    structured_outputs: "StructuredOutputs | None" = None  # vLLM's extension (its current naming)
    modalities: list[str] | None = None
    include_stop_str_in_output: StrictBool = False  # vLLM's extension
    # vLLM's extension: each prompt token's logprob (after the first) and its top alternatives; -1 (vLLM's
    # whole vocabulary) is refused as any count above 20.
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # vLLM's extension: keep only the prompt's last k tokens (-1: as many as the context holds, one left to
    # generate), after templating.
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    use_beam_search: Any = None
    skip_special_tokens: StrictBool = True  # vLLM's extension: false shows special tokens in the text
    # vLLM's extension: only requests giving the same salt share cached prefix blocks
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # vLLM's extensions: the prompt's and the output's token ids beside the text (RL rollouts); logprob
    # tokens named `token_id:N` instead of their text.
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False
    spaces_between_special_tokens: Any = None
    chat_template: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None  # structured_outputs has no whitespace_pattern here either
    logits_processors: Any = None  # vLLM's: server-side code by name (it refuses them too, unless allowed)
    structural_tag: Any = None  # vLLM's: tagged regions held to schemas
    priority: Any = None
    # The Responses API's names, dropped as unknown fields here, gave an answer without the instructions, the
    # cap or the conversation asked for (review helper-53).
    instructions: Any = None
    max_output_tokens: Any = None
    previous_response_id: Any = None
    input: Any = None
    text: Any = None
    # vLLM's: the response's id is `chatcmpl-<request_id>` (`cmpl-` for completions), for the client to
    # correlate; printable ASCII without spaces, as it may be logged and echoed.
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[!-~]+$")

    @field_validator("instructions", "max_output_tokens", "previous_response_id", "input", "text")
    @classmethod
    def _responses_only(cls, value: Any, info) -> Any:
        if value is not None:
            raise ValueError(f"`{info.field_name}` is a Responses API parameter (/v1/responses)")
        return value

    @field_validator("stream_options")
    @classmethod
    def _options_of_a_stream(cls, value, info):
        # OpenAI and vLLM refuse them too: include_usage without a stream asked for what a whole answer has
        if value is not None and info.data.get("stream") is False:
            raise ValueError("only a stream takes stream_options (stream is false)")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported by this server")
        return value

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return nulls_as_defaults(data, _NULL_MEANS_DEFAULT)

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        return _refuse(info.field_name, value)

    @field_validator(*_UNSUPPORTED_VLLM)
    @classmethod
    def _unsupported_vllm(cls, value: Any, info) -> Any:
        if info.field_name in _VLLM_DEFAULTS and value == _VLLM_DEFAULTS[info.field_name]:
            return value
        return _refuse(info.field_name, value)

    @model_validator(mode="after")
    def _guided(self) -> "_Request":
        """vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, as `structured_outputs`."""
        given = {key: getattr(self, name) for name, key in _GUIDED.items() if getattr(self, name) is not None}
        if not given:
            return self
        if self.structured_outputs is not None or len(given) > 1:
            raise ValueError("give one constraint: structured_outputs or one guided_* parameter")
        self.structured_outputs = StructuredOutputs.model_validate(given)
        return self

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise ValueError("only the text modality is supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop sequence may be at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_limits(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are allowed")
        seen: dict[int, str] = {}
        for key, bias in value.items():
            if not key.isascii() or not key.isdigit() or len(key) > 10:
                raise ValueError(f"keys must be token ids (decimal integers), got {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias for token {key} must be between -100 and 100, got {bias}")
            if int(key) in seen:  # "01" and "1": which bias should win is not ours to guess
                raise ValueError(f"keys {seen[int(key)]!r} and {key!r} are the same token id")
            seen[int(key)] = key
        return value

    def stop_list(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def bias_items(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's: every chunk carries its choice's usage so far (with include_usage, as vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def prompt_logprob_count(self) -> int | None:
        """Alternatives per prompt token, if the prompt's logprobs are to be computed."""
        return self.prompt_logprobs


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a `json_schema` object")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regular expression, a list of
    choices or a Lark grammar (llguidance's dialect)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | StrictBool | str | None = Field(None, alias="json")  # a string: the schema as JSON text
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _takes_named_arguments(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # Arguments are a JSON object (OpenAI refuses other schemas too): a forced call to a function whose
        # parameters were a string schema could never be read back as a call.
        kind = (value or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise ValueError(f"must be a JSON schema of type object (a function takes named arguments), got "
                             f"type {kind!r}")
        return value


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class RefusalPart(BaseModel):
    """An assistant turn's refusal, as the client's own types send it back in a history: text too."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["refusal"]
    refusal: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, RefusalPart]], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool's answer names the call it answers
    # An assistant turn's reasoning, which templates of thinking models render back (Qwen3's, for the turns
    # of a tool loop after the last user message); `reasoning` is vLLM's and mlx-lm's newer name for it
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """An image or audio part: said so, not pydantic's 'content.str: Input should be a valid string'."""
        if isinstance(value, list):
            kinds = {p.get("type") for p in value if isinstance(p, dict)} - {"text", "refusal"}
            if kinds:
                shown = ", ".join(sorted(repr(k)[:40] for k in kinds))
                raise ValueError(f"content parts of type {shown} are not supported: this server takes text only")
        return value

    @model_validator(mode="after")
    def _tool_answers_name_their_call(self) -> "ChatMessage":
        """OpenAI refuses a tool message without the id of the call it answers (a 400), and templates that
        pair answers with calls by id (Mistral's) need it."""
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message of role 'tool' needs tool_call_id: the id of the tool call it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's extensions: more variables for the chat template (Qwen3's `enable_thinking`, say), and
    # retrieval documents for templates that render them.
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)
    # vLLM's: true adds the tokenizer's special tokens (a BOS) on top of what the template writes
    add_special_tokens: StrictBool = False
    echo: Any = None  # vLLM's extension (the last message prepended to the reply): refused unless false
    # vLLM's extensions: the template's assistant header after the messages (default); or none, the last
    # message left open for the model to continue (an assistant reply's start given by the client).
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    verbosity: Any = None  # OpenAI's: shorter or longer answers; only the model's own ('medium') here
    include_reasoning: StrictBool = True  # vLLM's: false leaves a thinking model's reasoning out

    @field_validator("verbosity")
    @classmethod
    def _own_verbosity(cls, value: Any) -> Any:
        if value not in (None, "medium"):  # ignored, it was another answer than asked for (Responses refused it)
            raise ValueError("only 'medium' is supported by this server")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(value or ()) & _TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"may not set {', '.join(taken)}: the request's own fields say those")
        return value

    @field_validator("echo")
    @classmethod
    def _no_chat_echo(cls, value: Any) -> Any:
        return value if value is False else _refuse("echo", value)

    @field_validator("continue_final_message")
    @classmethod
    def _one_way_to_end(cls, value: bool, info) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message needs add_generation_prompt false (as vLLM)")
        return value

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in value or ()]
        if len(set(names)) != len(names):
            raise ValueError("function names must be unique")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, value, info):
        names = [t.function.name for t in info.data.get("tools") or ()]
        if value not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice needs `tools`")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"names function {value.function.name[:64]!r}, which is not in `tools`")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False  # the prompt leads the text (and its tokens the logprobs, the first's null)
    suffix: str | None = None
    # With echo, 0 returns the prompt alone: how OpenAI's legacy API scores a text (lm-eval's loglikelihood).
    max_tokens: StrictInt | None = Field(None, ge=0)
    add_special_tokens: StrictBool = True  # vLLM's: false leaves out the BOS a prompt's text would get
    tools: Any = None  # chat's: refused here rather than ignored
    tool_choice: Any = None
    messages: Any = None
    documents: Any = None
    chat_template_kwargs: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None

    @field_validator("tools", "tool_choice", "messages", "documents", "chat_template_kwargs", "add_generation_prompt",
                     "continue_final_message")
    @classmethod
    def _chat_only(cls, value: Any, info) -> Any:
        if value is not None:
            raise ValueError(f"`{info.field_name}` is a chat completions parameter (/v1/chat/completions)")
        return value

    def prompt_logprob_count(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _refuse("suffix", value or None)

    def logprob_count(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize of a text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's /tokenize of chat messages: the prompt a chat completion would get (template, tools)."""

    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


_Request.model_rebuild()
ChatMessage.model_rebuild()
ChatCompletionRequest.model_rebuild()
TokenizeChatRequest.model_rebuild()
CompletionRequest.model_rebuild()

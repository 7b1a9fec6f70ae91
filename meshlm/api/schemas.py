"""OpenAI request shapes (pydantic). Unknown fields are accepted and ignored, as OpenAI's own server does for `user`."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: StrictInt | None = None
    stop: Union[str, list[str], None] = None
    n: StrictInt = Field(1, ge=1, le=16)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    user: str | None = None
    ignore_eos: StrictBool = False  # vLLM extension; benchmarks use it

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False

    def logprob_count(self) -> int | None:
        return self.logprobs


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()

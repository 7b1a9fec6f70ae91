"""Serving: OpenAI request -> engine sequences -> OpenAI response (or SSE chunks).

The engine sees only prompt token ids and SamplingParams; everything
OpenAI-specific (choices, usage, logprob layouts) lives here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from meshlm.api.errors import APIError, bad_request
from meshlm.api.schemas import ChatCompletionRequest, CompletionRequest, _Request
from meshlm.engine.engine import Engine, PromptTooLong, QueueFull
from meshlm.engine.request import SamplingParams, StepOutput, TokenLogprob


@dataclass
class Choice:
    index: int
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None


class Serving:
    def __init__(self, engine: Engine, tokenizer, model_name: str, max_model_len: int, default_max_tokens: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens

    # -- request -> prompts ------------------------------------------------
    def check_model(self, req: _Request) -> None:
        if req.model not in (None, "", self.model_name):
            raise APIError(404, f"The model `{req.model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # templates raise on role orders they do not support
            raise bad_request(f"messages could not be formatted by the chat template: {exc}", param="messages")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        if req.echo:
            raise bad_request("echo is not supported", param="echo")
        p = req.prompt
        if isinstance(p, str):
            return [self.tokenizer.encode(p)]
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        if isinstance(p[0], str):
            return [self.tokenizer.encode(s) for s in p]
        return [list(x) for x in p]

    def sampling_params(self, req: _Request, prompt_len: int) -> SamplingParams:
        if prompt_len == 0:
            raise bad_request("prompt is empty after tokenization", param="prompt")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{prompt_len} tokens, leaving none to generate. Please shorten it.",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if asked is not None and asked < 1:
            raise bad_request(f"max_tokens must be at least 1, got {asked}", param="max_tokens")
        # Documented policy: more than fits in the context is clamped to what fits.
        max_tokens = min(asked if asked is not None else self.default_max_tokens, room)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, seed=req.seed, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, logprobs=req.logprob_count(),
                stop=req.stop_list(), ignore_eos=req.ignore_eos,
            )
        except ValueError as exc:
            raise bad_request(str(exc))

    # -- engine ------------------------------------------------------------
    def submit(self, prompts: list[list[int]], req: _Request) -> tuple[list[int], list[Choice], asyncio.Queue]:
        """Submit n sequences per prompt; outputs arrive on the returned queue as (choice index, StepOutput)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        uids: list[int] = []
        choices: list[Choice] = []
        params = [self.sampling_params(req, len(p)) for p in prompts]
        try:
            for p, base in zip(prompts, params):
                for i in range(req.n):
                    index = len(choices)
                    seed = None if base.seed is None else base.seed + i
                    sp = base if seed == base.seed else _with_seed(base, seed)
                    emit = _emitter(loop, queue, index)
                    uids.append(self.engine.submit(p, sp, emit))
                    choices.append(Choice(index, len(p)))
        except QueueFull as exc:
            self.abort(uids)
            raise APIError(429, f"Server is busy ({exc}); retry shortly.", type_="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"})
        except PromptTooLong as exc:
            self.abort(uids)
            raise bad_request(str(exc), code="context_length_exceeded")
        except RuntimeError as exc:
            self.abort(uids)
            raise APIError(503, str(exc), type_="server_error", code="unavailable", headers={"Retry-After": "5"})
        return uids, choices, queue

    def abort(self, uids: list[int]) -> None:
        for uid in uids:
            self.engine.abort(uid)

    async def outputs(self, choices: list[Choice], queue: asyncio.Queue) -> AsyncIterator[tuple[Choice, StepOutput]]:
        """Yield outputs until every choice has finished, folding each into its Choice."""
        open_choices = len(choices)
        while open_choices:
            index, out = await queue.get()
            choice = choices[index]
            choice.text.append(out.text)
            choice.logprobs.extend(out.logprobs)
            if out.finish_reason is not None:
                open_choices -= 1
                choice.completion_tokens = out.completion_tokens
                choice.cached_tokens = out.cached_tokens
                choice.finish_reason = out.finish_reason.value
            yield choice, out

    def usage(self, choices: list[Choice], prompts: list[list[int]]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(c.completion_tokens for c in choices)
        cached = max((c.cached_tokens for c in choices), default=0)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # -- logprob layouts ----------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict:
        def entry(tid: int, lp: float) -> dict:
            text = self.token_text(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                            for x in lps]}

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int = 0) -> dict:
        tokens = [self.token_text(x.token_id) for x in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{self.token_text(t): v for t, v in x.top} for x in lps],
            "text_offset": offsets,
        }


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(p, seed=seed)


def _emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
    def emit(out: StepOutput) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (index, out))

    return emit


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def now() -> int:
    return int(time.time())

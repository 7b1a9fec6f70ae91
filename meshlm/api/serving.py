"""Serving: OpenAI request -> engine sequences -> OpenAI response (or SSE chunks).

The engine sees only prompt token ids and SamplingParams; everything
OpenAI-specific (choices, usage, logprob layouts) lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from meshlm.api.errors import APIError, bad_request
from meshlm.api.outbox import Outbox
from meshlm.api.prompts import PromptBuilder
from meshlm.api.reasoning import think_token_ids
from meshlm.api.schemas import ChatCompletionRequest, _Request
from meshlm.api.token_bytes import TextCursor, TokenBytes
from meshlm.engine.engine import Engine, PromptTooLong, QueueFull
from meshlm.engine.request import Reasoning, SamplingParams, StepOutput, TokenLogprob
from meshlm.model.loader import SAMPLING_KEYS


@dataclass
class Choice:
    index: int
    prompt_tokens: int
    prompt: int = 0  # which of the request's prompts it continues
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # one per prompt token after the first
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that omits a sampling parameter gets: an explicit server flag, else the model's
    generation_config.json, else OpenAI's own defaults. `source` says which, for the start-up log."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's too: Qwen2.5's generation_config.json sets 1.05
    source: str = "OpenAI defaults"

    def __post_init__(self) -> None:
        numbers = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                   "repetition_penalty": self.repetition_penalty}
        wrong = [f"{k} {v!r}" for k, v in numbers.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):  # 2.5 failed every sampled request
            wrong.append(f"top_k {self.top_k!r} (an integer)")
        if wrong:
            raise ValueError(f"sampling defaults of the wrong type ({self.source}): {', '.join(wrong)}")
        if not (0 <= self.temperature <= 2 and 0 < self.top_p <= 1 and self.top_k >= 0 and 0 <= self.min_p <= 1
                and 0 < self.repetition_penalty <= 10):
            raise ValueError(f"sampling defaults out of range: {self.describe()}")

    @classmethod
    def resolve(cls, model: dict, temperature: float | None = None, top_p: float | None = None) -> "SamplingDefaults":
        """`model`: the sampling keys of the model's generation_config.json (maybe empty)."""
        values = {k: model[k] for k in SAMPLING_KEYS if model.get(k) is not None}
        if isinstance(values.get("top_k"), float) and values["top_k"].is_integer():  # 50.0: a JSON writer's 50
            values["top_k"] = int(values["top_k"])
        flags = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
        sources = [name for name, used in (("server flags", flags), ("generation_config.json", values)) if used]
        return cls(**{**values, **flags}, source=" over ".join(sources) or cls.source)

    def describe(self) -> str:
        return (f"temperature={self.temperature:g} top_p={self.top_p:g} top_k={self.top_k} min_p={self.min_p:g} "
                f"repetition_penalty={self.repetition_penalty:g} (from {self.source})")


class Serving:
    def __init__(self, engine: Engine, prompts: PromptBuilder, model_name: str, default_max_tokens: int,
                 defaults: SamplingDefaults = SamplingDefaults(), reasoning_parser: str = "none") -> None:
        self.engine = engine
        self.grammars = engine.grammars
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        self.token_bytes = TokenBytes(self.tokenizer)
        self.model_name = model_name
        self.max_model_len = prompts.max_model_len
        self.default_max_tokens = default_max_tokens
        self.defaults = defaults
        self.reasoning_parser = reasoning_parser  # api/reasoning.py: "none", or a thinking model's
        # Its think tags' ids, when single tokens: a grammar then applies after the reasoning.
        self.think_tags = think_token_ids(self.tokenizer) if reasoning_parser != "none" else None
        # Those of them that are special tokens, which skip_special_tokens would take out of the text
        self.special_think_tags = tuple(i for i in self.think_tags or ()
                                        if not self.tokenizer.decode([i], skip_special_tokens=True))
        self._outbox: Outbox | None = None  # for the running event loop, made on first use
        engine.output_batch = self._holding_outputs

    # -- request -> prompts ------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """A request's `model` (none: the served one), or the id `GET /v1/models/{id}` asks for."""
        if model not in (None, "", self.model_name):
            raise APIError(404, f"The model `{model[:200]}` does not exist. This server serves "
                                f"`{self.model_name}`.", param="model", code="model_not_found")

    def sampling_params(self, req: _Request, prompt_len: int, grammar: str | None = None,
                        reasoning: Reasoning | None = None, where: str = "prompt") -> SamplingParams:
        """`where`: the prompt as the client names it (`prompt[2]` of a list), for the errors."""
        if prompt_len == 0:
            raise bad_request(f"{where} is empty after tokenization", param="prompt")
        room = self.max_model_len - prompt_len
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if room < (0 if asked == 0 else 1):  # echo with max_tokens 0 scores a whole context's worth
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"{'your prompt' if where == 'prompt' else where} has {prompt_len} tokens, leaving none to generate. "
                "Please shorten it.",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        if asked == 0 and not getattr(req, "echo", False):
            raise bad_request("max_tokens may be 0 only with echo (the prompt is then the whole text)",
                              param="max_tokens")
        if asked is not None and req.min_tokens > asked:  # as vLLM: it was clamped to max_tokens unsaid
            raise bad_request(f"min_tokens ({req.min_tokens}) must be at most max_tokens ({asked})", param="min_tokens")
        if req.prompt_logprobs is not None and req.stream:  # as vLLM
            raise bad_request("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
        # Documented policy: more than fits in the context is clamped to what fits. Without max_tokens, at
        # least min_tokens (it was cut to --max-tokens-default unsaid; vLLM's default is the whole context).
        max_tokens = min(asked if asked is not None else max(self.default_max_tokens, req.min_tokens), room)
        bias = req.bias_items()
        self.prompts.check_ids([t for t, _ in bias], "logit_bias")
        stop_ids = tuple(req.stop_token_ids or ())
        self.prompts.check_ids(stop_ids, "stop_token_ids")
        bad_words = self._bad_words(req.bad_words or ())
        only = tuple(sorted(set(req.allowed_token_ids or ())))
        self.prompts.check_ids(only, "allowed_token_ids")
        if only and grammar is not None:  # their intersection could be empty, and no token left to sample
            raise bad_request("allowed_token_ids cannot be combined with a response_format, structured_outputs "
                              "or a forced tool call", param="allowed_token_ids")
        d = self.defaults
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=_given(req.temperature, d.temperature),
                top_p=_given(req.top_p, d.top_p), top_k=max(_given(req.top_k, d.top_k), 0),
                min_p=_given(req.min_p, d.min_p), seed=req.seed, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=_given(req.repetition_penalty, d.repetition_penalty),
                logit_bias=bias, allowed_token_ids=only, bad_words=bad_words, logprobs=req.logprob_count(),
                prompt_logprobs=req.prompt_logprob_count(), stop=req.stop_list(), stop_token_ids=stop_ids,
                include_stop_str=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
                min_tokens=min(req.min_tokens, max_tokens), ignore_eos=req.ignore_eos, cache_salt=req.cache_salt,
                speculative=req.speculative, grammar=grammar, reasoning=reasoning if grammar else None,
            )
        except ValueError as exc:
            raise bad_request(str(exc))

    def _bad_words(self, words) -> tuple[tuple[int, ...], ...]:
        """vLLM's `bad_words` as token sequences: each word as written and after a space (how it follows
        another word in most tokenizers)."""
        out = set()
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    out.add(ids)
        return tuple(sorted(out))

    # -- engine ------------------------------------------------------------
    def submit(self, prompts: list[list[int]], req: _Request, grammar: str | None = None,
               reasoning: Reasoning | None = None, keep_token_ids: tuple[int, ...] = ()
               ) -> tuple[list[int], list[Choice], asyncio.Queue]:
        """Submit n sequences per prompt; outputs arrive on the returned queue as (choice index, StepOutput).
        `keep_token_ids`: special tokens the text shows even when skip_special_tokens (think tags)."""
        loop = asyncio.get_running_loop()
        if self._outbox is None or self._outbox.loop is not loop:
            self._outbox = Outbox(loop)
        queue: asyncio.Queue = asyncio.Queue()
        choices: list[Choice] = []
        wanted = len(prompts) * req.n
        if wanted > self.engine.max_waiting:  # a 429 would be retried, and never succeed
            raise bad_request(f"this request asks for {wanted} sequences ({len(prompts)} prompt(s), n={req.n}); "
                              f"this server queues at most {self.engine.max_waiting} (--max-queue)", param="n")
        where = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
        params = [self.sampling_params(req, len(p), grammar, reasoning, w) for p, w in zip(prompts, where)]
        if keep_token_ids:
            params = [dataclasses.replace(p, keep_token_ids=keep_token_ids) for p in params]
        items = []
        for which, (p, base) in enumerate(zip(prompts, params)):
            for i in range(req.n):
                index = len(choices)
                seed = None if base.seed is None else base.seed + i
                sp = base if seed == base.seed else _with_seed(base, seed)
                if i and not req.stream and sp.prompt_logprobs is not None:
                    # A whole response takes every choice's prompt logprobs from the first's: the other n - 1
                    # need not compute the prompt whole (they may hit the cache the first one fills).
                    sp = dataclasses.replace(sp, prompt_logprobs=None)
                items.append((p, sp, _emitter(self._outbox, queue, index)))
                choices.append(Choice(index, len(p), which))
        try:
            # all or none: one request's 429 queues nothing; admitted (api/admission.py): it came before any drain
            uids = self.engine.submit_all(items, admitted=True)
        except QueueFull as exc:
            raise APIError(429, f"Server is busy ({exc}); retry shortly.", type_="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"})
        except PromptTooLong as exc:
            raise bad_request(str(exc), code="context_length_exceeded")
        except ValueError as exc:  # the engine's own last check of token ids
            raise bad_request(str(exc))
        except RuntimeError as exc:
            raise APIError(503, str(exc), type_="server_error", code="unavailable", headers={"Retry-After": "5"})
        return uids, choices, queue

    def _holding_outputs(self) -> contextlib.AbstractContextManager:
        """What the engine's thread holds while it emits a step: the outbox, so the loop wakes once."""
        outbox = self._outbox
        return outbox.holding() if outbox is not None else contextlib.nullcontext()

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
            choice.token_ids.extend(out.token_ids)
            choice.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                choice.prompt_logprobs = out.prompt_logprobs
            if out.finish_reason is not None:
                open_choices -= 1
                choice.completion_tokens = out.completion_tokens
                choice.cached_tokens = out.cached_tokens
                choice.cache_write_tokens = out.cache_write_tokens
                choice.finish_reason = out.finish_reason.value
                choice.stop_reason = out.stop_reason
            yield choice, out

    def usage(self, choices: list[Choice], prompts: list[list[int]]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(c.completion_tokens for c in choices)
        # Per prompt, as its tokens count once whatever its n choices: what all of them found cached, i.e.
        # what was cached before the request (a fresh prompt's later choices find the first one's blocks,
        # which reported the prompt as cached though it was computed for this request); summed over a
        # batched completion's prompts, as their tokens are.
        by_prompt: dict[int, int] = {}
        for c in choices:
            by_prompt[c.prompt] = min(by_prompt.get(c.prompt, c.cached_tokens), c.cached_tokens)
        cached = sum(by_prompt.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # -- logprob layouts ----------------------------------------------------
    # Like vLLM, a token's text is what it completes of the choice's text: "" for a character's first part,
    # the whole character on the token that ends it; so tokens join to the text and each starts where its
    # first character does. Its `bytes` are its own, as OpenAI documents them (vLLM encodes the text).
    def _entry(self, token_id: int, cursor: TextCursor, advance: bool = False) -> tuple[str, bytes, int]:
        raw, shown = self.token_bytes(token_id)
        name = None if shown else self.token_bytes.name(token_id)  # a special token's: the text may leave it out
        if name is not None and not cursor.shows(name):
            text, offset = name, cursor.offset
        elif advance:
            text, offset = cursor.advance(raw)
        else:
            text, offset = cursor.peek(raw), cursor.offset
        return (f"token_id:{token_id}" if cursor.as_ids else text), raw, offset

    def chat_logprobs(self, lps: list[TokenLogprob], cursor: TextCursor) -> dict:
        def entry(token_id: int, lp: float, advance: bool = False) -> dict:
            text, raw, _ = self._entry(token_id, cursor, advance)
            return {"token": text, "logprob": json_logprob(lp), "bytes": list(raw)}

        content = []
        for x in lps:  # the alternatives first: they follow the text before this token
            top = [entry(t, v) for t, v in x.top]
            content.append({**entry(x.token_id, x.logprob, advance=True), "top_logprobs": top})
        return {"content": content}

    def completion_logprobs(self, lps: list[TokenLogprob], cursor: TextCursor, lead: int | None = None) -> dict:
        """`lead`: a token before `lps` whose logprob is unknown (an echoed prompt's first: null, as OpenAI's)."""
        tokens, offsets, tops = [], [], []
        if lead is not None:
            text, _, offset = self._entry(lead, cursor, advance=True)
            tokens.append(text)
            offsets.append(offset)
        for x in lps:
            top: dict = {}
            for t, v in x.top:  # best first: alternatives of one text (a character's first bytes: "") keep the best
                top.setdefault(self._entry(t, cursor)[0], json_logprob(v))
            # "The API will always return the logprob of the sampled token" (OpenAI's legacy API, and vLLM's):
            # up to logprobs + 1 entries; `logprobs: 0` gave {} and clients taking its max failed
            top.setdefault(self._entry(x.token_id, cursor)[0], json_logprob(x.logprob))
            tops.append(top)
            text, _, offset = self._entry(x.token_id, cursor, advance=True)
            tokens.append(text)
            offsets.append(offset)
        unknown = [None] if lead is not None else []
        return {
            "tokens": tokens,
            "token_logprobs": unknown + [json_logprob(x.logprob) for x in lps],
            "top_logprobs": unknown + tops,
            "text_offset": offsets,
        }

    def prompt_logprobs(self, lps: list[TokenLogprob]) -> list[dict | None]:
        """vLLM's `prompt_logprobs` layout: per prompt token (null for the first), its own and the top
        alternatives' logprobs by token id, each with its rank and text."""
        out: list[dict | None] = [None]
        for x in lps:
            entry = {str(x.token_id): self._ranked(x.token_id, x.logprob, x.rank)}
            for rank, (t, v) in enumerate(x.top, start=1):
                entry.setdefault(str(t), self._ranked(t, v, rank))
            out.append(entry)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": self.token_bytes.name(token_id)}


# OpenAI's and vLLM's number for a token of no probability: JSON has no -inf, nor NaN.
MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    """`value` as JSON can carry it: -inf (a token a mask ruled out) and NaN (logits broken upstream, e.g. a
    model overflowing) become MIN_LOGPROB; left as they are they fail the whole response (a 500) or, streamed,
    write `NaN` that no JSON parser reads."""
    return value if math.isfinite(value) else MIN_LOGPROB


def _given(value, default):
    return default if value is None else value


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(p, seed=seed)


def _emitter(outbox: Outbox, queue: asyncio.Queue, index: int):
    def emit(out: StepOutput) -> None:
        outbox.put(queue, (index, out))

    return emit


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def now() -> int:
    return int(time.time())

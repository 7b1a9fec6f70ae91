"""Request -> prompt token ids: chat templating, tokenization, and the checks that keep bad ids out.

Every id that reaches the engine is in `0 <= id < vocab_size`: MLX's embedding
gather does not bounds-check, so an id past the table reads (or faults on)
memory it does not own. Text too long to fit the context is refused from its
length alone when that already proves it (no token covers more characters
than the tokenizer's longest vocabulary entry), so nobody waits for megabytes
to be tokenized. Templating and tokenization run in a worker thread, through
the tokenizers library's batch call, which releases the GIL: a long prompt
does not stall the event loop that streams everyone else's tokens.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Sequence

from meshlm.api.errors import bad_request
from meshlm.api.schemas import ChatCompletionRequest, CompletionRequest
from meshlm.api.tools import ToolPlan, leading_syntax, template_messages
from meshlm.model.chat_templates import force_tool_syntax, rendering_template, set_tool_syntax, tool_use_template

log = logging.getLogger(__name__)

# Normalizers can merge characters (NFKC) before BPE sees them; this margin keeps the
# length-only refusal conservative (it only spares tokenizing what cannot possibly fit).
LENGTH_BOUND_MARGIN = 4
TEMPLATE_CHECK_SECONDS = 10.0  # the chat template's check at the start (use_template, check_own_template)


def longest_token_chars(tokenizer) -> int:
    """The most characters one vocabulary entry spells (added/special tokens included)."""
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1) or 1


def _fast_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer, if there is one."""
    inner = getattr(getattr(tokenizer, "_tokenizer", None), "_tokenizer", None)
    return inner if hasattr(inner, "encode_batch") else None


def use_template(tokenizer, template: str, kwargs: dict, within: float = TEMPLATE_CHECK_SECONDS) -> None:
    """Replace the model's chat template (--chat-template), checked to render a user's message `within`
    seconds: a Jinja loop can run for ever (nested ranges), and the start would hang with no word. The
    render cannot be stopped; its daemon thread ends with the process, which the error ends."""
    tokenizer.chat_template = template  # the transformers tokenizer's, through mlx-lm's wrapper
    if getattr(tokenizer, "_chat_template", None) is not None:  # mlx-lm's own renderer would win over it
        tokenizer._chat_template = None
    outcome = _render_a_message(tokenizer, kwargs, within)
    if outcome is None:
        raise ValueError(f"--chat-template did not render a user's message within {within:g} s (a loop "
                         "that does not end?)")
    if isinstance(outcome, Exception):
        raise ValueError(f"--chat-template does not render a user's message: {type(outcome).__name__}: "
                         f"{outcome}") from None
    # The model's own template's tool parser would read calls in a syntax this template never shows
    parser = set_tool_syntax(tokenizer, template)
    if parser is None:
        parser = leading_syntax(template)
    log.info("tool calls: %s", f"the {parser} syntax of --chat-template" if parser else
             "meshlm's fallback syntax (--chat-template names none mlx-lm or meshlm parses)")


def check_own_template(tokenizer, kwargs: dict, vocab_size: int, within: float = TEMPLATE_CHECK_SECONDS) -> None:
    """The model's own chat template, checked as --chat-template is. One that does not end within `within`
    is refused: each chat request would hold a worker thread rendering for ever, and once they were all
    held every request hung while /health said ok. One that raises, or whose prompt holds ids the model's
    embedding lacks, is served (completions work) with a warning: every chat request will be a 400."""
    if not getattr(tokenizer, "chat_template", None):
        return  # a base model: chat requests are 400s that say so
    leading = leading_syntax(rendering_template(tokenizer, with_tools=True))
    if getattr(tokenizer, "tool_parser", None) is None and leading is not None:
        log.info("tool calls: the %s syntax of the model's chat template", leading)
    cases = [("chat template", "chat request", kwargs)]
    if tool_use_template(tokenizer) is not None:  # transformers renders it for every request with tools
        cases.append(("tool_use chat template", "chat request with tools", {**kwargs, "tools": [_A_TOOL]}))
    for name, requests, extra in cases:
        outcome = _render_a_message(tokenizer, extra, within)
        if outcome is None:
            raise ValueError(f"the model's {name} did not render a user's message within {within:g} s (a loop "
                             "that does not end?): give one that does with --chat-template")
        if isinstance(outcome, Exception):
            log.warning("the model's %s does not render a user's message (%s: %s): every %s will fail; "
                        "--chat-template gives another", name, type(outcome).__name__, outcome, requests)
            continue
        ids = tokenizer.encode(outcome, add_special_tokens=False)
        if ids and max(ids) >= vocab_size:
            log.warning("the model's %s makes token id %d, outside its embedding (vocab_size %d): every %s will "
                        "fail; its tokenizer holds more tokens than its embedding", name, max(ids), vocab_size,
                        requests)


_A_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def _render_a_message(tokenizer, kwargs: dict, within: float) -> str | Exception | None:
    """The prompt of one user's message, the exception the template raised, or None when it did not end
    within `within` seconds. The render cannot be stopped; its daemon thread ends with the process, or
    when the template does."""
    outcome: list[str | Exception] = []

    def render() -> None:
        try:
            outcome.append(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                         add_generation_prompt=True, tokenize=False, **kwargs))
        except Exception as exc:
            outcome.append(exc)

    check = threading.Thread(target=render, name="meshlm-template-check", daemon=True)
    check.start()
    check.join(within)
    return outcome[0] if outcome else None


class PromptBuilder:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, chat_template: str | None = None,
                 template_kwargs: dict | None = None, tool_call_parser: str = "auto") -> None:
        """`chat_template`: replaces the model's; `template_kwargs`: variables for every chat's template (a
        request's own chat_template_kwargs win); `tool_call_parser`: the syntax tool calls are read in
        (vLLM's names), "auto" to infer it from the template."""
        self.template_kwargs = dict(template_kwargs or {})
        if chat_template is not None:
            use_template(tokenizer, chat_template, self.template_kwargs)
        else:
            check_own_template(tokenizer, self.template_kwargs, vocab_size)
        if tool_call_parser != "auto":
            log.info("tool calls: %s (--tool-call-parser)", force_tool_syntax(tokenizer, tool_call_parser))
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.token_chars = longest_token_chars(tokenizer)
        self.max_chars = max_model_len * self.token_chars * LENGTH_BOUND_MARGIN
        self._fast = _fast_backend(tokenizer)

    # -- public, async ------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, tools: ToolPlan | None = None) -> list[int]:
        if req.truncate_prompt_tokens is None:
            self._bound_chars(sum(len(m.text()) for m in req.messages), "messages")
        ids = await asyncio.to_thread(self._chat_sync, req, tools)
        self.check_ids(ids, "messages", tokenized=True)
        return self._truncated(ids, req.truncate_prompt_tokens)

    async def completion(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            p = [p]
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(p[0], str):
            if req.truncate_prompt_tokens is None:
                self._bound_chars(max(len(s) for s in p), "prompt")
            prompts = await asyncio.to_thread(self._encode_many, list(p), req.add_special_tokens)
            for i, ids in enumerate(prompts):
                self.check_ids(ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]", tokenized=True)
            return [self._truncated(ids, req.truncate_prompt_tokens) for ids in prompts]
        prompts = [list(p)] if isinstance(p[0], int) else [list(x) for x in p]
        for i, ids in enumerate(prompts):
            where = "prompt" if isinstance(p[0], int) else f"prompt[{i}]"
            if not ids:
                raise bad_request(f"{where} must not be empty", param="prompt")
            self.check_ids(ids, where)
        return [self._truncated(ids, req.truncate_prompt_tokens) for ids in prompts]

    def _truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the last `keep` tokens (-1: as many as leave one to generate)."""
        if keep is None:
            return ids
        if keep == 0 or keep >= self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens must be -1 or 1..{self.max_model_len - 1} (the context is "
                              f"{self.max_model_len} tokens, one of them left to generate)",
                              param="truncate_prompt_tokens")
        keep = self.max_model_len - 1 if keep == -1 else keep
        return ids[-keep:]

    def check_ids(self, ids: Sequence[int], where: str, param: str | None = None, tokenized: bool = False) -> None:
        """400 naming the first id outside the vocabulary (negative ones included). `tokenized`: the ids are
        the tokenizer's reading of the client's text, not ids the client sent (so `where[pos]` is no index)."""
        if not ids or (0 <= min(ids) and max(ids) < self.vocab_size):
            return
        pos = next(i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
        vocabulary = f"outside the vocabulary (0..{self.vocab_size - 1})"
        if tokenized:  # the model's files disagree: nothing in the request is out of range as such
            message = (f"{where}: the tokenizer made token {pos} of the prompt id {ids[pos]}, {vocabulary} of the "
                       "model: its tokenizer holds more tokens than its embedding")
        else:
            message = f"{where}[{pos}]: token id {ids[pos]} is {vocabulary}"
        raise bad_request(message, param=param or where.split("[")[0])

    # -- worker-thread side -------------------------------------------------
    def _bound_chars(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens, and a text of {chars} "
                f"characters cannot fit in it (no token spells more than {self.token_chars} characters).",
                param=param, code="context_length_exceeded")

    def _chat_sync(self, req: ChatCompletionRequest, tools: ToolPlan | None) -> list[int]:
        messages, extra = template_messages(req, tools, self.tokenizer)
        extra = {**self.template_kwargs, **(req.chat_template_kwargs or {}), **extra}
        if req.documents is not None:
            extra["documents"] = req.documents
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tokenize=False, **extra)
        except Exception as exc:  # templates raise on role orders they do not support
            raise bad_request(f"messages could not be formatted by the chat template: {exc}", param="messages")
        if req.truncate_prompt_tokens is None:
            # The templated text, before it is tokenized: what the messages' text left out (tool calls'
            # arguments, tool definitions, many short messages) is in it, and tokenizing megabytes of it
            # cost seconds of CPU before the same 400 (templating 200,000 messages: ~1 s).
            self._bound_chars(len(text), "messages")
        return self._encode_many([text], req.add_special_tokens)[0]

    async def text(self, text: str, special: bool) -> list[int]:
        """A text's ids (vLLM's /tokenize), refused only when its length alone proves it cannot fit."""
        self._bound_chars(len(text), "prompt")
        return (await asyncio.to_thread(self._encode_many, [text], special))[0]

    def _encode_many(self, texts: list[str], special: bool) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=special)]
        return [list(self.tokenizer.encode(t, add_special_tokens=special)) for t in texts]

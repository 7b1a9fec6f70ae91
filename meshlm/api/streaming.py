"""Response bodies for chat and text completions, whole or as SSE chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import AsyncIterator

from meshlm.api.errors import APIError
from meshlm.api.reasoning import ANSWER, THINK, ReasoningSplit, prompt_state, split
from meshlm.api.schemas import _Request
from meshlm.api.serving import Choice, Serving, new_id, now, sse
from meshlm.api.token_bytes import TextCursor
from meshlm.api.tools import ToolPlan, ToolStream
from meshlm.engine.request import Reasoning, StepOutput

log = logging.getLogger(__name__)

REASONING_TAIL = 16  # prompt tokens whose text says whether the template opened a think block


class Completion:
    """One OpenAI completion (chat or text) over n choices, for one HTTP request."""

    def __init__(self, serving: Serving, req: _Request, prompts: list[list[int]], chat: bool,
                 grammar: str | None = None, tools: ToolPlan | None = None) -> None:
        self.serving, self.req, self.prompts, self.chat, self.tools = serving, req, prompts, chat, tools
        prefix = "chatcmpl" if chat else "cmpl"
        self.id = f"{prefix}-{req.request_id}" if req.request_id is not None else new_id(prefix)
        self.object = "chat.completion" if chat else "text_completion"
        self.created = now()
        self.finished = False
        self.ids = req.return_token_ids  # vLLM's: prompt and output token ids beside the text
        self.ids_started: set[int] = set()  # text completions' choices whose stream carried their prompt's ids
        # Text completions' `echo`: each choice's text (and logprobs) starts with its prompt's.
        self.echo = bool(getattr(req, "echo", False))
        # Each prompt as the client sent it (strings, which spell the special tokens they hold), or its ids' text.
        sent = self._sent_strings() if self.echo else None
        self.echo_sent = sent is not None
        if self.echo and sent is None:
            sent = [serving.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens) for ids in prompts]
        self.echo_texts = sent or []
        self.echoed: set[int] = set()  # choices whose stream has carried the prompt
        # A thinking model's reasoning apart from its answer (--reasoning-parser). A grammar (a schema, a
        # forced tool call) then applies after the reasoning; where the think tags are not single tokens it
        # cannot wait for them, and constrained output is not split.
        self.thinking: str | None = None  # where the output starts (api/reasoning.py), None: not split
        self.include_reasoning = getattr(req, "include_reasoning", True)
        reasoning = None
        if chat and serving.reasoning_parser != "none" and (grammar is None or serving.think_tags is not None):
            tail = serving.tokenizer.decode(prompts[0][-REASONING_TAIL:], skip_special_tokens=False)
            continued = req.messages[-1].text() if req.continue_final_message and req.messages else None
            self.thinking = prompt_state(tail, continued)
            if grammar is not None and self.thinking != ANSWER:  # a closed block: the grammar holds it all
                reasoning = Reasoning(*serving.think_tags, open=self.thinking == THINK)
        # Special-token think tags are kept in the text the split reads: skipped, the reasoning was content.
        keep = serving.special_think_tags if self.thinking is not None else ()
        # Last: from here on the sequences run, and `close` must abort them if this completion is dropped.
        self.uids, self.choices, self.queue = serving.submit(prompts, req, grammar, reasoning, keep)
        # Where each choice's logprobs are in its text, and how their tokens are named.
        self.cursors = [TextCursor(not req.skip_special_tokens, req.return_tokens_as_token_ids) for _ in self.choices]
        self.splits = {c.index: ReasoningSplit(self.thinking) for c in self.choices} if self.thinking is not None \
            else {}

    def _sent_strings(self) -> list[str] | None:
        """The prompts as the strings the client sent; None when sent as ids, or truncated."""
        p = self.req.prompt
        if self.req.truncate_prompt_tokens is not None:
            return None
        if isinstance(p, str):
            return [p]
        return list(p) if p and isinstance(p[0], str) else None

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.serving.model_name}

    def _logprobs(self, c: Choice, lps, echo: bool = False) -> dict | None:
        """`echo`: the prompt's tokens lead (the first's logprob unknown), each with the request's count of
        alternatives."""
        k = self.req.logprob_count()
        if k is None:
            return None
        cursor = self.cursors[c.index]
        if self.chat:
            return self.serving.chat_logprobs(lps, cursor)
        if not echo:
            return self.serving.completion_logprobs(lps, cursor)
        prompt = [dataclasses.replace(x, top=x.top[:k]) for x in self._scored(c)]
        cursor.echoed = self.echo_texts[c.prompt] if self.echo_sent else None
        cursor.leading = self.echo_texts[c.prompt]
        head = self.serving.completion_logprobs(prompt, cursor, lead=self.prompts[c.prompt][0])
        head["tokens"][-1] += cursor.close()  # the prompt's text was decoded on its own
        cursor.echoed = cursor.leading = None
        tail = self.serving.completion_logprobs(list(lps), cursor)
        return {key: head[key] + tail[key] for key in head}

    def _prompt_logprobs(self, c: Choice) -> list | None:
        """vLLM's `prompt_logprobs` field, when asked for."""
        if self.req.prompt_logprobs is None:
            return None
        k = self.req.prompt_logprobs
        return self.serving.prompt_logprobs([dataclasses.replace(x, top=x.top[:k]) for x in self._scored(c)])

    def _scored(self, c: Choice) -> tuple:
        """The logprobs of `c`'s prompt: its own when streamed, else its prompt's first choice's, the one
        sequence of the n that scored it (`Serving.submit`)."""
        first = c if self.req.stream else self.choices[c.prompt * self.req.n]
        return first.prompt_logprobs or ()

    async def whole(self) -> bytes:
        """The response body, encoded. With logprobs over long prompts and many choices it runs to millions
        of entries (94 MB for n=16 x 3,000 prompt tokens x 21): built and encoded on a worker thread, a choice
        at a time, so that the event loop, which streams everyone else's tokens, gets its turns meanwhile
        (it had stalled 13 s)."""
        await self.run()
        return await asyncio.to_thread(self._encoded)

    async def run(self) -> None:
        """Wait until every choice has finished (APIError if one failed)."""
        try:
            async for _, out in self.serving.outputs(self.choices, self.queue):
                if out.error:
                    raise _generation_failed(out)
            self.finished = True
        finally:
            self.close()

    def _encoded(self) -> bytes:
        body = {**self._head(self.object), "choices": [], "usage": self.serving.usage(self.choices, self.prompts)}
        if self.chat and self.req.prompt_logprobs is not None:  # vLLM's chat: one list, beside the choices
            body["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
        if self.chat and self.ids:  # likewise the prompt's ids
            body["prompt_token_ids"] = self.prompts[0]
        # Each choice its own json.dumps: one call holds the GIL from start to end. In the body's own
        # encoding '"choices":[]' can only be that field (quotes inside strings are escaped).
        choices = ",".join(_json(self.choice_body(c)) for c in self.choices)
        return _json(body).replace('"choices":[]', f'"choices":[{choices}]', 1).encode("utf-8")

    def choice_body(self, c: Choice) -> dict:
        """A finished choice as the whole response lists it."""
        text = "".join(c.text)
        if self.echo:
            text = self.echo_texts[c.prompt] + text
        reasoning = None
        if self.thinking is not None:
            reasoning, text = split(text, self.thinking)
        shown = _reasoning_fields(reasoning) if self.include_reasoning else {}
        body = {"index": c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "logprobs": self._logprobs(c, c.logprobs, echo=self.echo)}
        if not self.chat and self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(c)
        if self.ids:
            body["token_ids"] = list(c.token_ids)
            if not self.chat:
                body["prompt_token_ids"] = self.prompts[c.prompt]
        if self.chat and self.tools is not None:
            content, calls = self.tools.calls(text)
            body["message"] = {"role": "assistant", "content": content, **shown}
            if calls:
                body["message"]["tool_calls"] = calls
                body["finish_reason"] = self.tools.finish_reason(c.finish_reason, calls)
        elif self.chat:
            body["message"] = {"role": "assistant", "content": text}
            if reasoning is not None:  # as vLLM: an empty answer is null beside the reasoning
                body["message"].update(content=text or None, **shown)
        else:
            body["text"] = text
        return body

    async def stream(self) -> AsyncIterator[str]:
        async for event in self.events():
            yield event if isinstance(event, str) else sse(event)

    async def events(self) -> AsyncIterator[dict | str]:
        """The stream's events: chunks, an error's body (`{"error": ...}`, the last), and SSE text already
        encoded (an echoed prompt's chunk, encoded off the loop; the closing `[DONE]`)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        try:
            if self.chat:
                # A forced tool call (named, required) has no content, as the whole answer's null says; "" here
                # made the client's stream helper assemble content "" (and fire a content event)
                opening = None if self.tools is not None and self.tools.mode != "auto" else ""
                for c in self.choices:
                    head = {**self._head(obj), **({"prompt_token_ids": self.prompts[0]} if self.ids else {})}
                    yield self._event(head, c, self._delta(c, {"role": "assistant", "content": opening}))
            calls = {c.index: ToolStream(self.tools) for c in self.choices} if self.chat and self.tools else {}
            async for c, out in self.serving.outputs(self.choices, self.queue):
                if out.error:
                    yield _generation_failed(out).body()
                    break
                reasoning, answer = self._split(c, out)
                if reasoning and self.include_reasoning:
                    yield self._event(self._head(obj), c, self._delta(c, _reasoning_fields(reasoning)))
                if c.index in calls:
                    for chunk in self._tool_chunks(c, out, calls[c.index], answer):
                        yield self._event(self._head(obj), c, chunk)
                elif self.echo and c.index not in self.echoed:  # the prompt leads the choice's first chunk
                    self.echoed.add(c.index)
                    # On a worker thread, as `whole` builds its body: a long prompt's logprobs are many entries.
                    yield await asyncio.to_thread(self._echo_event, self._head(obj), c, out)
                elif answer or out.logprobs or out.finish_reason or (self.ids and out.token_ids):
                    delta = {"content": answer} if answer else {}
                    chunk = self._delta(c, delta, list(out.logprobs), out.token_ids)
                    chunk["finish_reason"] = c.finish_reason if out.finish_reason else None
                    yield self._event(self._head(obj), c, chunk)
            else:
                self.finished = True
                if self.req.include_usage:
                    yield {**self._head(obj), "choices": [], "usage": self.serving.usage(self.choices, self.prompts)}
            yield sse("[DONE]")
        except Exception as exc:  # a bug of ours must end the stream with an error, not cut it (no [DONE])
            log.exception("stream failed")
            yield APIError(500, f"internal error: {type(exc).__name__}", type_="server_error").body()
            yield sse("[DONE]")
        finally:
            # Runs on normal end, on error, and when the client disconnects
            # (Starlette cancels this generator): unfinished sequences are aborted.
            self.close()

    def _echo_event(self, head: dict, c: Choice, out: StepOutput) -> str:
        chunk = self._delta(c, {"content": self.echo_texts[c.prompt] + out.text}, ids=out.token_ids)
        chunk["logprobs"] = self._logprobs(c, list(out.logprobs), echo=True)
        chunk["finish_reason"] = c.finish_reason if out.finish_reason else None
        return sse(self._event(head, c, chunk))

    def _event(self, head: dict, c: Choice, chunk: dict) -> dict:
        """One choice's chunk as an SSE event; with vLLM's `continuous_usage_stats`, the usage so far."""
        if chunk.get("finish_reason") is not None:
            chunk["stop_reason"] = c.stop_reason  # vLLM's, on a choice's last chunk
        event = {**head, "choices": [chunk]}
        if self.req.continuous_usage:
            done = len(c.token_ids)
            event["usage"] = {"prompt_tokens": c.prompt_tokens, "completion_tokens": done,
                              "total_tokens": c.prompt_tokens + done}
        return event

    def _split(self, c: Choice, out) -> tuple[str, str]:
        """An output's new (reasoning, answer) text: all answer unless --reasoning-parser splits it."""
        split = self.splits.get(c.index)
        if split is None:
            return "", out.text
        reasoning, answer = split.feed(out.text)
        if out.finish_reason:
            held = split.finish()
            reasoning, answer = reasoning + held[0], answer + held[1]
        return reasoning, answer

    def _tool_chunks(self, c: Choice, out, stream: ToolStream, text: str) -> list[dict]:
        deltas = stream.feed(text) if text else []
        chunks = [self._delta(c, d) for d in deltas]
        if out.logprobs or (self.ids and out.token_ids):  # on their own chunk: the text may be held back
            chunks.append(self._delta(c, {}, list(out.logprobs), out.token_ids))
        if out.finish_reason:
            chunks += [self._delta(c, d) for d in stream.finish()]
            last = self._delta(c, {})
            last["finish_reason"] = stream.plan.finish_reason(c.finish_reason, stream.calls) if stream.calls \
                else c.finish_reason
            chunks.append(last)
        return chunks

    def _delta(self, c: Choice, delta: dict, lps=None, ids=()) -> dict:
        """`ids`: the output token ids this chunk carries (`return_token_ids`); a text completion's first
        chunk of a choice carries its prompt's too."""
        body = {"index": c.index, "logprobs": self._logprobs(c, lps or []) if lps else None, "finish_reason": None}
        if self.ids:
            body["token_ids"] = list(ids)
            if not self.chat and c.index not in self.ids_started:
                self.ids_started.add(c.index)
                body["prompt_token_ids"] = self.prompts[c.prompt]
        if self.chat:
            body["delta"] = delta
        else:
            body["text"] = delta.get("content", "")
        return body

    def close(self) -> None:
        if not self.finished:
            self.serving.abort(self.uids)


async def watch_disconnect(request, completion: Completion, task: asyncio.Task) -> None:
    """Cancel a non-streaming completion whose client went away. Its body has been read, so the next
    ASGI message is `http.disconnect`, delivered when the connection closes: the sequence is aborted (and
    its KV freed) at once, where polling `is_disconnected` every 0.1 s let short completions run to their
    end unseen. The caller cancels this once the completion is answered."""
    while not task.done():
        message = await request.receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return


def _json(value) -> str:
    """As Starlette's JSONResponse encodes (NaN is not JSON: logprobs are made finite before)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _generation_failed(out: StepOutput) -> APIError:
    """A sequence that ended with an error: the server's (503, retry later), or the request's own (400 with
    its code: a grammar that cannot go on, as llguidance refusing a token its own mask allowed or a
    grammar found unsatisfiable only while generating; constraints that leave no token to sample). The
    same request would fail again."""
    if out.request_fault:
        return APIError(400, f"generation failed: {out.error}", code=out.request_fault)
    return APIError(503, f"generation failed: {out.error}", type_="server_error", code="engine_error")


def _reasoning_fields(reasoning: str | None) -> dict:
    """A message's (or delta's) reasoning under both names clients read: `reasoning_content` (DeepSeek's API,
    vLLM until 0.11) and `reasoning` (vLLM and mlx-lm now)."""
    return {} if reasoning is None else {"reasoning_content": reasoning, "reasoning": reasoning}

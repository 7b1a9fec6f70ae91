"""Response bodies for chat and text completions, whole or as SSE chunks."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from meshlm.api.errors import APIError
from meshlm.api.schemas import _Request
from meshlm.api.serving import Choice, Serving, new_id, now, sse
from meshlm.api.token_bytes import TextCursor
from meshlm.api.tools import ToolPlan, ToolStream
from meshlm.engine.request import StepOutput


class Completion:
    """One OpenAI completion (chat or text) over n choices, for one HTTP request."""

    def __init__(self, serving: Serving, req: _Request, prompts: list[list[int]], chat: bool,
                 grammar: str | None = None, tools: ToolPlan | None = None) -> None:
        self.serving, self.req, self.prompts, self.chat, self.tools = serving, req, prompts, chat, tools
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.object = "chat.completion" if chat else "text_completion"
        self.created = now()
        self.uids, self.choices, self.queue = serving.submit(prompts, req, grammar)
        self.cursors = [TextCursor() for _ in self.choices]  # where each choice's logprobs are in its text
        self.finished = False

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.serving.model_name}

    def _logprobs(self, c: Choice, lps) -> dict | None:
        if self.req.logprob_count() is None:
            return None
        cursor = self.cursors[c.index]
        return self.serving.chat_logprobs(lps, cursor) if self.chat else self.serving.completion_logprobs(lps, cursor)

    async def whole(self) -> dict:
        try:
            async for _, out in self.serving.outputs(self.choices, self.queue):
                if out.error:
                    raise _generation_failed(out)
            self.finished = True
        finally:
            self.close()
        return {**self._head(self.object), "choices": [self._choice(c) for c in self.choices],
                "usage": self.serving.usage(self.choices, self.prompts)}

    def _choice(self, c: Choice) -> dict:
        text = "".join(c.text)
        body = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": self._logprobs(c, c.logprobs)}
        if self.chat and self.tools is not None:
            content, calls = self.tools.calls(text)
            body["message"] = {"role": "assistant", "content": content}
            if calls:
                body["message"]["tool_calls"] = calls
                body["finish_reason"] = self.tools.finish_reason(c.finish_reason, calls)
        elif self.chat:
            body["message"] = {"role": "assistant", "content": text}
        else:
            body["text"] = text
        return body

    async def stream(self) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        try:
            if self.chat:
                for c in self.choices:
                    yield sse({**self._head(obj), "choices": [self._delta(c, {"role": "assistant", "content": ""})]})
            calls = {c.index: ToolStream(self.tools) for c in self.choices} if self.chat and self.tools else {}
            async for c, out in self.serving.outputs(self.choices, self.queue):
                if out.error:
                    yield sse(_generation_failed(out).body())
                    break
                if c.index in calls:
                    for chunk in self._tool_chunks(c, out, calls[c.index]):
                        yield sse({**self._head(obj), "choices": [chunk]})
                elif out.text or out.logprobs or out.finish_reason:
                    delta = {"content": out.text} if out.text else {}
                    chunk = self._delta(c, delta, list(out.logprobs))
                    chunk["finish_reason"] = c.finish_reason if out.finish_reason else None
                    yield sse({**self._head(obj), "choices": [chunk]})
            else:
                self.finished = True
                if self.req.include_usage:
                    yield sse({**self._head(obj), "choices": [], "usage": self.serving.usage(self.choices, self.prompts)})
            yield sse("[DONE]")
        finally:
            # Runs on normal end, on error, and when the client disconnects
            # (Starlette cancels this generator): unfinished sequences are aborted.
            self.close()

    def _tool_chunks(self, c: Choice, out, stream: ToolStream) -> list[dict]:
        deltas = stream.feed(out.text) if out.text else []
        chunks = [self._delta(c, d) for d in deltas]
        if out.logprobs:  # logprobs travel on their own chunk when the text is held back
            chunks.append(self._delta(c, {}, list(out.logprobs)))
        if out.finish_reason:
            chunks += [self._delta(c, d) for d in stream.finish()]
            last = self._delta(c, {})
            last["finish_reason"] = stream.plan.finish_reason(c.finish_reason, stream.calls) if stream.calls \
                else c.finish_reason
            chunks.append(last)
        return chunks

    def _delta(self, c: Choice, delta: dict, lps=None) -> dict:
        body = {"index": c.index, "logprobs": self._logprobs(c, lps or []) if lps else None, "finish_reason": None}
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


def _generation_failed(out: StepOutput) -> APIError:
    """A sequence that ended with an error: the server's (503, retry later), or the request's own grammar
    that cannot go on (400: llguidance refusing a token its own mask allowed, or a grammar found
    unsatisfiable only while generating; the same request would fail again)."""
    if out.request_fault:
        return APIError(400, f"generation failed: {out.error}", code="grammar_error")
    return APIError(503, f"generation failed: {out.error}", type_="server_error", code="engine_error")

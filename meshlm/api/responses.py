"""OpenAI's Responses API output: a chat completion (api/streaming.py) reshaped as a response object,
whole or as the typed events OpenAI's clients expect (`response.created` ... `response.completed`).

Output items follow the chat message: its reasoning (`--reasoning-parser`) as a
`reasoning` item, its text as a `message` item, each tool call as a
`function_call` item. A response cut by `max_output_tokens` is `incomplete`;
one whose generation failed ends with `response.failed` when streamed (a
503/400 body when whole, as chat's).
"""

from __future__ import annotations

import json
from typing import AsyncIterator

from meshlm.api.response_store import ResponseStore, assistant_turn
from meshlm.api.responses_request import ResponsesRequest
from meshlm.api.serving import Choice, new_id, now
from meshlm.api.streaming import Completion


class ResponseRun:
    """One `POST /v1/responses` over the chat completion it amounts to (n = 1)."""

    def __init__(self, req: ResponsesRequest, completion: Completion, conversation: list[dict] = (),
                 store: ResponseStore | None = None, items: list[dict] = ()) -> None:
        """`conversation`: the chat messages this response answers (previous_response_id's and the input);
        `store`: where a finished response is kept (None: `store` false), with `items`, those it was
        answered from (the earlier responses' inputs and outputs, then its own input: `input_items`)."""
        self.req = req
        self.completion = completion
        self.conversation = list(conversation)
        self.store = store
        self.items = list(items)
        self.id = new_id("resp")
        self.created = now()

    def close(self) -> None:
        self.completion.close()

    async def whole(self) -> bytes:
        await self.completion.run()
        c = self.completion.choices[0]
        body = self.completion.choice_body(c)  # once: its logprobs are an entry per output token
        message = body["message"]
        # The items a stream of the same output opens, with the same statuses: reasoning and text when
        # there is some, a call each, an empty message when nothing else; the last one incomplete when cut.
        calls = message.get("tool_calls") or []
        items = []
        if message.get("reasoning_content"):
            items.append(_reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
        if message.get("content") or not (items or calls):
            items.append(_message_item(new_id("msg"), message.get("content") or "", "completed",
                                       self._logprobs(body.get("logprobs"))))
        items += [_call_item(new_id("fc"), call, "completed") for call in calls]
        if c.finish_reason == "length":
            items[-1]["status"] = "incomplete"
        return json.dumps(self._finished(items, c), ensure_ascii=False).encode("utf-8")

    def _logprobs(self, chat: dict | None) -> list[dict]:
        """A chat choice's logprobs as an output_text part's: the same entries, every output token's (a
        reasoning model's reasoning tokens too, as chat's), when `include` asks for them."""
        return list((chat or {}).get("content") or ()) if self.req.logprobs else []

    def _finished(self, output: list[dict], c: Choice) -> dict:
        """The finished response's object, kept when `store` says so."""
        body = self._response(output, c)
        if self.store is not None:
            self.store.put(body, self._closed(assistant_turn(output)), self.items)
        return body

    def _closed(self, turn: dict) -> list[dict]:
        """The conversation with this response's turn: a continued final assistant message (vLLM's
        continue_final_message) is that message, grown, not a second one."""
        history = self.conversation
        if not ((self.req.model_extra or {}).get("continue_final_message") and history
                and history[-1]["role"] == "assistant"):
            return history + [turn]
        last = {**history[-1], "content": (history[-1].get("content") or "") + turn["content"]}
        if turn.get("tool_calls"):
            last["tool_calls"] = list(last.get("tool_calls") or ()) + turn["tool_calls"]
        return history[:-1] + [last]

    def _response(self, output: list[dict], c: Choice | None, failed: dict | None = None) -> dict:
        """The response object; `c` None: still running."""
        req, defaults = self.req, self.completion.serving.defaults
        status = "in_progress" if c is None else "failed" if failed else \
            "incomplete" if c.finish_reason == "length" else "completed"
        body = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": failed, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.completion.serving.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            # A failed response is not kept: GET would not find it
            "reasoning": {"effort": None, "summary": None}, "store": self.store is not None and not failed,
            # what sampled it (OpenAI's objects give the value used, never null)
            "temperature": defaults.temperature if req.temperature is None else req.temperature,
            "top_p": defaults.top_p if req.top_p is None else req.top_p,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
            "metadata": req.metadata or {}, "user": req.user, "usage": None,
        }
        if c is not None and status != "failed":
            reasoning = next((i["content"][0]["text"] for i in output if i["type"] == "reasoning"), None)
            body["usage"] = self._usage(c, reasoning)
        return body

    def _usage(self, c: Choice, reasoning: str | None) -> dict:
        done = self.completion.serving.usage([c], self.completion.prompts)
        return {"input_tokens": done["prompt_tokens"],
                # cache_write_tokens: required by the official SDK's types (openai 3.63); the prompt's
                # tokens this request added to the prefix cache (whole blocks it computed first)
                "input_tokens_details": {"cached_tokens": done["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": c.cache_write_tokens},
                "output_tokens": done["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(c, reasoning)},
                "total_tokens": done["total_tokens"]}

    def _reasoning_tokens(self, c: Choice, reasoning: str | None) -> int:
        """The output's tokens up to the end of its reasoning (its closing tag's, when a single token),
        else the reasoning text's own count."""
        if reasoning is None:
            return 0
        tags = self.completion.serving.think_tags
        if tags is None:
            return len(self.completion.serving.tokenizer.encode(reasoning, add_special_tokens=False))
        return c.token_ids.index(tags[1]) + 1 if tags[1] in c.token_ids else len(c.token_ids)

    async def stream(self) -> AsyncIterator[str]:
        events = _Events()
        out = _Output(events)
        yield events.emit("response.created", response=self._response([], None))
        yield events.emit("response.in_progress", response=self._response([], None))
        c = self.completion.choices[0]
        chunks = self.completion.events()
        try:
            async for chunk in chunks:
                if isinstance(chunk, str):  # chat's closing [DONE]
                    continue
                if "error" in chunk:
                    for event in out.close("incomplete"):
                        yield event
                    error = _failure(chunk["error"])
                    yield events.emit("response.failed", response=self._response(out.items, c, failed=error))
                    return
                for choice in chunk.get("choices", ()):
                    for event in out.delta(choice.get("delta") or {}, self._logprobs(choice.get("logprobs"))):
                        yield event
            for event in out.close("incomplete" if c.finish_reason == "length" else "completed"):
                yield event
            kind = "response.incomplete" if c.finish_reason == "length" else "response.completed"
            yield events.emit(kind, response=self._finished(out.items, c))
        finally:
            await chunks.aclose()  # aborts the sequence if the client left
            self.close()


def _failure(chat_error: dict) -> dict:
    """A chat stream's error as a failed response's: its code is one of the API's few (the SDK's types
    refuse others, so a client could not read the event): the request's own fault (a grammar that cannot
    go on, constraints that leave no token) is an invalid prompt, anything else the server's. The chat
    code leads the message."""
    code = "invalid_prompt" if chat_error.get("type") == "invalid_request_error" else "server_error"
    detail = chat_error.get("code")
    message = chat_error.get("message", "")
    return {"code": code, "message": f"{detail}: {message}" if detail else message}


class _Events:
    """Numbered server-sent events, named by their type (as OpenAI's stream them)."""

    def __init__(self) -> None:
        self.sequence = 0

    def emit(self, kind: str, **fields) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields}, ensure_ascii=False)
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n"


class _Output:
    """The output items of a streamed response as chat deltas arrive: one open item at a time (reasoning,
    then text, then function calls); opening one closes the one before."""

    def __init__(self, events: _Events) -> None:
        self.events = events
        self.items: list[dict] = []  # closed ones, in output order
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # chat's tool call index -> its item
        # Logprobs that came before (or without) the text they score: chat sends an output's with its answer,
        # or on a chunk of their own when the text is held back. They go with the message's next text delta.
        self.logprobs: list[dict] = []

    def delta(self, delta: dict, logprobs: list[dict] = ()) -> list[str]:
        out: list[str] = []
        self.logprobs += logprobs
        if delta.get("reasoning_content"):
            out += self._text_delta("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text_delta("message", delta["content"])
        elif self.logprobs and self.open is not None and self.open["type"] == "message":
            out += self._text_delta("message", "")
        for call in delta.get("tool_calls") or ():
            out += self._call_delta(call)
        return out

    def _text_delta(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close_open("completed")
            item = _reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning" \
                else _message_item(new_id("msg"), "", "in_progress")
            out += self._open(item)
        item = self.open
        part = item["content"][0]
        part["text"] += text
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {}
        if kind == "message":
            extra["logprobs"], self.logprobs = self.logprobs, []
            part["logprobs"] += extra["logprobs"]
        out.append(self.events.emit(kind_event, item_id=item["id"], output_index=len(self.items),
                                    content_index=0, delta=text, **extra))
        return out

    def _call_delta(self, call: dict) -> list[str]:
        out: list[str] = []
        index = call.get("index", 0)
        item = self.calls.get(index)
        function = call.get("function") or {}
        if item is None:
            out += self._close_open("completed")
            item = self.calls[index] = {"type": "function_call", "id": new_id("fc"),
                                        "call_id": call.get("id") or new_id("call"),
                                        "name": function.get("name", ""), "arguments": "", "status": "in_progress"}
            out += self._open(item)
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self.events.emit("response.function_call_arguments.delta", item_id=item["id"],
                                        output_index=len(self.items), delta=function["arguments"]))
        return out

    def _open(self, item: dict) -> list[str]:
        self.open = item
        shown = _copy(item)
        if "content" in shown:  # its part comes with the next event (clients append it to the item)
            shown["content"] = []
        out = [self.events.emit("response.output_item.added", output_index=len(self.items), item=shown)]
        if item["type"] != "function_call":
            out.append(self.events.emit("response.content_part.added", item_id=item["id"],
                                        output_index=len(self.items), content_index=0,
                                        part={**item["content"][0], "text": ""}))
        return out

    def _close_open(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items)
        item["status"] = status
        self.items.append(item)
        if item["type"] == "function_call":
            return [self.events.emit("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, arguments=item["arguments"]),
                    self.events.emit("response.output_item.done", output_index=index, item=_copy(item))]
        part = item["content"][0]
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": _copy(part["logprobs"])}
        return [self.events.emit(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                                 **extra),
                self.events.emit("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=_copy(part)),
                self.events.emit("response.output_item.done", output_index=index, item=_copy(item))]

    def close(self, status: str) -> list[str]:
        """The last item's closing events; a response with no item at all gets an empty message."""
        out = self._close_open(status)
        if not self.items:
            out += self._open(_message_item(new_id("msg"), "", "in_progress", self.logprobs))
            out += self._close_open(status)
        return out


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as `GET /v1/responses/{id}/input_items` lists it (OpenAI's item objects): a
    string is a user message with one input_text part, a message's string content one text part, and an
    item the client sent without an id gets one."""
    if isinstance(req.input, str):
        return [{"type": "message", "id": new_id("msg"), "status": "completed", "role": "user",
                 "content": [{"type": "input_text", "text": req.input}]}]
    items = []
    for given in req.input:
        item = _copy(given)
        kind = item.setdefault("type", "message")  # a message may leave its type out (input_messages)
        if kind == "message" and isinstance(item.get("content"), str):
            part = {"type": "input_text", "text": item["content"]}
            if item["role"] == "assistant":
                part = {"type": "output_text", "text": item["content"], "annotations": []}
            item["content"] = [part]
        if item.get("id") is None:
            item["id"] = new_id(_ID_PREFIX.get(kind, "item"))
        item.setdefault("status", "completed")
        items.append(item)
    return items


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict] = ()) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call: dict, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}

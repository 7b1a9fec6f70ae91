"""Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (OpenAI's `store`, its default).

In memory only, on the server that answered, least recently used first out, within a byte budget: a
restart or an eviction makes an id unknown (a 404 naming it), never another conversation. Each entry
holds the response object as answered, the conversation it closes as chat messages (its history, its
input, its output as the assistant's turn), so a follow-up is templated exactly as if the client had sent
it all, and the items it was answered from (`GET /v1/responses/{id}/input_items`: the earlier responses'
inputs and outputs, then its own input). Instructions are not carried over, as OpenAI's are not.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import msgspec

MAX_BYTES = 64 << 20
MAX_RESPONSES = 4096


@dataclass(frozen=True)
class Stored:
    body: dict  # the response object
    messages: tuple[dict, ...]  # the conversation through this response's output, as chat messages
    items: tuple[dict, ...]  # the input items it answered, earlier responses' first (each with an id)
    size: int

    def conversation_items(self) -> tuple[dict, ...]:
        """What a response continuing this one was answered from before its own input."""
        return self.items + tuple(self.body["output"])


class ResponseStore:
    def __init__(self, max_bytes: int = MAX_BYTES, max_responses: int = MAX_RESPONSES) -> None:
        self.max_bytes = max_bytes
        self.max_responses = max_responses
        self._entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: dict, messages: list[dict], items: list[dict] = ()) -> bool:
        """Keep a finished response; False when it alone is larger than the budget (not kept)."""
        # Bytes of the parts as JSON: on the event loop, and a long conversation's history is megabytes
        # (msgspec: 1 ms for 1 MB where json.dumps took 7).
        size = sum(len(msgspec.json.encode(part)) for part in (body, messages, items))
        if size > self.max_bytes:
            return False
        self.delete(body["id"])
        self._entries[body["id"]] = Stored(body, tuple(messages), tuple(items), size)
        self._bytes += size
        while self._bytes > self.max_bytes or len(self._entries) > self.max_responses:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size
        return True

    def get(self, response_id: str) -> Stored | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is not None:
            self._bytes -= stored.size
        return stored is not None


def item_page(items: tuple[dict, ...], limit: int, order: str, after: str | None) -> dict:
    """A page of a response's input items as OpenAI's list object: `order` asc is the conversation's
    order, desc (OpenAI's default) the newest first; `after`: the id of the item the page starts after."""
    ordered = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise KeyError(after)
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


def assistant_turn(output: list[dict]) -> dict:
    """A response's output items as the chat message a template reads: its text and function calls as
    one assistant message (reasoning left out, as chat templates leave earlier turns' reasoning out)."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message"
                   for part in item.get("content", ()))
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message

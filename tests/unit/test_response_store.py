"""The in-memory store behind previous_response_id: bounded in bytes and count, least recently used out."""

import pytest

from meshlm.api.response_store import ResponseStore, assistant_turn, item_page


def body(i: int, text: str = "x") -> dict:
    return {"id": f"resp_{i}", "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}


def test_least_recently_used_leave_first_within_the_budgets():
    store = ResponseStore(max_bytes=10_000, max_responses=3)
    for i in range(3):
        assert store.put(body(i), [{"role": "user", "content": "hi"}])
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(body(3), [])
    assert [i for i in range(4) if store.get(f"resp_{i}")] == [0, 2, 3]
    assert not store.put(body(9, "y" * 20_000), [])  # alone over the budget: not kept
    store.put(body(4, "z" * 9_900), [])  # pushes the others out by bytes (9,994 bytes of JSON with them)
    assert store.get("resp_4") is not None and len(store) == 1
    assert store.delete("resp_4") and not store.delete("resp_4") and store.get("resp_4") is None


def test_the_output_as_the_assistants_turn():
    output = [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
              {"type": "message", "content": [{"type": "output_text", "text": "Let me look."}]},
              {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}]
    assert assistant_turn(output) == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_item_pages_in_either_order_after_an_id():
    items = tuple({"id": f"i{k}"} for k in range(5))
    assert item_page(items, 20, "desc", None) == {"object": "list", "data": list(reversed(items)),
                                                   "first_id": "i4", "last_id": "i0", "has_more": False}
    page = item_page(items, 2, "asc", "i1")
    assert [i["id"] for i in page["data"]] == ["i2", "i3"] and page["has_more"]
    last = item_page(items, 2, "desc", "i0")
    assert last["data"] == [] and last["first_id"] is None and not last["has_more"]
    with pytest.raises(KeyError):
        item_page(items, 2, "asc", "nope")


def test_stored_items_count_in_the_budget():
    store = ResponseStore(max_bytes=1_000)
    assert not store.put(body(1), [], [{"id": "msg_1", "text": "w" * 2_000}])
    assert store.put(body(2), [], [{"id": "msg_2"}]) and store.get("resp_2").conversation_items() == (
        {"id": "msg_2"}, *body(2)["output"])

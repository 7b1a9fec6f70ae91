"""The in-memory store behind previous_response_id: bounded in bytes and count, least recently used out."""

from meshlm.api.response_store import ResponseStore, assistant_turn


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
    store.put(body(4, "z" * 9_800), [])  # pushes the others out by bytes
    assert store.get("resp_4") is not None and len(store) == 1
    assert store.delete("resp_4") and not store.delete("resp_4") and store.get("resp_4") is None


def test_the_output_as_the_assistants_turn():
    output = [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
              {"type": "message", "content": [{"type": "output_text", "text": "Let me look."}]},
              {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}]
    assert assistant_turn(output) == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}

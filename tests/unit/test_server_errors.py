"""What the HTTP layer counts when a route fails in a way nothing names: an unexpected exception is a 500
in OpenAI's shape, and `meshlm_rejected_requests_total` counts it as its help text promises (every error
answered before a sequence ran; 500s were left out: review helper-55)."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from meshlm.api.server import create_app
from meshlm.metrics import Metrics


class BrokenTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        raise RuntimeError("a bug")


def test_an_unexpected_exception_is_a_500_and_is_counted():
    metrics = Metrics()
    engine = SimpleNamespace(metrics=metrics, admit=lambda: True, release=lambda: None, problem=None, handoff=None)
    serving = SimpleNamespace(engine=engine, model_name="m", max_model_len=64, tokenizer=BrokenTokenizer(),
                              prompts=SimpleNamespace(check_ids=lambda ids, where: None),
                              check_model=lambda model: None)
    with TestClient(create_app(serving), raise_server_exceptions=False) as client:
        r = client.post("/detokenize", json={"tokens": [1, 2]})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert 'meshlm_rejected_requests_total{status="500"} 1.0' in metrics.render().decode()

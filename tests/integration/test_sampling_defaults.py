"""The model's generation_config.json sets the sampling defaults of requests that omit them, as vLLM
does: temperature, top_p, top_k, min_p and repetition_penalty (Qwen2.5 ships 1.05)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from conftest import ServerProcess

PROMPT = {"prompt": "the cat sat on the mat and the cat sat on the", "max_tokens": 24, "logprobs": 1}


@pytest.fixture(scope="module")
def defaults_server(tiny_model, tmp_path_factory):
    model = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0, "repetition_penalty": 3.0}))
    srv = ServerProcess(model, "--max-model-len", "512", log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    srv.stop()


def complete(server: ServerProcess, **params) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={**PROMPT, **params}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_repetition_penalty_of_generation_config_applies_when_a_request_names_none(defaults_server, server):
    """It was read as temperature was not: a model shipping a penalty answered without it."""
    got = complete(defaults_server)
    assert got == complete(server, temperature=0, repetition_penalty=3.0)  # the same weights, stated outright
    plain = complete(server, temperature=0)
    assert got["text"] != plain["text"]  # the penalty changes this model's greedy answer
    assert complete(defaults_server, repetition_penalty=1.0) == plain  # a request's own value wins
    assert "repetition_penalty=3 (from generation_config.json)" in defaults_server.log.read_text()

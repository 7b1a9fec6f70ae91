"""meshlm's greedy tokens equal mlx-lm's own generate on the same model directory."""

from __future__ import annotations

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from conftest import SCORE_TOL, ServerProcess, assert_scores, reference_scores, score_all, scored_prompts

pytestmark = pytest.mark.slow


def mlx_lm_greedy(path, prompt_ids: list[int], n: int, adapter=None) -> list[int]:
    """`adapter`: applied as mlx-lm applies one (unfused)."""
    model, _ = load(str(path), adapter_path=None if adapter is None else str(adapter))
    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n):
        out.append(int(token))
    return out


def meshlm_greedy_texts(url: str, prompt_ids: list[int], n: int) -> list[int]:
    body = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt_ids, "max_tokens": n, "temperature": 0, "logprobs": 0, "ignore_eos": True}).json()
    # Token ids are not in the OpenAI response; logprob tokens are their texts, so compare the texts.
    return body["choices"][0]["logprobs"]["tokens"]


def test_tiny_greedy_matches_mlx_lm(server, tiny_model):
    from mlx_lm import load as _load

    _, tok = _load(str(tiny_model))
    for prompt in ("the quick brown fox", "a story about the sea and the sky"):
        ids = tok.encode(prompt)
        want = [tok.decode([t]) for t in mlx_lm_greedy(tiny_model, ids, 24)]
        assert meshlm_greedy_texts(server.url, ids, 24) == want


def test_prompt_logprobs_match_mlx_lm(server, tiny_model):
    """OpenAI's echo with max_tokens 0: each prompt token's logprob given the ones before it, as stock
    mlx-lm's forward over the whole prompt gives it; a 300-token prompt is scored over two chunks."""
    import asyncio

    prompts = scored_prompts()
    assert_scores(asyncio.run(score_all(server.url, prompts)), reference_scores(tiny_model, prompts), tol=SCORE_TOL)


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    srv = ServerProcess("demo", "--max-model-len", "2048", log_dir=tmp_path_factory.mktemp("demo-logs"))
    yield srv
    srv.stop()


def test_demo_model_answers_and_matches_mlx_lm(demo_server):
    from meshlm.model.demo import demo_model_dir

    r = httpx.post(demo_server.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 20, "temperature": 0}).json()
    assert "Paris" in r["choices"][0]["message"]["content"]
    _, tok = load(str(demo_model_dir()))
    ids = tok.encode("The three primary colors are")
    want = [tok.decode([t]) for t in mlx_lm_greedy(demo_model_dir(), ids, 16)]
    assert meshlm_greedy_texts(demo_server.url, ids, 16) == want


def readme_example() -> tuple[str, str]:
    """README's first Python example and the output its comment promises."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    promised = re.search(r"print\(.*\)\s+# (.*)", code).group(1).strip()
    return code, promised


def test_readme_first_example_prints_what_it_promises(demo_server):
    import subprocess
    import sys

    code, promised = readme_example()
    code = code.replace("http://127.0.0.1:8000/v1", demo_server.url + "/v1")
    assert demo_server.url in code
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == promised
    # Requests that omit sampling parameters get the model card's defaults, and the log says so.
    assert "temperature=0.2 top_p=0.9" in demo_server.log.read_text()

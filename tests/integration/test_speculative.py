"""Speculative decoding in real servers: the same greedy text as plain decoding (single process, under
preemption, with tensor parallelism, on the demo model; n-gram and draft-model proposers), streaming,
stop strings, logprobs, n > 1, per-request opt-out, abort mid-verify, and a worker killed while
speculating.

`--no-adaptive-speculation` makes every proposal reach verification, so drafts are accepted and
rejected many times in these runs (the metrics are checked to prove it)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import subprocess
import sys

import httpx
import openai
import pytest

from conftest import ServerProcess, stop_ending_at

pytestmark = pytest.mark.slow

SPEC = ("--speculative", "ngram", "--no-adaptive-speculation", "--num-speculative-tokens", "4",
        "--ngram-min", "1", "--speculative-max-batch-size", "16")


def _prompts(n: int = 16) -> list[list[int]]:
    rng = random.Random(5)
    # Repetitive prompts (so n-grams match) of different lengths, and a few random ones.
    out = []
    for i in range(n):
        base = [rng.randrange(3, 400) for _ in range(rng.randint(2, 6))]
        out.append((base * 12)[: rng.randint(8, 60)] if i % 4 else [rng.randrange(3, 400) for _ in range(20)])
    return out


async def _complete_all(url: str, prompts, max_tokens: int = 24, **extra) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        rs = await asyncio.gather(*[c.post("/v1/completions", json={
            "prompt": p, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, **extra}) for p in prompts])
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    return [r.json() for r in rs]


def _texts(rs: list[dict]) -> list[str]:
    return [r["choices"][0]["text"] for r in rs]


def _assert_same(got: list[dict], want: list[dict], tol: float = 1e-3) -> None:
    assert _texts(got) == _texts(want)
    for g, w in zip(got, want):
        a, b = g["choices"][0]["logprobs"]["token_logprobs"], w["choices"][0]["logprobs"]["token_logprobs"]
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol
        for key in ("prompt_tokens", "completion_tokens"):
            assert g["usage"][key] == w["usage"][key]


@pytest.fixture(scope="module")
def plain(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, "--max-model-len", "512", "--no-prefix-cache",
                        log_dir=tmp_path_factory.mktemp("plain"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, "--max-model-len", "512", *SPEC, log_dir=tmp_path_factory.mktemp("spec"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(plain):
    return asyncio.run(_complete_all(plain.url, _prompts()))


def test_greedy_text_equals_plain_decoding_16_concurrent(spec, reference):
    before = {m: spec.metric(m) for m in ("meshlm_spec_draft_tokens_total", "meshlm_spec_accepted_tokens_total")}
    got = asyncio.run(_complete_all(spec.url, _prompts()))
    _assert_same(got, reference)
    drafted = spec.metric("meshlm_spec_draft_tokens_total") - before["meshlm_spec_draft_tokens_total"]
    accepted = spec.metric("meshlm_spec_accepted_tokens_total") - before["meshlm_spec_accepted_tokens_total"]
    assert drafted > 50 and 0 < accepted < drafted  # drafts were accepted and rejected


def test_prefix_cache_hits_while_speculating(spec, reference):
    got = asyncio.run(_complete_all(spec.url, _prompts()))  # the same prompts again: cached prefixes
    _assert_same(got, reference)


def test_stop_strings_n_and_streaming_match_plain(spec, plain):
    prompt = [7, 8, 9, 10] * 6
    plain_text = httpx.post(plain.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 30, "temperature": 0}).json()["choices"][0]["text"]
    stop = plain_text[len(plain_text) // 2 : len(plain_text) // 2 + 3]
    for srv in (plain, spec):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=30,
                                      temperature=0, stop=[stop], n=2)
        assert [c.text for c in r.choices] == [plain_text[: plain_text.index(stop)]] * 2
        assert all(c.finish_reason == "stop" for c in r.choices)
        stream = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=30,
                                           temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == plain_text
        assert chunks[-1].usage.completion_tokens == 30


def test_a_stop_string_on_the_last_tokens_of_an_accepted_run_is_a_stop(spec, reference):
    """Regression: a run reaching max_tokens ended the sequence on length first, and a stop string matched
    in it was then reported as "length". Stops whose first match ends in token 22 or 24 of 24."""
    cases = []  # (prompt, stop, the text before it, the token it ends in)
    for p, r in zip(_prompts(), reference):
        text, tokens = r["choices"][0]["text"], r["choices"][0]["logprobs"]["tokens"]
        if "".join(tokens) != text:  # a token holding part of a character: its end is not len(token)
            continue
        for k in (22, 24):
            stop = stop_ending_at(text, len("".join(tokens[:k])))
            cases.append((p, stop, text[: text.index(stop)], k))
    assert len(cases) >= 20

    async def run():
        async with httpx.AsyncClient(base_url=spec.url, timeout=300) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json={
                "prompt": p, "max_tokens": 24, "temperature": 0, "stop": [stop]}) for p, stop, _, _ in cases])

    got = [(b["choices"][0]["text"], b["choices"][0]["finish_reason"], b["usage"]["completion_tokens"])
           for b in (r.json() for r in asyncio.run(run()))]
    assert got == [(cut, "stop", k) for _, _, cut, k in cases]


def test_a_seeded_request_draws_plain_decodings_text_alone_and_under_load(spec, plain):
    """Regression: a verify step drew other random numbers than plain decoding, so a seeded request's
    text changed with which of its steps verified drafts, which depends on other traffic (a bug hunt:
    'lazy dog.' alone, 'lazy dogs.' beside six other requests). Each token is now drawn with its
    position's key, drafted or not."""
    prompts = [p for i, p in enumerate(_prompts(8)) if i % 4]  # repetitive: n-grams match, drafts verify
    body = {"max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": 99}
    want = _texts(asyncio.run(_complete_all(plain.url, prompts, **body)))
    before = spec.metric("meshlm_spec_draft_tokens_total")
    alone = [_texts(asyncio.run(_complete_all(spec.url, [p], **body)))[0] for p in prompts]

    async def loaded():
        others = _complete_all(spec.url, _prompts(), max_tokens=40)
        return (await asyncio.gather(_complete_all(spec.url, prompts, **body), others))[0]

    assert alone == want and _texts(asyncio.run(loaded())) == want
    assert spec.metric("meshlm_spec_draft_tokens_total") > before


def test_a_stop_string_in_one_stream_leaves_the_others_untouched(spec, plain, reference):
    """Regression: a sequence ended by a stop string while the next step ran made the engine drop that
    step's tokens for every other row."""
    for srv in (plain, spec):
        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                stopper = c.post("/v1/completions", json={"prompt": [5, 6] * 5, "max_tokens": 40, "temperature": 0,
                                                          "stop": [" "]})
                others = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0,
                                                           "logprobs": 1}) for p in _prompts()[:6]]
                return await asyncio.gather(stopper, *others)

        rs = asyncio.run(run())
        assert all(r.status_code == 200 for r in rs)
        assert _texts([r.json() for r in rs[1:]]) == _texts(reference[:6])


def test_request_can_opt_out(spec, reference):
    before = spec.metric("meshlm_spec_draft_tokens_total")
    got = asyncio.run(_complete_all(spec.url, _prompts()[:4], speculative=False))
    assert _texts(got) == _texts(reference[:4])
    assert spec.metric("meshlm_spec_draft_tokens_total") == before


def test_abort_mid_verify_and_serve_on(spec, reference):
    async def abort_after(n: int):
        async with httpx.AsyncClient(base_url=spec.url, timeout=60) as c:
            req = {"prompt": [11, 12, 13] * 8, "max_tokens": 400, "stream": True, "ignore_eos": True,
                   "temperature": 0}
            async with c.stream("POST", "/v1/completions", json=req) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += bool(line)
                    if seen >= n:
                        return

    async def main():
        await asyncio.wait_for(asyncio.gather(*[abort_after(3 + i) for i in range(6)]), 60)

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while spec.metric("meshlm_batch_size") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert spec.metric("meshlm_batch_size") == 0
    got = asyncio.run(_complete_all(spec.url, _prompts()[:4]))
    assert _texts(got) == _texts(reference[:4])


def draft_flags(path) -> tuple[str, ...]:
    return ("--speculative", "draft", "--draft-model", str(path), "--no-adaptive-speculation",
            "--num-speculative-tokens", "3", "--speculative-max-batch-size", "16")


@pytest.fixture(scope="module")
def unrelated_draft(tmp_path_factory):
    """Other random weights, smaller, with the tiny models' tokenizer: its drafts are rarely right."""
    from meshlm.model.demo import make_tiny

    return make_tiny(tmp_path_factory.mktemp("draft") / "other", "llama", layers=1, hidden=32, heads=2,
                     kv_heads=1, seed=7)


@pytest.mark.parametrize("which", ["self", "unrelated"])
def test_draft_model_greedy_text_equals_plain_decoding(tiny_model, unrelated_draft, tmp_path, reference, which):
    """The target as its own draft accepts everything; an unrelated draft little: the text is the same."""
    draft = tiny_model if which == "self" else unrelated_draft
    srv = ServerProcess(tiny_model, "--max-model-len", "512", *draft_flags(draft), log_dir=tmp_path)
    try:
        got = asyncio.run(_complete_all(srv.url, _prompts()))
        drafted, accepted = srv.metric("meshlm_spec_draft_tokens_total"), srv.metric("meshlm_spec_accepted_tokens_total")
        streamed = "".join(c.choices[0].text for c in openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
                           .completions.create(model="tiny-llama", prompt=_prompts()[1], max_tokens=24, temperature=0,
                                               stream=True))
    finally:
        srv.stop()
    _assert_same(got, reference)
    assert streamed == _texts(reference)[1]
    assert drafted > 100
    assert accepted == drafted if which == "self" else accepted < drafted / 2


def test_a_draft_with_another_tokenizer_is_refused_at_start(tiny_model, tmp_path):
    from meshlm.model.demo import make_tiny

    wrong = make_tiny(tmp_path / "v600", "llama", vocab=600)
    r = subprocess.run([sys.executable, "-m", "meshlm", "serve", "--model", str(tiny_model), "--port", "0",
                        "--speculative", "draft", "--draft-model", str(wrong)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "must use the target's tokenizer" in r.stderr and "600" in r.stderr


def test_preemption_during_speculation(tiny_model, tmp_path, reference):
    """A KV budget so small that sequences are preempted mid-speculation (and recomputed)."""
    srv = ServerProcess(tiny_model, "--max-model-len", "512", "--no-prefix-cache", "--kv-cache-memory", "48KB",
                        "--block-size", "8", *SPEC, log_dir=tmp_path)
    try:
        got = asyncio.run(_complete_all(srv.url, _prompts()))
        assert srv.metric("meshlm_preemptions_total") > 0
        assert srv.metric("meshlm_spec_accepted_tokens_total") > 0
        # the operator hears of it once (a line a minute at most), not only from /metrics
        assert srv.log.read_text().count("preempted for want of KV blocks") == 1
    finally:
        srv.stop()
    _assert_same(got, reference)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    from meshlm.model.demo import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tp") / "tiny-kv4", "llama", layers=2, hidden=64, heads=4, kv_heads=4)


@pytest.fixture(scope="module")
def tp_model_reference(tp_model, tmp_path_factory):
    """The single process's completions of `_prompts()`, which every tensor-parallel mode must match."""
    single = ServerProcess(tp_model, "--max-model-len", "512", "--no-prefix-cache",
                           log_dir=tmp_path_factory.mktemp("tp-one"))
    try:
        return asyncio.run(_complete_all(single.url, _prompts()))
    finally:
        single.stop()


def test_tensor_parallel_speculation_matches_single_process(tp_model, tp_model_reference, tmp_path):
    want = tp_model_reference
    tp = ServerProcess(tp_model, "--max-model-len", "512", "--tensor-parallel", "2", *SPEC, log_dir=tmp_path)
    try:
        got = asyncio.run(_complete_all(tp.url, _prompts()))
        assert tp.metric("meshlm_spec_accepted_tokens_total") > 0
        assert tp.metric("meshlm_spec_draft_tokens_total") > tp.metric("meshlm_spec_accepted_tokens_total")
    finally:
        tp.stop()
    assert _texts(got) == _texts(want)


@pytest.mark.parametrize("which", ["self", "unrelated"])
def test_tensor_parallel_draft_model_matches_single_process(tp_model, tp_model_reference, unrelated_draft, tmp_path,
                                                           which):
    """The draft runs on the leader alone (TP=1) while the target verifies on both ranks."""
    want = tp_model_reference
    draft = tp_model if which == "self" else unrelated_draft
    tp = ServerProcess(tp_model, "--max-model-len", "512", "--tensor-parallel", "2", *draft_flags(draft),
                       log_dir=tmp_path)
    try:
        got = asyncio.run(_complete_all(tp.url, _prompts()))
        drafted, accepted = tp.metric("meshlm_spec_draft_tokens_total"), tp.metric("meshlm_spec_accepted_tokens_total")
    finally:
        tp.stop()
    assert _texts(got) == _texts(want)
    assert drafted > 100
    assert accepted == drafted if which == "self" else accepted < drafted / 2


def test_worker_killed_while_speculating_fails_within_10s(tp_model, tmp_path):
    srv = ServerProcess(tp_model, "--max-model-len", "512", "--tensor-parallel", "2", "--worker-timeout", "3",
                        *SPEC, log_dir=tmp_path)
    worker = [int(x) for x in os.popen(f"ps -o pid= --ppid {srv.proc.pid}").read().split()][0]

    async def stream_until_error():
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            req = {"prompt": [21, 22, 23] * 6, "max_tokens": 400, "stream": True, "ignore_eos": True,
                   "temperature": 0}
            async with c.stream("POST", "/v1/completions", json=req) as r:
                lines, killed = [], False
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
                    if not killed and srv.metric("meshlm_spec_verify_steps_total") > 0:
                        os.kill(worker, signal.SIGKILL)  # while the stream is speculating
                        killed = True
                        t_kill[0] = time.monotonic()
                return lines

    t_kill = [0.0]
    try:
        lines = asyncio.run(stream_until_error())
        assert t_kill[0] and time.monotonic() - t_kill[0] < 10
        assert any('"error"' in line for line in lines) and lines[-1] == "data: [DONE]"
        assert httpx.get(srv.url + "/health").status_code == 503
    finally:
        srv.stop()


def test_demo_model_input_grounded_text_equals_plain(tmp_path):
    text = ("The committee met on Tuesday to review the budget. It approved the new library, delayed the road "
            "repairs, and asked for a second report on the harbour before the end of the year.")
    messages = [{"role": "user", "content": "Repeat this text exactly:\n\n" + text}]
    outs = []
    for flags in ((), ("--speculative", "ngram")):
        srv = ServerProcess("demo", "--max-model-len", "1024", "--no-prefix-cache", *flags, log_dir=tmp_path)
        try:
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
                "messages": messages, "max_tokens": 48, "temperature": 0})
            outs.append(r.json()["choices"][0]["message"]["content"])
            if flags:
                assert srv.metric("meshlm_spec_accepted_tokens_total") > 10
                # The copy was accepted in runs long enough for the drafts to grow past K = 5 (to 10, then
                # 15): verify chunks of up to 16 tokens ran, and their text is plain decoding's.
                assert srv.metric('meshlm_spec_accepted_per_position_total{position="9"}') > 0
        finally:
            srv.stop()
    assert outs[0] == outs[1] and outs[0]

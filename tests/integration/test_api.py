"""The OpenAI API over a real socket: shapes, parameters, streaming, the official client."""

from __future__ import annotations

import json
import os
import time

import openai
import pytest

from conftest import process_environ, stop_ending_at

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Tell me a story about a cat."}], "temperature": 0, "max_tokens": 12}


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_health_models_metrics(client):
    assert client.get("/health").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-llama"
    assert client.get("/v1/models/tiny-llama").json()["id"] == "tiny-llama"  # openai's models.retrieve
    time.sleep(1.1)  # a card's `created` is when the model began being served, not the time of each read
    assert client.get("/v1/models/tiny-llama").json()["created"] == models["data"][0]["created"]
    missing = client.get("/v1/models/org/other-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    client.post("/v1/chat/completions", json=CHAT)
    text = client.get("/metrics").text
    for name in ("meshlm_requests_total", "meshlm_prompt_tokens_total", "meshlm_generation_tokens_total",
                 "meshlm_time_to_first_token_seconds_bucket", "meshlm_inter_token_latency_seconds_bucket",
                 "meshlm_queue_depth", "meshlm_batch_size", "meshlm_kv_cache_bytes"):
        assert name in text, name


def test_chat_usage_and_finish_reason(client):
    body = client.post("/v1/chat/completions", json=CHAT).json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion"
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] == 12 and u["total_tokens"] == u["prompt_tokens"] + 12


def test_stream_equals_whole_and_ends_with_done(client):
    whole = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    req = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 12
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2] if e["choices"])
    assert text == whole
    finals = [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals == ["length"]


def test_completions_prompt_forms(client):
    ids = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0}).json()
    assert ids["object"] == "text_completion" and ids["usage"]["prompt_tokens"] == 4
    many = client.post("/v1/completions", json={"prompt": ["a cat", "a dog"], "max_tokens": 3, "temperature": 0}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1]


def test_seed_reproducible_and_n(client):
    req = {**CHAT, "temperature": 1.0, "seed": 1234, "max_tokens": 16, "n": 2}
    a = client.post("/v1/chat/completions", json=req).json()
    b = client.post("/v1/chat/completions", json=req).json()
    texts_a = [c["message"]["content"] for c in a["choices"]]
    assert texts_a == [c["message"]["content"] for c in b["choices"]]
    assert len(texts_a) == 2 and texts_a[0] != texts_a[1]  # choice i uses seed + i
    other = client.post("/v1/chat/completions", json={**req, "seed": 99, "n": 1}).json()
    assert other["choices"][0]["message"]["content"] != texts_a[0]


def test_stop_string_not_leaked(client):
    req = {"prompt": "once upon a time", "max_tokens": 20, "temperature": 0}
    full = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    stop = full[6:9]  # spans token boundaries in general
    cut = full[: full.index(stop)]
    got = client.post("/v1/completions", json={**req, "stop": [stop]}).json()["choices"][0]
    assert got["text"] == cut and got["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={**req, "stop": stop, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut


def test_stop_reason_names_the_stop_string_or_token_id_that_ended_a_choice(client):
    """vLLM's `stop_reason` beside finish_reason: the matched stop string, the stop_token_ids id, or null
    (EOS, the length limit). It was missing, so a client could not tell which of its stops ended the text."""
    req = {"prompt": "once upon a time", "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    full = client.post("/v1/completions", json=req).json()["choices"][0]
    assert (full["finish_reason"], full["stop_reason"]) == ("length", None)
    stop = full["text"][6:9]
    token = full["token_ids"][3]
    cases = [({"stop": ["zzz-never", stop]}, stop), ({"stop_token_ids": [token]}, token)]
    for extra, want in cases:
        got = client.post("/v1/completions", json={**req, **extra}).json()["choices"][0]
        assert (got["finish_reason"], got["stop_reason"]) == ("stop", want), extra
        with client.stream("POST", "/v1/completions", json={**req, **extra, "stream": True}) as r:
            last = [e for e in sse_events(r.iter_lines())[:-1] if e["choices"][0]["finish_reason"]]
        assert [(e["choices"][0]["finish_reason"], e["choices"][0]["stop_reason"]) for e in last] == [("stop", want)]
    chat = client.post("/v1/chat/completions", json={**CHAT, "stop_token_ids": [token], "ignore_eos": True}).json()
    chat = chat["choices"][0]  # ignore_eos: only the stop id can end it before max_tokens
    assert (chat["finish_reason"] == "stop") == (chat["stop_reason"] == token) and chat["stop_reason"] in (None, token)


def test_a_stop_string_matched_on_the_last_allowed_token_is_a_stop(client):
    """Regression: the length limit ended the sequence first and the stop string's finish was skipped,
    so the text was cut but finish_reason said "length". vLLM checks stop strings before the limit."""
    req = {"prompt": "once upon a time", "max_tokens": 40, "temperature": 0, "logprobs": 0}
    full = client.post("/v1/completions", json=req).json()["choices"][0]
    assert full["finish_reason"] == "length"
    stop = stop_ending_at(full["text"], len(full["text"]))  # its first match ends in the 40th token
    cut = full["text"][: full["text"].index(stop)]
    body = {**req, "stop": [stop], "n": 2}
    got = client.post("/v1/completions", json=body).json()
    assert [(c["text"], c["finish_reason"]) for c in got["choices"]] == [(cut, "stop")] * 2
    assert got["usage"]["completion_tokens"] == 80  # the 40th token was generated and stopped on
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r.iter_lines())
    assert [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"][0]["finish_reason"]] == ["stop"] * 2
    assert events[-2]["usage"]["completion_tokens"] == 80


E4, B8, AD = 163, 119, 258  # the tiny tokenizer's byte tokens: the three bytes of one CJK character


def test_a_stop_string_in_a_last_unfinished_character_is_a_stop(client):
    """The detokenizer holds a character's first bytes back; at the length limit they are flushed as U+FFFD,
    and a stop string there cut the text while finish_reason said "length"."""
    body = {"prompt": "hi", "max_tokens": 1, "allowed_token_ids": [E4], "stop": ["\ufffd"]}
    got = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (got["text"], got["finish_reason"]) == ("", "stop")


def test_echoed_logprobs_of_a_prompt_ending_mid_character_join_to_the_text(client):
    """The prompt's text is decoded on its own (its last, unfinished character is U+FFFD); its bytes were joined
    with the output's into a character the text does not have ('hi丸' against 'hi\ufffd\ufffd\ufffd')."""
    body = {"prompt": [74, 75, E4], "max_tokens": 2, "echo": True, "logprobs": 0, "allowed_token_ids": [B8, AD]}
    got = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = got["logprobs"]
    assert "".join(lp["tokens"]) == got["text"]
    assert [got["text"][o:o + len(t)] for t, o in zip(lp["tokens"], lp["text_offset"])] == lp["tokens"]


def test_completion_top_logprobs_of_one_text_keep_the_best(client):
    """Alternatives that read the same (a character's first bytes: "") shared one key, and the last, lowest one
    won: the chosen token's own entry could be below its logprob. The best of them is kept."""
    # two first bytes of a character, both read "", the second made less likely
    body = {"prompt": [74, 75], "max_tokens": 1, "logprobs": 5, "allowed_token_ids": [E4, E4 + 1], "temperature": 0,
            "logit_bias": {str(E4 + 1): -1}}
    got = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    token, chosen, top = got["tokens"][0], got["token_logprobs"][0], got["top_logprobs"][0]
    assert token == "" and list(top) == [token] and abs(top[token] - chosen) < 1e-6, (chosen, top)


def test_a_stop_string_within_min_tokens_is_no_stop(client):
    """vLLM checks stop strings only once min_tokens are out (its detokenizer skips them before): a match
    ending within them is shown as text, and the first one ending past them stops. It used to stop there."""
    req = {"prompt": "once upon a time", "max_tokens": 20, "temperature": 0, "logprobs": 0}
    full = client.post("/v1/completions", json=req).json()["choices"][0]
    text, offsets = full["text"], full["logprobs"]["text_offset"]
    stop = text[6:9]

    def token_ending(end: int) -> int:  # how many tokens it takes to write text[:end]
        return sum(1 for o in offsets if o < end)

    first = text.index(stop) + len(stop)
    min_tokens = token_ending(first)
    later = [i for i in range(len(text)) if text.startswith(stop, i) and token_ending(i + len(stop)) > min_tokens]
    want = (text[: later[0]], "stop") if later else (text, "length")
    got = client.post("/v1/completions", json={**req, "stop": [stop], "min_tokens": min_tokens}).json()["choices"][0]
    assert (got["text"], got["finish_reason"]) == want
    with client.stream("POST", "/v1/completions", json={**req, "stop": [stop], "min_tokens": min_tokens,
                                                      "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want[0]


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(client):
    """vLLM's extension: once silently ignored (the stop string was cut), now honoured, streamed or not."""
    req = {"prompt": "once upon a time", "max_tokens": 20, "temperature": 0}
    full = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    stop = full[6:9]
    want = full[: full.index(stop) + len(stop)]
    body = {**req, "stop": [stop], "include_stop_str_in_output": True}
    got = client.post("/v1/completions", json=body).json()["choices"][0]
    assert got["text"] == want and got["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    # vLLM's other extensions at their defaults change nothing, and are accepted
    plain = client.post("/v1/completions", json={**req, "skip_special_tokens": True, "use_beam_search": False})
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == full


def test_logprobs_chat(client):
    body = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 3}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 12
    for item in content:
        tops = [t["logprob"] for t in item["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item["logprob"] <= tops[0] + 1e-6  # greedy: the chosen token is the top one
        assert abs(item["logprob"] - tops[0]) < 1e-5


def test_logprobs_of_tokens_holding_parts_of_a_character(client):
    """Regression: a token holding part of a UTF-8 character reported the bytes of U+FFFD, and completions
    offsets counted one character per such token. The tiny tokenizer writes "é" as two tokens, "日" as three.
    Like vLLM, a token's text is what it completes ("" for a first part); its bytes are its own."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "structured_outputs": {"regex": "é"}}
    body = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
    content = body["logprobs"]["content"]
    assert body["message"]["content"] == "é"
    assert [(x["token"], x["bytes"]) for x in content] == [("", [195]), ("é", [169])]
    assert [(t["token"], t["bytes"]) for x in content for t in x["top_logprobs"][:1]] == [("", [195]), ("é", [169])]
    # The text so far ends in "a" and the first part of "日" (the 4th token); the 4th token starts where "日" does.
    req = {"prompt": "x", "max_tokens": 4, "temperature": 0, "logprobs": 1, "structured_outputs": {"regex": "aé日"}}
    choice = client.post("/v1/completions", json=req).json()["choices"][0]
    assert choice["text"] == "aé\ufffd"  # the dangling part of "日" is released as U+FFFD
    lp = choice["logprobs"]
    assert (lp["tokens"], lp["text_offset"]) == (["a", "", "é", ""], [0, 1, 1, 2])
    with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        chunks = [e["choices"][0]["logprobs"] for e in sse_events(r.iter_lines())[:-1] if e["choices"][0]["logprobs"]]
    assert [o for c in chunks for o in c["text_offset"]] == [0, 1, 1, 2]  # offsets into the whole text, not chunks


def test_penalties_change_output(client):
    base = {"prompt": "the the the", "max_tokens": 24, "temperature": 0}
    plain = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    pen = client.post("/v1/completions", json={**base, "frequency_penalty": 2.0, "presence_penalty": 2.0}).json()
    assert pen["choices"][0]["text"] != plain


def test_openai_client_chat_and_completions(server):
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = oc.models.list().data[0].id
    chat = oc.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=8, temperature=0, user="u1")
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    stream = oc.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=8, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content and chunks[-1].usage.completion_tokens == 8
    comp = oc.completions.create(model=model, prompt="hello", max_tokens=6, temperature=0)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in oc.completions.create(
        model=model, prompt="hello", max_tokens=6, temperature=0, stream=True))
    assert streamed == comp.choices[0].text


def test_openai_client_errors(server):
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.create(model="no-such-model", messages=CHAT["messages"])
    with pytest.raises(openai.BadRequestError) as err:
        oc.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "word " * 2000}])
    assert "512" in str(err.value)


def test_startup_log_names_blas_and_cpu_kernels(server):
    """The CPU-path choices are visible in the log: OpenBLAS (with sleeping idle threads) and meshlm's kernels."""
    from meshlm.platform import GLIBC_MALLOC_TUNING, find_openblas

    log = server.log.read_text()
    if find_openblas() is not None:
        assert "using OpenBLAS for CPU matmuls" in log
        assert "OPENBLAS_THREAD_TIMEOUT=4" in log
    if find_openblas() is not None and "MESHLM_OPENBLAS" not in os.environ:
        # The same re-exec keeps glibc's big buffers on a never-trimmed heap (platform.GLIBC_MALLOC_TUNING).
        environ = process_environ(server.proc.pid)
        for name, value in GLIBC_MALLOC_TUNING.items():
            assert environ.get(name) == value and f"{name}={value}" in log
    from meshlm.model.cpu_kernels import native_ops

    native, status = native_ops()
    assert f"CPU kernels: native: {status}" in log  # the compiled kernels, or why not
    assert ("attention: CPU kernels (compiled, paged decode)" if native else "attention: CPU kernels (MLX ops)") in log


THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% for d in documents or [] %}{{ 'DOC: ' + d['text'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")


def test_chat_template_kwargs_and_documents_reach_the_template(tiny_model, tmp_path):
    """vLLM's extensions: were accepted and ignored, so a client could never turn a Qwen3's thinking off
    (`enable_thinking`) nor hand a template its `documents`. A non-object or a reserved name is a 400;
    so is chat `echo` (it was ignored too)."""
    import shutil

    import httpx
    from conftest import ServerProcess

    model = tmp_path / "templated"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    srv = ServerProcess(model, "--max-model-len", "512", log_dir=tmp_path)
    try:
        def prompt_tokens(**extra) -> httpx.Response:
            return httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={**CHAT, "max_tokens": 1, **extra})

        plain = prompt_tokens().json()["usage"]["prompt_tokens"]
        off = prompt_tokens(chat_template_kwargs={"enable_thinking": False}).json()["usage"]["prompt_tokens"]
        on = prompt_tokens(chat_template_kwargs={"enable_thinking": True}).json()["usage"]["prompt_tokens"]
        docs = prompt_tokens(documents=[{"title": "t", "text": "a long document"}]).json()["usage"]["prompt_tokens"]
        refused = [prompt_tokens(chat_template_kwargs="abc"), prompt_tokens(chat_template_kwargs={"tokenize": True}),
                   prompt_tokens(documents=[{"text": 5}]), prompt_tokens(echo=True)]
        assert prompt_tokens(echo=False).status_code == 200
    finally:
        srv.stop()
    # mlx-lm's tokenizer passes enable_thinking=False by default to a tokenizer without think tokens.
    assert off == plain > on and plain < docs
    assert [r.status_code for r in refused] == [400] * 4, [r.text for r in refused]
    assert "tokenize" in refused[1].json()["error"]["message"]


def test_a_method_the_route_does_not_take_is_a_405_saying_which_it_takes(client):
    """The JSON 405 dropped Starlette's `Allow` header (RFC 9110 requires it; FastAPI and vLLM send it)."""
    for method, path, allowed in (("DELETE", "/health", "GET"), ("GET", "/v1/chat/completions", "POST")):
        r = client.request(method, path)
        assert r.status_code == 405 and allowed in r.headers.get("allow", ""), (method, path, r.headers)
        assert r.json()["error"]["type"] == "invalid_request_error"
    head = client.head("/health")  # load balancers probe with HEAD
    assert head.status_code == 200 and head.content == b""


# -- echo and prompt logprobs (lm-eval's loglikelihood, vLLM's prompt_logprobs) ------------------------

ECHOED = "the river runs past the old mill and the"


def test_echo_scores_a_prompt_with_the_official_client(server):
    """OpenAI's legacy way to score a text: echo, max_tokens 0, logprobs. The text is the prompt, its tokens
    join to it, the first has no logprob, and nothing is generated or counted. With max_tokens > 0 the
    prompt leads the generated text and logprobs, with the same prompt logprobs."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    scored = c.completions.create(model="tiny-llama", prompt=ECHOED, max_tokens=0, echo=True, logprobs=2)
    choice, usage = scored.choices[0], scored.usage
    lp = choice.logprobs
    assert choice.text == ECHOED and choice.finish_reason == "length" and usage.completion_tokens == 0
    assert "".join(lp.tokens) == ECHOED and len(lp.tokens) == usage.prompt_tokens == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) in (2, 3) for t in lp.top_logprobs[1:])
    # "The API will always return the logprob of the sampled token": up to logprobs + 1 entries (as vLLM)
    assert all(top[t] == x for t, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    more = c.completions.create(model="tiny-llama", prompt=ECHOED, max_tokens=4, echo=True, logprobs=2, temperature=0,
                                extra_body={"ignore_eos": True})
    plain = c.completions.create(model="tiny-llama", prompt=ECHOED, max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert more.choices[0].text == ECHOED + plain.choices[0].text and more.usage.completion_tokens == 4
    prompt_part = more.choices[0].logprobs.token_logprobs[: len(lp.tokens)]
    assert prompt_part[0] is None and max(abs(a - b) for a, b in zip(prompt_part[1:], lp.token_logprobs[1:])) < 1e-4
    assert len(more.choices[0].logprobs.tokens) == len(lp.tokens) + 4


def test_echo_streams_the_prompt_first_and_serves_every_prompt_and_choice(client):
    whole = client.post("/v1/completions", json={"prompt": ECHOED, "max_tokens": 5, "echo": True, "logprobs": 0,
                                                 "temperature": 0}).json()["choices"][0]
    req = {"prompt": ECHOED, "max_tokens": 5, "echo": True, "logprobs": 0, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=req) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert events[0]["choices"][0]["text"].startswith(ECHOED)
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    tokens = [t for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    body = client.post("/v1/completions", json={"prompt": ["one two", "three four five"], "n": 2, "max_tokens": 0,
                                                "echo": True}).json()
    assert [c["text"] for c in body["choices"]] == ["one two", "one two", "three four five", "three four five"]
    assert body["usage"]["completion_tokens"] == 0 and all(c["logprobs"] is None for c in body["choices"])


def test_vllm_prompt_logprobs_on_completions_and_chat(client):
    """vLLM's layout: per prompt token (null for the first) a map of token id to its logprob, rank and text,
    holding the prompt's own token and the top alternatives; per choice for completions, beside the
    choices for chat."""
    ids = [5, 17, 42, 99, 7, 300]
    body = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2,
                                                "temperature": 0}).json()
    echoed = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True,
                                                  "logprobs": 0}).json()["choices"][0]["logprobs"]["token_logprobs"]
    pl = body["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for i, entry in enumerate(pl[1:], start=1):
        own = entry[str(ids[i])]
        assert abs(own["logprob"] - echoed[i]) < 1e-4 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        ranked = sorted(v["rank"] for k, v in entry.items() if k != str(ids[i]))
        assert ranked in ([1, 2], [1], [2]) and len(entry) in (2, 3)  # the prompt token may be a top one
        assert all(v["logprob"] <= 0 for v in entry.values())
    chat = client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:]) and "prompt_logprobs" not in chat["choices"][0]


# -- vLLM's prompt-shaping extensions ---------------------------------------------------------------

def prompt_ids_of(body: dict) -> list[int]:
    """A prompt's ids after its first, read back from `prompt_logprobs: 0` (each entry is the token alone)."""
    return [int(next(iter(e))) for e in body["prompt_logprobs"][1:]]


def test_continue_final_message_leaves_the_last_message_open(client, tiny_model):
    """vLLM's `continue_final_message` with `add_generation_prompt: false`: the prompt is the template's
    text up to the end of the last message's content, which the model continues (a reply's start given by
    the client). Both at once are a 400, as vLLM."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    messages = [{"role": "user", "content": "Tell me about cats."}, {"role": "assistant", "content": "Cats are"}]
    base = {"messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    body = client.post("/v1/chat/completions", json={**base, "add_generation_prompt": False,
                                                     "continue_final_message": True}).json()
    def ids(**flags) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages, tokenize=False, **flags), add_special_tokens=False)

    want = ids(add_generation_prompt=False, continue_final_message=True)
    assert prompt_ids_of(body) == want[1:] and tok.decode(want).endswith("Cats are")
    closed = client.post("/v1/chat/completions", json=base).json()  # the reply closed, a new one opened
    assert prompt_ids_of(closed) == ids(add_generation_prompt=True)[1:]
    r = client.post("/v1/chat/completions", json={**base, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_truncate_prompt_tokens_keeps_the_prompts_end(client):
    ids = list(range(10, 30))
    body = client.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 4, "max_tokens": 0,
                                                "echo": True, "logprobs": 0}).json()
    assert body["usage"]["prompt_tokens"] == 4 and len(body["choices"][0]["logprobs"]["tokens"]) == 4
    assert prompt_ids_of(client.post("/v1/completions", json={
        "prompt": ids, "truncate_prompt_tokens": 4, "max_tokens": 1, "prompt_logprobs": 0}).json()["choices"][0]) \
        == ids[-3:]
    long = client.post("/v1/completions", json={"prompt": [3 + i % 500 for i in range(600)], "truncate_prompt_tokens": -1,
                                                "max_tokens": 1})  # the context is 512: 511 kept, one to generate
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 511
    for bad in (0, 512, -2, "4"):
        r = client.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": bad, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (bad, r.text)


def test_skip_special_tokens_false_shows_special_tokens_in_text_and_logprobs(client):
    """`<|im_start|>` (id 1) forced by logit_bias: left out of the text by default, shown with
    skip_special_tokens false, and either way the logprob tokens join to the text."""
    base = {"prompt": "hello", "max_tokens": 3, "temperature": 0, "logit_bias": {"1": 100}, "logprobs": 0}
    hidden = client.post("/v1/completions", json=base).json()["choices"][0]
    shown = client.post("/v1/completions", json={**base, "skip_special_tokens": False}).json()["choices"][0]
    assert hidden["text"] == "" and shown["text"] == "<|im_start|>" * 3
    assert "".join(shown["logprobs"]["tokens"]) == shown["text"] and shown["logprobs"]["text_offset"] == [0, 12, 24]
    echo = {"prompt": [1, 75, 108], "max_tokens": 0, "echo": True}  # <|im_start|>, then two bytes' tokens
    plain = client.post("/v1/completions", json=echo).json()["choices"][0]["text"]
    echoed = client.post("/v1/completions", json={**echo, "skip_special_tokens": False}).json()["choices"][0]
    assert echoed["text"] == "<|im_start|>" + plain and len(plain) == 2


def test_cors_only_for_the_allowed_origins(server, tiny_model, tmp_path):
    """By default no browser page may call the API: a preflight is a 405 and responses carry no CORS
    header. With --allowed-origins, a listed origin's preflight and requests are allowed, another's not."""
    import httpx

    from conftest import ServerProcess

    page = "https://chat.example:8443"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models", headers={"Origin": page}).headers
    srv = ServerProcess(tiny_model, "--allowed-origins", page, log_dir=tmp_path)
    try:
        r = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert "POST" in r.headers["access-control-allow-methods"]
        r = httpx.options(srv.url + "/v1/responses/resp_1", headers={**preflight, "Access-Control-Request-Method":
                                                                     "DELETE"})  # a stored response's DELETE
        assert r.status_code == 200 and "DELETE" in r.headers["access-control-allow-methods"]
        r = httpx.post(srv.url + "/v1/chat/completions", headers={"Origin": page}, json=CHAT)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = httpx.post(srv.url + "/v1/chat/completions", headers={"Origin": page}, json={})  # errors too
        assert r.status_code == 400 and r.headers["access-control-allow-origin"] == page
        other = httpx.options(srv.url + "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    finally:
        srv.stop()


def test_an_api_key_guards_every_route_but_probes(tiny_model, tmp_path):
    """--api-key (here from MESHLM_API_KEY, as vLLM's VLLM_API_KEY): a request without the bearer token, or
    with another, is a 401 counted in /metrics; health, metrics and version stay open, and so do CORS
    preflights (browsers send them without credentials); the official client with the key works."""
    import httpx
    import openai

    from conftest import ServerProcess

    key, page = "sk-meshlm-test-123", "https://chat.example:8443"
    srv = ServerProcess(tiny_model, "--allowed-origins", page, log_dir=tmp_path, env={"MESHLM_API_KEY": key})
    try:
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(srv.url + path).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                        {"Authorization": f"Basic {key}"}):
            r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "x"}).status_code == 401
        preflight = httpx.options(srv.url + "/v1/chat/completions", headers={
            "Origin": page, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == page
        denied = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, headers={"Origin": page})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == page  # readable
        assert srv.metric('meshlm_rejected_requests_total{status="401"}') == 7
        # The scheme is case-insensitive (RFC 9110): "bearer" was a 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": f"bearer {key}"}).status_code == 200
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
        name = client.models.list().data[0].id
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=name, messages=CHAT["messages"], max_tokens=5, temperature=0, stream=True) if c.choices)
        assert streamed == client.chat.completions.create(model=name, messages=CHAT["messages"], max_tokens=5,
                                                          temperature=0).choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        srv.stop()
    assert key not in srv.log.read_text()


def test_a_chat_template_of_the_servers_own_with_default_variables(tiny_model, tmp_path):
    """--chat-template (a file) replaces the model's template; --default-chat-template-kwargs gives its
    variables to every request, and a request's chat_template_kwargs win."""
    import httpx
    from transformers import AutoTokenizer

    from conftest import ServerProcess

    template = tmp_path / "t.jinja"
    template.write_text("{{ greeting }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    srv = ServerProcess(tiny_model, "--chat-template", str(template), "--chat-template-args", '{"greeting": "hello"}',
                        log_dir=tmp_path)
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        got = httpx.post(srv.url + "/tokenize", json=chat).json()["tokens"]
        assert got == tok.encode("hello<user>hi<assistant>", add_special_tokens=False)
        got = httpx.post(srv.url + "/tokenize", json={**chat, "chat_template_kwargs": {"greeting": "bye"}}).json()
        assert got["tokens"] == tok.encode("bye<user>hi<assistant>", add_special_tokens=False)
        r = httpx.post(srv.url + "/v1/chat/completions", json={**chat, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
            tok.encode("hello<user>hi<assistant>", add_special_tokens=False))
    finally:
        srv.stop()


def test_a_chat_template_that_cannot_render_a_message_is_refused_at_start_up(tiny_model):
    from mlx_lm import load

    from meshlm.api.prompts import use_template

    _, tok = load(str(tiny_model))
    with pytest.raises(ValueError, match="--chat-template does not render a user's message: .*no users here"):
        use_template(tok, "{{ raise_exception('no users here') }}", {})
    # Jinja's sandbox caps a range at 100,000 items, not loops of them: nested ones can run for days. This
    # one runs ~2 s (60 million empty turns), past the check's 0.5 s, and then ends: its thread does not
    # outlive the test by much.
    slow = "{% for i in range(100000) %}{% for j in range(600) %}{% endfor %}{% endfor %}{{ 'x' }}"
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="did not render a user's message within 0.5 s"):
        use_template(tok, slow, {}, within=0.5)
    assert time.monotonic() - t0 < 1.5


def test_the_models_own_chat_template_is_checked_at_start_up(tiny_model, caplog):
    """Only --chat-template was checked: a model whose own template never ended held a worker thread per chat
    request, until every request hung while /health said ok."""
    from mlx_lm import load

    from meshlm.api.prompts import check_own_template

    _, tok = load(str(tiny_model))
    check_own_template(tok, {}, 512)  # the tiny model's ChatML renders
    tok.chat_template = "{% for i in range(100000) %}{% for j in range(600) %}{% endfor %}{% endfor %}{{ 'x' }}"
    with pytest.raises(ValueError, match="the model's chat template did not render .* within 0.5 s.*--chat-template"):
        check_own_template(tok, {}, 512, within=0.5)
    tok.chat_template = "{{ raise_exception('no users here') }}"
    check_own_template(tok, {}, 512)  # served (completions work), with a word
    assert "does not render a user's message (TemplateError: no users here)" in caplog.text
    tok.chat_template = "<|im_start|>{{ messages[0]['content'] }}"
    check_own_template(tok, {}, 2)  # its ids past an embedding of 2
    assert "outside its embedding (vocab_size 2)" in caplog.text


def test_tokenize_and_detokenize_as_vllm(client, tiny_model):
    """vLLM's /tokenize (a text, or the prompt a chat would get) and /detokenize, with this server's
    tokenizer and template; ids are checked against the vocabulary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    text = client.post("/tokenize", json={"prompt": "hello there", "return_token_strs": True}).json()
    assert text["tokens"] == tok.encode("hello there") and text["count"] == len(text["tokens"])
    assert text["max_model_len"] == 512 and text["token_strs"] == tok.convert_ids_to_tokens(text["tokens"])
    chat = client.post("/tokenize", json=CHAT).json()
    served = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    assert chat["count"] == served["usage"]["prompt_tokens"] and chat["token_strs"] is None
    assert client.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == \
        tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False)
    for path, body, param in (("/detokenize", {"tokens": [0, 512]}, "tokens"),
                              ("/detokenize", {"tokens": list(range(3, 600))}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": []}, "messages")):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert client.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


def test_token_ids_beside_the_text_whole_and_streamed(client):
    """vLLM's `return_token_ids` (RL rollouts): the prompt's and the output's ids, which decode to the text;
    streamed, the prompt's come first and the outputs' chunks add up to the whole. With
    `return_tokens_as_token_ids` logprob tokens are named `token_id:N`."""
    base = {"prompt": "the river runs", "max_tokens": 6, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    whole = client.post("/v1/completions", json=base).json()["choices"][0]
    assert whole["prompt_token_ids"] == client.post("/tokenize", json={"prompt": "the river runs"}).json()["tokens"]
    assert len(whole["token_ids"]) == 6
    with client.stream("POST", "/v1/completions", json={**base, "stream": True}) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert events[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == whole["token_ids"]
    chat = client.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == client.post("/tokenize", json=CHAT).json()["tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "return_token_ids": True, "stream": True}) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]
    named = client.post("/v1/completions", json={**base, "logprobs": 1, "return_tokens_as_token_ids": True}).json()
    lp = named["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in named["choices"][0]["token_ids"]]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    assert named["choices"][0]["text"] == whole["text"] and lp["text_offset"][0] == 0


def test_reasoning_parser_puts_an_open_think_block_in_reasoning_content(tiny_model, tmp_path):
    """--reasoning-parser: a prompt leaving a think block open (here the client's own `<think>`, continued)
    makes the output reasoning until `</think>`; a random model never closes it, so all of it is
    reasoning and the answer null, whole or streamed. A prompt without one is answered as without the
    parser. (Where the tags fall in the text: tests/unit/test_reasoning.py.)"""
    import httpx

    from conftest import ServerProcess

    srv = ServerProcess(tiny_model, "--reasoning-parser", "qwen3", log_dir=tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            thinking = {"messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "<think>"}],
                        "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 12,
                        "temperature": 0}
            whole = c.post("/v1/chat/completions", json=thinking).json()["choices"][0]["message"]
            assert whole["content"] is None and len(whole["reasoning_content"]) > 0
            with c.stream("POST", "/v1/chat/completions", json={**thinking, "stream": True}) as r:
                deltas = [e["choices"][0]["delta"] for e in sse_events(r.iter_lines()) if e != "[DONE]"]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
            assert not "".join(d.get("content", "") for d in deltas)
            plain = c.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    finally:
        srv.stop()
    assert "reasoning_content" not in plain and plain["content"]


def test_a_schema_applies_after_the_reasoning(tmp_path):
    """--reasoning-parser with a response schema, on a model whose <think> and </think> are tokens (as
    Qwen3's): the model reasons freely (a logit bias makes this random one end its reasoning soon), then
    the schema holds its answer; whole or streamed, the reasoning is reasoning_content and the JSON the
    content. Before, constrained output began with the grammar's first token and had no reasoning."""
    import httpx

    from conftest import ServerProcess
    from meshlm.model.demo import make_tiny

    model = make_tiny(tmp_path / "thinky", "qwen3", think=True)
    end = 513  # </think>, added after the 512 trained tokens
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "<think>"}],
            "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 40, "temperature": 0,
            "logit_bias": {str(end): 8}, "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "n", "schema": schema}}}
    srv = ServerProcess(model, "--reasoning-parser", "qwen3", log_dir=tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.post("/tokenize", json={"prompt": "</think>"}).json()["tokens"] == [end]
            whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
            with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                deltas = [e["choices"][0]["delta"] for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    finally:
        srv.stop()
    message = whole["message"]
    assert whole["finish_reason"] == "stop" and message["reasoning_content"] and "</think>" not in message["content"]
    assert set(json.loads(message["content"])) == {"n"}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_return_token_ids_has_every_token_even_one_without_text(client, tiny_model):
    """Regression: a finished sequence's last token that decodes to no text (a special token, EOS) was not
    sent: token_ids came one short of completion_tokens (or empty), unless logprobs were asked for."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    for special, temperature in ((tok.convert_tokens_to_ids("<|endoftext|>"), 0.7), (tok.eos_token_id, 0.0)):
        body = {"prompt": "hello", "max_tokens": 5, "temperature": temperature, "seed": 3, "return_token_ids": True,
                "logit_bias": {str(special): 100}}
        plain = client.post("/v1/completions", json=body).json()
        scored = client.post("/v1/completions", json={**body, "logprobs": 1}).json()
        ids = plain["choices"][0]["token_ids"]
        assert ids == scored["choices"][0]["token_ids"] and len(ids) == plain["usage"]["completion_tokens"]
        assert ids and ids[-1] == special


def test_allowed_token_ids_limit_the_output(client):
    allowed = [100, 200, 300]
    body = client.post("/v1/completions", json={"prompt": "the river", "max_tokens": 12, "temperature": 1.0,
                                                "seed": 1, "allowed_token_ids": allowed,
                                                "return_token_ids": True}).json()["choices"][0]
    assert len(body["token_ids"]) == 12 and set(body["token_ids"]) <= set(allowed)
    for extra, param in (({"allowed_token_ids": [512]}, "allowed_token_ids"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"allowed_token_ids": [5], "structured_outputs": {"regex": "a+"}}, "allowed_token_ids")):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_continuous_usage_stats_and_version(client):
    req = {**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    chunks, final = events[:-1], events[-1]
    done = [e["usage"]["completion_tokens"] for e in chunks]
    assert all("usage" in e for e in chunks) and done == sorted(done) and done[0] == 0
    assert done[-1] == final["usage"]["completion_tokens"] == 12
    assert {e["usage"]["prompt_tokens"] for e in chunks} == {final["usage"]["prompt_tokens"]}
    import meshlm

    assert client.get("/version").json() == {"version": meshlm.__version__}


def test_echoed_logprobs_index_the_echoed_text_special_tokens_and_all(client):
    """Regression: a prompt string spelling special tokens is echoed as sent, but their logprob entries
    did not advance text_offset, so the offsets stopped indexing the text. Every token is now found at its
    offset, whether the text shows special tokens or not; generated specials stay out of the text."""
    prompt = "<|im_start|>user\nHi<|im_end|>"
    for skip in (True, False):
        ch = client.post("/v1/completions", json={"prompt": prompt, "echo": True, "max_tokens": 3, "logprobs": 0,
                                                  "temperature": 0, "skip_special_tokens": skip}).json()["choices"][0]
        lp = ch["logprobs"]
        assert ch["text"].startswith(prompt) and lp["tokens"][0] == "<|im_start|>"
        for token, offset in zip(lp["tokens"], lp["text_offset"]):
            assert ch["text"][offset:offset + len(token)] == token, (skip, token, offset, ch["text"])


def test_echo_scores_a_whole_context(client):
    """Nothing is generated with max_tokens 0, so a prompt may fill the context (512 here): lm-eval scores
    full windows. One more token to generate does not fit."""
    ids = [3 + i % 500 for i in range(512)]
    r = client.post("/v1/completions", json={"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 512
    r = client.post("/v1/completions", json={"prompt": ids, "echo": True, "max_tokens": 1, "logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_n_choices_share_their_prompts_logprobs(client):
    """A whole response's n choices of a prompt take its logprobs from the one sequence that scored it
    (the others may read the prompt from the cache): every choice shows the same, for each prompt."""
    prompts = ["the river runs past the old mill", "a story about the sea and the sky and the"]
    body = client.post("/v1/completions", json={"prompt": prompts, "n": 3, "max_tokens": 2, "temperature": 1.0,
                                                "seed": 7, "echo": True, "logprobs": 1, "prompt_logprobs": 1}).json()
    choices = body["choices"]
    assert len(choices) == 6
    for p in range(2):
        group = choices[3 * p: 3 * p + 3]
        assert all(c["text"].startswith(prompts[p]) for c in group)
        assert len({json.dumps(c["prompt_logprobs"]) for c in group}) == 1 and group[0]["prompt_logprobs"][1]
        n = len(group[0]["prompt_logprobs"])
        assert len({json.dumps(c["logprobs"]["token_logprobs"][:n]) for c in group}) == 1
    assert choices[0]["prompt_logprobs"] != choices[3]["prompt_logprobs"]


def test_requests_refused_before_running_are_counted_by_status(server, client):
    def rejected(status: str) -> float:
        try:
            return server.metric(f'meshlm_rejected_requests_total{{status="{status}"}}')
        except KeyError:  # no such request yet
            return 0.0

    before = {s: rejected(s) for s in ("400", "404", "405")}
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": "x", "model": "nope"}).status_code == 404
    assert client.get("/v1/completions").status_code == 405
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    after = {s: rejected(s) for s in ("400", "404", "405")}
    assert {s: after[s] - before[s] for s in after} == {"400": 1, "404": 1, "405": 1}


def test_bad_words_are_never_generated(client):
    base = {"prompt": "the river runs past the old mill and", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    plain = client.post("/v1/completions", json=base).json()["choices"][0]
    word = next(t for t in plain["logprobs"]["tokens"] if t.strip())  # the first token of the greedy text with a letter
    banned = client.post("/v1/completions", json={**base, "bad_words": [word.strip()]}).json()["choices"][0]
    assert banned["text"] != plain["text"]
    assert all(t.strip() != word.strip() for t in banned["logprobs"]["tokens"])
    for bad in ([""], ["x" * 1001], ["w"] * 257, "word"):
        r = client.post("/v1/completions", json={**base, "bad_words": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("bad_words"), (bad, r.text)


def test_constraints_that_leave_no_token_are_the_requests_400(client):
    """allowed_token_ids, bad_words and a grammar can together exclude every token. That is a 400 naming
    it (an error event once streaming), never a 200 with a token outside them all (an all -inf row still
    has an argmax: token 0) nor a 503 (the grammar refusing that token)."""
    (the,) = client.post("/tokenize", json={"prompt": " the", "add_special_tokens": False}).json()["tokens"]
    both = {"allowed_token_ids": [the], "bad_words": ["the"]}
    for body in ({"prompt": "hi", "max_tokens": 5, "temperature": 0, **both},
                 {"prompt": "hi", "max_tokens": 5, "seed": 3, "logprobs": 1, **both},
                 {"prompt": "hi", "max_tokens": 5, "structured_outputs": {"choice": [" the"]}, "bad_words": ["the"]}):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_token_to_sample", (body, r.text)
        assert "exclude every token" in r.json()["error"]["message"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = sse_events(s.iter_lines())
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert [e["code"] for e in errors] == ["no_token_to_sample"], events
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "allowed_token_ids": [the, the + 1],
                                               "bad_words": ["the"], "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3  # one token left: no fault
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e-38})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text

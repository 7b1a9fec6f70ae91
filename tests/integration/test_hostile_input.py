"""Hostile input against a real server: every case is a 4xx (never a 5xx, a crash or a hang), and
afterwards the same server answers a normal request within seconds and /health tells the truth.

The tiny model's vocabulary is 512 ids and its context 512 tokens (conftest's `server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import statistics
import struct
import time

import httpx
import pytest

from conftest import COMPLETIONS_HEAD, ServerProcess, closed_within, unread_stream

pytestmark = pytest.mark.slow

VOCAB = 512
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "temperature": 0}


def still_serving(srv: ServerProcess) -> None:
    assert srv.proc.poll() is None, "the server process died"
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert time.monotonic() - t0 < 5
    health = httpx.get(srv.url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


def error_of(r: httpx.Response, status: int = 400, param: str | None = None, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err["message"]
    return err


@pytest.mark.parametrize("prompt, where", [
    ([1, 2, 99999999], "prompt[2]"),
    ([1, 2, VOCAB], "prompt[2]"),
    ([5, -1, 7], "prompt[1]"),
    ([[1, 2], [3, 2**40]], "prompt[1][1]"),
    ([[4], [-3]], "prompt[1][0]"),
    ([2**63 + i for i in range(40)], "prompt[0]"),  # crashed the engine thread in cache/keys.py
])
def test_token_ids_outside_the_vocabulary_are_refused(server, prompt, where):
    err = error_of(httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400,
                   "prompt", where, "outside the vocabulary")
    assert str(VOCAB - 1) in err["message"]
    still_serving(server)


@pytest.mark.parametrize("prompt, words", [
    (["hello", ""], ["prompt[1] is empty after tokenization"]),
    ([[1, 2], list(range(1, 512)) + [1]], ["prompt[1] has 512 tokens", "maximum context length is 512"]),
    ([list(range(1, 512)) + [1]], ["your prompt has 512 tokens"]),
])
def test_a_prompt_of_a_list_that_cannot_run_is_named(server, prompt, words):
    """The 400 for one prompt of several says which (it said `prompt` whichever it was)."""
    error_of(httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400, "prompt",
             *words)
    still_serving(server)


def test_integers_beyond_64_bits_are_refused_before_validation(server):
    for body in ({"prompt": [1, 2**64]}, {"prompt": "hi", "seed": -(2**70)}, {"prompt": "hi", "max_tokens": 10**30}):
        error_of(httpx.post(server.url + "/v1/completions", json=body), 400, None, "out of range")
    still_serving(server)


def test_an_integer_with_thousands_of_digits_is_a_400(server):
    body = b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}"
    error_of(httpx.post(server.url + "/v1/completions", content=body), 400)
    still_serving(server)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_not_json(server, literal):
    body = b'{"prompt": "hi", "temperature": ' + literal + b"}"
    error_of(httpx.post(server.url + "/v1/completions", content=body), 400, None, "not valid JSON")
    still_serving(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b"\xff", b"\xed\xa0\x80", b"cut \xe2\x82"])  # stray, encoded surrogate, cut short
def test_invalid_utf8_in_a_string_is_a_400(server, path, raw):
    body = b'{"prompt": "' + raw + b'", "messages": [{"role": "user", "content": "' + raw + b'"}], "max_tokens": 3}'
    error_of(httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}), 400, None,
             "not valid JSON (UTF-8)")
    still_serving(server)


@pytest.mark.parametrize("depth", [33, 200, 5000, 100_000])
def test_deep_nesting_is_a_400(server, depth):
    body = b'{"prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
    error_of(httpx.post(server.url + "/v1/completions", content=body), 400)
    still_serving(server)


@pytest.mark.parametrize("schema, words", [
    ("[" * 100_000 + "]" * 100_000, "nests deeper than 32"),  # RecursionError in json.loads
    ("[" * 480 + "]" * 480, "nests deeper than 32"),  # RecursionError further on
    ('{"type": "number", "maximum": NaN}', "not valid JSON"),
    ('{"type": "number", "minimum": -Infinity}', "not valid JSON"),
    ('{"type": "integer", "maximum": ' + "9" * 5000 + "}", "out of range"),  # not Python's int-digits limit
    ('{"type": "object"', "not valid JSON"),
])
@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_a_schema_sent_as_a_string_is_held_to_the_body_limits(server, schema, words, field):
    """A schema may come as a string of JSON; it is parsed as the body is, within the same limits."""
    extra = {"guided_json": schema} if field == "guided_json" else {"structured_outputs": {"json": schema}}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, **extra})
    error_of(r, 400, field, field, words)
    still_serving(server)


def test_a_schema_sent_as_a_string_within_the_limits_constrains(server):
    for extra in ({"guided_json": json.dumps({"type": "boolean"})},
                  {"structured_outputs": {"json": json.dumps({"enum": [[[[[1]]]]]})}}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 16, **extra}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in ("true", "false", "[[[[1]]]]"), r.text


def test_oversized_body_gets_413_unread(tiny_model, tmp_path):
    srv = ServerProcess(tiny_model, "--max-request-bytes", "64KiB", log_dir=tmp_path)
    try:
        big = json.dumps({"prompt": "word " * 20_000}).encode()
        t0 = time.monotonic()
        error_of(httpx.post(srv.url + "/v1/completions", content=big), 413)

        def chunks():  # no Content-Length: counted while it streams in
            for i in range(0, len(big), 4096):
                yield big[i : i + 4096]

        r = httpx.post(srv.url + "/v1/completions", content=chunks())
        error_of(r, 413, None, "65536")
        assert time.monotonic() - t0 < 5
        # The body's rest is never read: the connection closes after the 413 (it waited --client-timeout).
        head = COMPLETIONS_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
        answer = _answer_until_closed(srv.port, head + b"%x\r\n" % len(big) + big + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower(), answer[:300]
        assert time.monotonic() - t0 < 8
        still_serving(srv)
    finally:
        srv.stop()


def test_tool_call_arguments_in_the_history_nested_past_the_json_parser_are_text_not_a_500(server):
    """A past call's arguments string is parsed for the template; nested past the parser's stack it raised
    RecursionError, a 500. It is text now, like any unparsable string (here: far too long a prompt)."""
    deep = "[" * 100_000 + "]" * 100_000
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "tools": tools, "max_tokens": 2})
    assert error_of(r, 400, "messages")["code"] == "context_length_exceeded"
    still_serving(server)


def test_a_compressed_body_is_a_415_naming_the_encoding(server):
    import gzip

    r = httpx.post(server.url + "/v1/completions", content=gzip.compress(b'{"prompt": "hi", "max_tokens": 2}'),
                   headers={"content-type": "application/json", "content-encoding": "gzip"})
    error_of(r, 415, None, "gzip")
    still_serving(server)


def test_a_client_gone_before_its_body_is_whole_is_no_server_error(server):
    """A body cut short by the client closing its connection once logged an 'unhandled error' traceback
    twice (starlette's ClientDisconnect): it is an ordinary 400 now, and the server serves on."""
    before = server.log.read_text()
    for cut in (0, 7):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(COMPLETIONS_HEAD + b"Content-Length: 500\r\n\r\n" + b'{"prompt": "hello"}'[:cut])
            time.sleep(0.3)  # the server is reading the body
    still_serving(server)  # a whole request since: the event loop has dealt with the two cut ones
    time.sleep(0.5)
    new = server.log.read_text()[len(before):]
    assert "Traceback" not in new and "unhandled error" not in new, new[-2000:]


def test_a_client_that_resets_its_streams_leaves_no_socket_warnings(server):
    """Each stream reset by its client (RST, SO_LINGER 0) after its first chunk logged a burst of 'WARNING
    asyncio: socket.send() raised exception.' (19 for these ten): the chunks of n=16 choices written before
    uvicorn learnt the connection was gone. Those writes are dropped, quietly, and the sequences aborted."""
    before = server.log.read_text()
    body = json.dumps({"prompt": "alpha beta", "max_tokens": 200, "n": 16, "stream": True, "ignore_eos": True})
    for _ in range(10):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(COMPLETIONS_HEAD + f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            s.recv(2000)
            time.sleep(0.05)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        time.sleep(0.3)
    still_serving(server)
    new = server.log.read_text()[len(before):]
    assert "socket.send() raised exception" not in new and "Traceback" not in new, new[-2000:]


def _answer_until_closed(port: int, request_bytes: bytes) -> bytes:
    """The server's answer to raw bytes, read until it closes the connection (10 s at most)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            s.sendall(request_bytes)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                answer += chunk
    return answer


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    COMPLETIONS_HEAD + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n{}",
], ids=["garbage", "header-too-large", "two-lengths"])
def test_a_request_http_cannot_parse_is_a_json_400(server, request_bytes):
    """uvicorn answered these in text/plain ("Invalid HTTP request received."), the one error that was not
    in the shape a client parses."""
    head, _, body = _answer_until_closed(server.port, request_bytes).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), head[:300]
    assert json.loads(body)["error"]["code"] == "invalid_http"
    still_serving(server)


@pytest.mark.parametrize("kib", [17, 60])
def test_a_head_over_16_kib_is_refused_however_it_arrives(server, kib):
    """h11 refuses a head only while it is still arriving past 16 KiB: one that came in a single read was
    served (17-70 KB answered 200)."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (kib * 1024) + b"\r\n\r\n"
    status, _, body = _answer_until_closed(server.port, head).partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400") and b"connection: close" in status.lower(), status[:300]
    assert json.loads(body)["error"]["code"] == "invalid_http"
    fits = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: " + b"a" * 15_000 + b"\r\n\r\n"
    assert _answer_until_closed(server.port, fits).startswith(b"HTTP/1.1 200")
    still_serving(server)


def test_a_body_framed_twice_is_refused_and_its_connection_closed(server):
    """Transfer-Encoding and Content-Length together (RFC 9112 6.1: a proxy may have framed the body by the
    other one, request smuggling): a 400, and the connection closed after it, where uvicorn answered by
    Transfer-Encoding and kept the connection for a next request."""
    body = b'{"prompt": "hi", "max_tokens": 1}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    framing = b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n" % len(chunked)
    answer = _answer_until_closed(server.port, COMPLETIONS_HEAD + framing + chunked)  # once the server closed
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower(), answer[:300]
    assert json.loads(rest)["error"]["code"] == "ambiguous_framing"
    still_serving(server)


def test_silent_or_dribbling_clients_lose_their_connections_not_the_servers_sockets(tiny_model, tmp_path):
    """A connection that sent nothing, or half a request, or stopped reading a long response, held a socket
    for ever; enough of them use up the file descriptors and the server accepts no one. Each now ends at
    --client-timeout."""
    srv = ServerProcess(tiny_model, "--client-timeout", "1", log_dir=tmp_path)
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as idle:
            took, got = closed_within(idle, 10)
            assert got == b"" and took < 5
        with socket.create_connection(("127.0.0.1", srv.port)) as dribbler:  # each byte re-armed uvicorn's timer
            t0 = time.monotonic()
            for byte in COMPLETIONS_HEAD:
                try:
                    dribbler.sendall(bytes([byte]))
                except OSError:  # closed under it: what this test wants
                    break
                time.sleep(0.2)
            took, _ = closed_within(dribbler, 10)
            assert time.monotonic() - t0 < 5
        with socket.create_connection(("127.0.0.1", srv.port)) as half_body:
            half_body.sendall(COMPLETIONS_HEAD + b"Content-Length: 100\r\n\r\n{")
            took, got = closed_within(half_body, 10)
            assert got.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in got, got[:300]
            assert took < 5
        with socket.create_connection(("127.0.0.1", srv.port)) as body_dribbler:  # a byte within each silence
            body_dribbler.sendall(COMPLETIONS_HEAD + b"Content-Length: 100\r\n\r\n")
            t0, got = time.monotonic(), b""
            for _ in range(40):
                try:
                    body_dribbler.sendall(b" ")
                except OSError:
                    break
                time.sleep(0.3)
                body_dribbler.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    got += body_dribbler.recv(65536)
                body_dribbler.setblocking(True)
                if got:
                    break
            assert got.startswith(b"HTTP/1.1 408 ") and b"bytes/s" in got, got[:300]
            assert time.monotonic() - t0 < 5
        with unread_stream(srv.port) as stalled_reader:
            time.sleep(4)
            _, got = closed_within(stalled_reader, 10)
            assert got.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" not in got, len(got)
        # A request that lasts longer than the deadline, and a kept-alive connection that comes back
        # within uvicorn's keep-alive, are not cut.
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            long = {"prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0, lines = time.monotonic(), []
            with c.stream("POST", "/v1/completions", json=long) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    time.sleep(0.004)  # a slow reader: the stream outlasts the deadline
            assert time.monotonic() - t0 > 1.5
            lines = [line for line in lines if line]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            assert json.loads(lines[-2][len("data: "):])["usage"]["completion_tokens"] == 400
            time.sleep(0.5)
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        still_serving(srv)
    finally:
        srv.stop()


def test_a_20_mb_prompt_is_answered_at_once(server):
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({"prompt": "x" * 20_000_000}).encode(),
                   timeout=30)
    error_of(r, 413)
    # Under the body limit but far over the context: refused from its length, not tokenized.
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "lorem ipsum " * 1_000_000}, timeout=30)
    assert error_of(r, 400, "prompt")["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "lorem ipsum " * 1_000_000}]})
    assert error_of(r, 400, "messages")["code"] == "context_length_exceeded"
    # What the messages' text leaves out is bounded once templated, before it is tokenized: many short
    # messages (200,000 took ~35 s of CPU to a 400), a past tool call's megabytes of arguments. Likewise
    # through /v1/responses.
    many = [{"role": "user", "content": "x"}] * 100_000
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": many}, timeout=30)
    assert error_of(r, 400, "messages")["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/responses", json={"input": many}, timeout=30)
    assert error_of(r, 400, "input")["code"] == "context_length_exceeded"  # a response request's name
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "lorem ipsum " * 500_000}
    r = httpx.post(server.url + "/v1/responses", timeout=30, json={"input": [call]})
    assert error_of(r, 400, "input")["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 10
    still_serving(server)


@pytest.mark.parametrize("extra, param", [
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),  # numbers are numbers, as OpenAI's API holds them (ints too)
    ({"temperature": True}, "temperature"),
    ({"top_p": "1"}, "top_p"),
    ({"logit_bias": {"5": "50"}}, "logit_bias.5"),
    ({"logit_bias": {"5": True}}, "logit_bias.5"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.1}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),  # as vLLM: it was clamped to max_tokens unsaid
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"cat": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"01": 100, "1": -100}}, "logit_bias"),  # one token twice
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"stop_token_ids": [VOCAB + 3]}, "stop_token_ids"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": "x" * 1001}, "stop"),
    ({"tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),  # arguments are an object: a forced call could never be one
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),  # ignored before: a 200 answering as 'medium'
    # vLLM's extensions that would change the output, not implemented: refused unless at their default
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),  # was ignored
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's whole vocabulary
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM
    ({"max_tokens": 0}, "max_tokens"),  # only a completion's echo generates nothing
    ({"use_beam_search": True}, "use_beam_search"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 10**9}, "truncate_prompt_tokens"),
    ({"continue_final_message": True}, "continue_final_message"),  # needs add_generation_prompt false
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"logits_processors": ["my_module.Proc"]}, "logits_processors"),  # was ignored: a 200 unprocessed
    ({"structural_tag": '{"type": "structural_tag"}'}, "structural_tag"),  # was ignored: unconstrained
    ({"best_of": 3}, "best_of"),  # was ignored on chat (helper-53)
    ({"priority": 5}, "priority"),  # was ignored: first come, first served (vLLM refuses it so too)
    ({"add_special_tokens": "yes"}, "add_special_tokens"),
    ({"instructions": "be a pirate"}, "instructions"),  # the Responses API's: were dropped, a plain answer
    ({"max_output_tokens": 1}, "max_output_tokens"),
    ({"request_id": "a b"}, "request_id"),
    ({"request_id": "x" * 257}, "request_id"),
])
def test_parameters_out_of_range_or_unsupported_name_the_param(server, extra, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra})
    error_of(r, 400, param)
    still_serving(server)


def test_a_request_id_names_the_response_whole_and_streamed(server):
    """vLLM's request_id was ignored: the id was random, and a client could not correlate (helper-53)."""
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2, "request_id": "job-42"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-job-42", r.text
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 2, "stream": True, "request_id": "job-43"}) as s:
        ids = {json.loads(line[6:])["id"] for line in s.iter_lines() if line.startswith("data: {")}
    assert ids == {"cmpl-job-43"}
    r = httpx.post(server.url + "/v1/chat/completions", headers={"X-Request-Id": "hdr-1"},
                   json={**CHAT, "max_tokens": 2, "request_id": "body-1"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-hdr-1", r.text  # the header wins, as in vLLM


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True}),
])
def test_the_answer_names_its_id_in_a_header(server, path, body):
    """OpenAI's client reads `x-request-id` as a response's `_request_id`; it was always None (helper-57)."""
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        text = r.read().decode()
    assert r.status_code == 200, text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    ids = {e.get("id") or e.get("response", {}).get("id") for e in events or [json.loads(text)]} - {None}
    assert ids == {r.headers.get("x-request-id")}, (r.headers, ids)


def test_the_openai_client_sees_the_request_id(server):
    import openai

    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=CHAT["messages"], max_tokens=2,
                                  extra_body={"request_id": "x-9"})
    assert r._request_id == r.id == "chatcmpl-x-9"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 3}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "echo": None}),
])
def test_nullable_openai_parameters_sent_as_null_mean_their_default(server, path, body):
    """OpenAI's API types these as nullable and its SDKs send None as null: they were 400s."""
    nulls = {"n": None, "presence_penalty": None, "frequency_penalty": None, "logprobs": None, "stream": None}
    r = httpx.post(server.url + path, json={**body, **nulls, "temperature": 0})
    assert r.status_code == 200, r.text
    plain = httpx.post(server.url + path, json={**body, "temperature": 0}).json()
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0].get("logprobs") is None
    assert r.json()["usage"] == plain["usage"]


@pytest.mark.parametrize("extra, param", [
    ({"best_of": 3}, "best_of"),
    ({"priority": -1}, "priority"),
    ({"documents": [{"title": "t", "text": "x"}]}, "documents"),  # chat's: were dropped
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"suffix": "tail"}, "suffix"),
    ({"echo": 1}, "echo"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # chat's: was silently ignored
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"max_tokens": 0}, "max_tokens"),  # without echo there would be nothing to return
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
])
def test_completion_only_parameters(server, extra, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
    error_of(r, 400, param)
    still_serving(server)


@pytest.fixture(scope="module")
def tok(tiny_model):
    from mlx_lm.tokenizer_utils import load

    return load(tiny_model)


def greedy_tokens(server, **extra) -> list[str]:
    body = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "logprobs": 0, "ignore_eos": True, **extra})
    assert body.status_code == 200, body.text
    return body.json()["choices"][0]["logprobs"]["tokens"]


def test_logit_bias_steers_the_sampler(server, tok):
    plain = greedy_tokens(server)
    assert greedy_tokens(server, logit_bias={"77": 100}) == [tok.decode([77])] * 6
    spelled_like_first = [i for i in range(VOCAB) if tok.decode([i]) == plain[0]]
    banned = greedy_tokens(server, logit_bias={str(i): -100 for i in spelled_like_first})
    assert banned[0] != plain[0]
    still_serving(server)


# -- a long stop string must not slow anyone else's stream ----------------------------------------


async def _stream_gaps(url: str, body: dict, gaps: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            last = None
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now


async def _streams_with(url: str, long_stops: bool) -> list[float]:
    """Inter-token gaps of three plain streams beside four more streams, which carry four
    1,000-character stop strings each (that never match) or none: the same load either way."""
    gaps: list[float] = []
    base = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}
    streams = [_stream_gaps(url, {**base, "prompt": [10 + i, 11, 12]}, gaps) for i in range(3)]
    stops = [c * 999 + "!" for c in "abcd"] if long_stops else None
    streams += [_stream_gaps(url, {**base, "prompt": [30 + i, 31], "stop": stops}, []) for i in range(4)]
    await asyncio.gather(*streams)
    return gaps


def test_long_stop_strings_do_not_slow_other_streams(server):
    asyncio.run(_streams_with(server.url, False))  # warm-up
    plain = statistics.median(asyncio.run(_streams_with(server.url, False)))
    with_stops = statistics.median(asyncio.run(_streams_with(server.url, True)))
    # A stop matcher that rescans the text or the stop strings would add milliseconds to every step.
    assert with_stops < 1.25 * plain + 0.002, (plain, with_stops)
    still_serving(server)


# -- fuzzing ----------------------------------------------------------------------------------------

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias", "logprobs", "top_logprobs", "stream", "stream_options", "user", "ignore_eos", "echo", "prompt_logprobs",
          "best_of", "suffix", "tools", "tool_choice", "response_format", "structured_outputs", "min_tokens", "stop_token_ids", "role", "content",
          "tokens", "add_special_tokens", "return_token_strs", "truncate_prompt_tokens", "skip_special_tokens",
          "continue_final_message", "add_generation_prompt", "return_token_ids", "return_tokens_as_token_ids",
          "allowed_token_ids", "bad_words"]


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return rng.choice([0, 1, -1, 2, 16, 511, 512, 2**31, 2**63, -(2**63), 2**64 - 1, rng.randint(-10**6, 10**6)])
    if kind == 1:
        return rng.choice([0.0, -0.0, 0.5, 1.0, 2.0, 1e308, -1e308, 5e-324, rng.uniform(-3, 3)])
    if kind == 2:
        return "".join(rng.choice("ab \n\\\"<|>é😀\x00\u2028") for _ in range(rng.randrange(0, 40)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return [rng.randrange(-5, 600) for _ in range(rng.randrange(0, 30))]
    if kind == 5:
        return rng.choice(["user", "assistant", "system", "tool", "wizard", "text", "json_object", "auto"])
    if kind == 6:
        return {"role": rng.choice(["user", "system", "x"]), "content": _value(rng, depth + 1)}
    if kind == 7:
        return rng.choice([{}, [], "", {"type": "text", "text": "hi"}])
    if kind in (8, 9):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(FIELDS): _value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _body(rng: random.Random) -> bytes:
    data = {rng.choice(FIELDS): _value(rng) for _ in range(rng.randrange(0, 8))}
    if rng.random() < 0.5:  # often close to valid, so the fuzzing reaches past schema validation
        data.setdefault("messages", [{"role": "user", "content": "hi"}])
        data.setdefault("prompt", [5, 6])
    if isinstance(data.get("max_tokens"), int) and rng.random() < 0.9:
        data["max_tokens"] = rng.randrange(1, 6)
    raw = json.dumps(data, allow_nan=True).encode()
    mutation = rng.randrange(10)
    if mutation == 0:
        return raw[: rng.randrange(0, len(raw) + 1)]  # truncated
    if mutation == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))  # noise
    return raw


def test_min_tokens_without_max_tokens_raises_the_default(tiny_model, tmp_path):
    """min_tokens above --max-tokens-default, max_tokens omitted: the output was cut to the default (a
    200 with fewer tokens than asked for); vLLM's default is the whole context."""
    srv = ServerProcess(tiny_model, "--max-model-len", "64", "--max-tokens-default", "4", log_dir=tmp_path)
    try:
        for extra, want in (({"min_tokens": 10}, 10), ({"min_tokens": 2}, 4), ({"min_tokens": 100}, 64 - 3)):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "temperature": 0, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == want, (extra, r.json()["usage"])
    finally:
        srv.stop()


def test_fuzzed_bodies_never_get_a_5xx(tiny_model, tmp_path):
    srv = ServerProcess(tiny_model, "--max-model-len", "64", "--max-tokens-default", "4", log_dir=tmp_path)
    rng = random.Random(20261123)
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + 90
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for i in range(400):
                if time.monotonic() > deadline:
                    break
                path = ("/v1/completions", "/v1/chat/completions", "/v1/completions", "/v1/chat/completions",
                        "/tokenize", "/detokenize")[i % 6]
                body = _body(rng)
                r = c.post(path, content=body, headers={"content-type": "application/json"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code < 500, (body[:300], r.text[:300])
        assert sum(statuses.values()) >= 100 and 200 in statuses and 400 in statuses, statuses
        still_serving(srv)
    finally:
        srv.stop()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "stop": 5}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": [5]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/completions", {"prompt": [[1, "a"]]}, "prompt"),
])
def test_a_refusal_names_the_clients_field_not_pydantics_union_branch(server, path, body, param):
    """`param` was `stop.str`, `messages.0.content.list[union[TextPart,RefusalPart]]`, `tool_choice.literal[...]`
    (helper-57): names of pydantic's own, which a client cannot map to what it sent."""
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":"), err


def test_stream_options_without_a_stream_are_refused_as_by_openai(server):
    """They were taken, usage included (helper-57); OpenAI and vLLM answer 400. Null, or with a stream, is fine."""
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                           "stream_options": None}).status_code == 200

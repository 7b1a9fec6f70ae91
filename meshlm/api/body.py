"""Reading a request body under limits: size (413), JSON syntax, nesting depth, integer size (400).

The body is read before it is parsed, and refused unread when its
Content-Length already exceeds the limit. JSON is parsed by msgspec (strict:
no NaN or Infinity, integers bounded), then walked once without recursion to
bound nesting and integer size, so no client value can raise RecursionError or
reach the engine as a 10,000-digit integer. Parsing runs off the event loop.
JSON sent as a string inside the body (a schema) is parsed the same way, within the same limits.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import msgspec
from starlette.requests import ClientDisconnect, Request

from meshlm.api.errors import APIError, bad_request
from meshlm.api.framing import CLOSE
from meshlm.config import CLIENT_TIMEOUT_SECONDS

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # ~4M tokens as text, ~2M as token ids: past any context we serve
MAX_JSON_DEPTH = 32  # the deepest OpenAI request (a tool's JSON schema) needs far less
INT_LIMIT = 2**64  # |integer| below this: seeds are u64, token ids far smaller


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # ServerConfig validates the flag
    max_depth: int = MAX_JSON_DEPTH
    stall_seconds: float = CLIENT_TIMEOUT_SECONDS  # longest silence within a body before 408


def too_large(limit: int) -> APIError:
    # The rest of the body is never read: the connection closes rather than wait --client-timeout for
    # a next request that the unread bytes would corrupt.
    return APIError(413, f"request body exceeds the limit of {limit} bytes (--max-request-bytes)",
                    code="request_too_large", headers=CLOSE)


MIN_BODY_RATE = 500  # bytes/s a body must average once it has taken the client timeout


async def read_body(request: Request, limit: int, stall_seconds: float) -> bytes:
    """The raw body; 413 as soon as it is known to exceed `limit` bytes, 408 if the client sends none of
    it for `stall_seconds` (a body half sent would otherwise hold its connection for ever), or sends it
    slower than MIN_BODY_RATE once it has taken that long."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":  # a compressed body would be read as bytes of invalid JSON
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                       code="unsupported_content_encoding")
    chunks, size = [], 0
    stream = request.stream()
    started = time.monotonic()
    try:
        while True:
            try:
                # A byte every few seconds re-arms the silence timer for ever: once the body has taken
                # stall_seconds, it must also have come at MIN_BODY_RATE on average (Apache's
                # mod_reqtimeout default), or a few dribbling clients hold the connections.
                waited = time.monotonic() - started
                if waited > stall_seconds and size < MIN_BODY_RATE * waited:
                    raise APIError(408, f"the client sent {size} bytes of the request body in {waited:.0f} s, "
                                   f"below {MIN_BODY_RATE} bytes/s (--client-timeout)", code="request_timeout",
                                   headers=CLOSE)
                chunk = await asyncio.wait_for(anext(stream), stall_seconds)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                raise APIError(408, f"the client sent nothing for {stall_seconds:g} s after {size} bytes of the "
                               "request body (--client-timeout)", code="request_timeout", headers=CLOSE) from None
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body was whole: an ordinary 400, not an unhandled error
        raise bad_request(f"the client closed the connection after {size} bytes of the request body") from None
    return b"".join(chunks)


def parse_json_sync(body: bytes, limits: BodyLimits) -> dict:
    """A JSON object within the limits; as heavy as the body is long: call it off the event loop."""
    data = _decode(body, "request body", limits.max_depth)
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    check_limits(data, limits.max_depth)
    return data


def parse_json_string(text: str, field: str, depth: int, limits: BodyLimits) -> object:
    """JSON a client sent as a string inside the body (a schema), held to the body's limits as if it had
    been sent as JSON in the string's place: `field` is that place's path, `depth` its level (the body's
    top is 1). Its size needs no check of its own: it came inside a body within the size limit. As heavy
    as parsing a body: call it off the event loop."""
    data = _decode(text, field, limits.max_depth, param=_top(field))
    check_limits(data, limits.max_depth, field, depth)
    return data


def _decode(raw: bytes | str, what: str, max_depth: int, param: str | None = None) -> object:
    try:
        return msgspec.json.decode(raw)
    except RecursionError:
        raise bad_request(f"{what} nests deeper than {max_depth} levels", param=param)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # msgspec refuses NaN/Infinity (not JSON) and integers it cannot represent. From 0.23 it also says
        # "Invalid UTF-8 encoded string" without where: Python's own decoder names the bytes.
        if isinstance(raw, bytes):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise _not_utf8(what, bad, param) from None
        raise bad_request(f"{what} is not valid JSON: {exc}", param=param)
    except UnicodeError as exc:  # msgspec before 0.23: invalid UTF-8 (surrogates too) inside a string
        raise _not_utf8(what, exc, param) from None


def _not_utf8(what: str, exc: UnicodeError, param: str | None) -> APIError:
    held = exc.object[exc.start:exc.end]  # type: ignore[attr-defined]  (every UnicodeError msgspec raises has them)
    return bad_request(f"{what} is not valid JSON (UTF-8): a string holds {held!r} ({exc.reason})",  # type: ignore[attr-defined]
                       param=param)


def check_limits(data: object, max_depth: int, path: str = "", depth: int = 1) -> None:
    """Bound nesting depth and integer size, iteratively (no recursion to exhaust). `data` sits at `path`,
    `depth` levels down in the body (the top by default)."""
    stack: list[tuple[object, int, str]] = [(data, depth, path)]
    while stack:
        value, depth, path = stack.pop()
        if depth > max_depth:
            raise bad_request(f"request body nests deeper than {max_depth} levels (at {path or 'the top'})",
                              param=_top(path))
        if isinstance(value, dict):
            stack.extend((v, depth + 1, f"{path}.{k}" if path else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            _check_list(value, depth, path, stack)
        elif type(value) is int and not -INT_LIMIT < value < INT_LIMIT:
            raise bad_request(f"{path or 'body'}: integer out of range (|value| must be below 2**64)",
                              param=_top(path))


def _top(path: str) -> str | None:
    """The request field a nested path starts at (what OpenAI's `param` names)."""
    return re.split(r"[.\[]", path, maxsplit=1)[0] or None


def _check_list(items: list, depth: int, path: str, stack: list) -> None:
    # A prompt of token ids can hold millions of ints: check a flat int list in C, not per element.
    if items and all(type(x) is int for x in items):
        if not (-INT_LIMIT < min(items) and max(items) < INT_LIMIT):
            raise bad_request(f"{path or 'body'}: integer out of range (|value| must be below 2**64)",
                              param=_top(path))
        return
    stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(items))

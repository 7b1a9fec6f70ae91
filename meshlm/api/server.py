"""The FastAPI app: routes only. Validation lives in schemas, translation in serving."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from meshlm import __version__
from meshlm.api.admission import AdmissionMiddleware
from meshlm.api.auth import APIKeyMiddleware
from meshlm.api.body import BodyLimits, parse_json_sync, read_body
from meshlm.api.errors import APIError, bad_request
from meshlm.api.framing import FramingMiddleware
from meshlm.api.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                TokenizeRequest)
from meshlm.api.response_store import ResponseStore, item_page
from meshlm.api.responses import ResponseRun, input_items
from meshlm.api.responses_request import ResponsesRequest, chat_request, named_field
from meshlm.api.serving import Serving, now
from meshlm.api.streaming import Completion, watch_disconnect
from meshlm.api.structured import request_grammar
from meshlm.api.tokenize import detokenize, tokenize
from meshlm.api.tools import keep_tool_markers, plan_tools

log = logging.getLogger(__name__)


def create_app(serving: Serving, health=None, limits: BodyLimits = BodyLimits(),
               allowed_origins: tuple[str, ...] = (), api_key: str | None = None) -> FastAPI:
    """`health()` returns None when healthy or a message naming what is wrong; `allowed_origins`: browser
    pages from these may call the API (CORS preflights answered, responses marked); `api_key`: what API
    routes want as their bearer token (api/auth.py)."""
    app = FastAPI(title="meshlm", docs_url=None, redoc_url=None)
    engine = serving.engine

    def count_rejected(status: int) -> None:
        engine.metrics.rejected.labels(status=str(status)).inc()

    if api_key is not None:  # added first: the CORS layer, outside it, answers preflights
        app.add_middleware(APIKeyMiddleware, key=api_key, rejected=count_rejected)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"], max_age=600)
    # A request admitted here is one a drain waits for (api/admission.py).
    app.add_middleware(AdmissionMiddleware, admit=engine.admit, release=engine.release,
                       stopping=lambda: engine.problem is not None, rejected=count_rejected)
    # Outermost (added last): a request framed twice is refused before anything reads it.
    app.add_middleware(FramingMiddleware, rejected=count_rejected)
    health = health or (lambda: engine.problem)
    store = ResponseStore()  # /v1/responses kept for previous_response_id and GET

    def rejected(error: APIError):
        count_rejected(error.status)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return rejected(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return rejected(_validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        # Starlette's headers too: a 405 says which methods the route takes (`Allow`, RFC 9110 requires it)
        return rejected(APIError(exc.status_code, str(exc.detail), type_="invalid_request_error",
                                 headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return rejected(APIError(500, f"internal error: {type(exc).__name__}", type_="server_error"))

    # HEAD too: load balancers' probes use it (its answer is GET's status, with no body).
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def _health():
        problem = health()
        if problem:
            return JSONResponse({"status": "unhealthy", "error": problem}, status_code=503)
        body = {"status": "ok", "model": serving.model_name}
        if engine.handoff is not None:  # a peer that is down costs latency, not health: prompts prefill here
            body["prefill_peers"] = engine.handoff.peer_status()
        return body

    @app.get("/metrics")
    async def _metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def _version():
        return {"version": __version__}

    created = now()  # when this server began serving the model: the same on every read of its card

    def card() -> dict:
        return {"id": serving.model_name, "object": "model", "created": created, "owned_by": "meshlm",
                "max_model_len": serving.max_model_len}

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")  # a path: Hugging Face names hold a slash
    async def _model(model: str):
        serving.check_model(model)
        return card()

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        req = await _parse(request, ChatCompletionRequest, limits)
        serving.check_model(req.model)
        tools = plan_tools(req, serving.tokenizer)
        req = keep_tool_markers(req, tools, serving.tokenizer)
        prompt = await serving.prompts.chat(req, tools)
        grammar = await request_grammar(serving.grammars, req, limits, tools)
        return await _respond(request, Completion(serving, req, [prompt], chat=True, grammar=grammar, tools=tools))

    @app.post("/v1/responses")
    async def _responses(request: Request):
        req = await _parse(request, ResponsesRequest, limits)
        serving.check_model(req.model)
        history, earlier = (), ()
        if req.previous_response_id is not None:
            previous = _stored(req.previous_response_id, "previous_response_id")
            history, earlier = previous.messages, previous.conversation_items()
        chat, conversation = await asyncio.to_thread(_as_chat, req, history)
        kept = None if req.store is False else store
        # Its input as items: a copy of the whole input, so off the loop's thread (as _as_chat), and before
        # any sequence is queued (an await after that could leave them running for nobody)
        items = [*earlier, *await asyncio.to_thread(input_items, req)] if kept is not None else []
        tools = plan_tools(chat, serving.tokenizer)
        chat = keep_tool_markers(chat, tools, serving.tokenizer)
        try:
            prompt = await serving.prompts.chat(chat, tools)
            grammar = await request_grammar(serving.grammars, chat, limits, tools)
            completion = Completion(serving, chat, [prompt], chat=True, grammar=grammar, tools=tools)
        except APIError as exc:  # the chat path names its messages; a response request has `input`
            if (exc.param or "").startswith("messages"):
                exc.param = "input"
            raise
        return await _respond(request, ResponseRun(req, completion, conversation, kept, items))

    def _stored(response_id: str, param: str | None = None):
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"No response with id {response_id[:64]!r}: it was not stored (store: false), "
                                "or it is gone (this server keeps responses in memory, the least recently used "
                                f"leaving first, and not across restarts)", param=param, code="response_not_found")
        return stored

    @app.get("/v1/responses/{response_id}")
    async def _get_response(response_id: str, request: Request):
        stored = _stored(response_id)
        if request.query_params.get("stream", "false").lower() != "false":  # OpenAI's client sends "true"
            # OpenAI streams a background response's events again; a stored JSON body instead made the
            # client's stream yield nothing, and its helper fail for want of response.completed
            raise bad_request("only background responses can be retrieved as a stream, and this server runs "
                              "none: retrieve it without stream", param="stream")
        return stored.body

    @app.get("/v1/responses/{response_id}/input_items")
    async def _input_items(response_id: str, request: Request):
        query = request.query_params
        limit = query.get("limit", "20")
        if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= 100):
            raise bad_request(f"limit must be an integer from 1 to 100, got {limit[:40]!r}", param="limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order[:40]!r}", param="order")
        after = query.get("after")
        try:
            return item_page(_stored(response_id).items, int(limit), order, after)
        except KeyError:
            raise bad_request(f"after: no input item of response {response_id[:64]!r} has the id "
                              f"{after[:64]!r}", param="after") from None

    @app.delete("/v1/responses/{response_id}")
    async def _delete_response(response_id: str):
        _stored(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def _cancel_response(response_id: str):
        _stored(response_id)
        raise bad_request("only background responses can be cancelled, and this server runs none")

    @app.post("/tokenize")
    async def _tokenize(request: Request):
        body = await read_body(request, limits.max_bytes, limits.stall_seconds)
        data = await asyncio.to_thread(parse_json_sync, body, limits)
        chat = isinstance(data, dict) and "messages" in data
        req = await asyncio.to_thread(_validated, TokenizeChatRequest if chat else TokenizeRequest, data)
        serving.check_model(req.model)
        return await tokenize(serving, req, plan_tools(req, serving.tokenizer) if chat else None)

    @app.post("/detokenize")
    async def _detokenize(request: Request):
        req = await _parse(request, DetokenizeRequest, limits)
        serving.check_model(req.model)
        return detokenize(serving, req)

    @app.post("/v1/completions")
    async def _completions(request: Request):
        req = await _parse(request, CompletionRequest, limits)
        serving.check_model(req.model)
        prompts = await serving.prompts.completion(req)
        grammar = await request_grammar(serving.grammars, req, limits)
        return await _respond(request, Completion(serving, req, prompts, chat=False, grammar=grammar))

    return app


async def _parse(request: Request, model, limits: BodyLimits):
    """The body parsed and validated on a worker thread: a 16 MiB body of 200,000 messages takes the
    validator ~1 s, which on the event loop stalled every stream."""
    body = await read_body(request, limits.max_bytes, limits.stall_seconds)
    header_id = request.headers.get("x-request-id")
    return await asyncio.to_thread(lambda: _validated(model, parse_json_sync(body, limits), header_id))


def _as_chat(req: ResponsesRequest, history: tuple[dict, ...]):
    """The chat request a response amounts to, and its conversation (on a worker thread: as heavy as
    validating a body)."""
    try:
        return chat_request(req, history)
    except ValidationError as exc:  # what the chat path refuses, named by its fields
        raise _validation_error(exc.errors())
    except ValueError as exc:
        raise bad_request(str(exc), param=named_field(req, str(exc)))


def _validated(model, data, header_id: str | None = None):
    """`header_id`: an `X-Request-Id` header, which names the response over a body's `request_id` (vLLM)."""
    if header_id is not None and isinstance(data, dict) and "request_id" in model.model_fields:
        data = {**data, "request_id": header_id}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors())


def _validation_error(errors: list) -> APIError:
    first = errors[0] if errors else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body" and not _union_branch(x))
    return bad_request(f"{loc or 'body'}: {first.get('msg', 'invalid request')}", param=loc or None)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _union_branch(part: object) -> bool:
    """pydantic's name for the branch of a union that failed ("str", "list[str]", "literal['auto']",
    "NamedToolChoice"), which it puts in an error's location: not a field the client sent (the client's
    `param` was `stop.str`). The request models' own fields are snake_case."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or part[:1].isupper())


async def _respond(request: Request, completion: Completion | ResponseRun):
    # The answer's id, which OpenAI's client reads as its `_request_id` (OpenAI sends one; vLLM with
    # --enable-request-id-headers)
    named = {"X-Request-Id": completion.id}
    if completion.req.stream:
        return StreamingResponse(completion.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **named})
    task = asyncio.ensure_future(completion.whole())
    watcher = asyncio.ensure_future(watch_disconnect(request, completion, task))
    try:
        return Response(await task, media_type="application/json", headers=named)
    except APIError as exc:  # its sequences ran and ended with an error: counted as requests, not rejections
        response = exc.response()
        response.headers.update(named)
        return response
    except asyncio.CancelledError:
        completion.close()
        return Response(status_code=499)
    finally:
        watcher.cancel()

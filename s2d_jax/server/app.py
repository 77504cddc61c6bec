"""The OpenAI-compatible HTTP server (FastAPI on uvicorn, what vLLM serves with):
/v1/chat/completions and /v1/completions (SSE-streamed or not), /v1/models, /health.

Handlers run on uvicorn's event loop and never touch the device: each reads its body in
chunks up to max_body_bytes (body.py; 413 past it), parses it on a worker thread (JSON,
the field checks, the chat template and the tokenizer: openai_api.py), so that no body
holds up /health or the other clients, submits a Request to the Worker (the one thread
owning the slot engine) and waits on an asyncio queue that the job's sink fills from the
worker's thread. A full wait list answers 429 with Retry-After; a client that disconnects
(while it sends, waits, or reads its stream) cancels its job, which frees its slot at the
next chunk boundary, and costs one log line. Every error, whatever raised it, leaves in
OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from s2d_jax.errors import S2DError
from s2d_jax.server import body as bodies
from s2d_jax.server import openai_api as oa
from s2d_jax.server.worker import QueueFull, Worker

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # what a 429 asks the client to wait
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed handler checks its client
GONE = 499  # nginx's status for a client that left: what the access log shows for it


def _error(e: oa.ApiError, headers=None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _client(http: HttpRequest) -> str:
    return f"{http.client.host}:{http.client.port}" if http.client else "?"


def _left(http: HttpRequest, when: str) -> Response:
    """A client that disconnected: one log line (not a traceback), no answer to send."""
    log.info("client %s disconnected %s; its request was dropped", _client(http), when)
    return Response(status_code=GONE)


def make_app(worker: Worker, *, model: str, tokenizer, template: str,
             default_max_tokens: int = 128,
             max_body_bytes: int = bodies.DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app serving `worker`'s engine under the model name `model`; prompts rendered in
    `template` (resolved: auto, vicuna or none) with `tokenizer`; bodies past
    `max_body_bytes` answered 413."""
    app = FastAPI(title="s2d-jax", docs_url=None, redoc_url=None)
    _answer_errors_as_openai(app)
    engine = worker.engine
    method = engine.spec.method

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model, "method": method, **worker.status()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model, "object": "model", "created": 0, "owned_by": "s2d-jax",
            "max_model_len": engine.max_len}]}

    def parse(raw: bytes, chat: bool):  # on a worker thread: the CPU work of a request
        return oa.parse(bodies.decode(raw), chat, model, tokenizer, template, engine.max_len,
                        default_max_tokens)

    async def complete(http: HttpRequest, chat: bool):
        try:
            raw = await bodies.read(http, max_body_bytes)
            request, opts = await run_in_threadpool(parse, raw, chat)
        except oa.ApiError as e:  # a 413 leaves the body unread: the connection can't go on
            return _error(e, headers={"Connection": "close"} if e.status == 413 else None)
        except ClientDisconnect:
            return _left(http, "while sending its request")
        submitted = _submit(worker, request)
        if not isinstance(submitted, tuple):
            return submitted  # refused: its error response
        job, events = submitted
        reply = oa.Reply(chat, model, method)
        if opts["stream"]:
            return StreamingResponse(_stream(http, job, events, reply, opts["include_usage"]),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(http, job, events, reply)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await complete(http, True)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await complete(http, False)

    return app


def _submit(worker: Worker, request):
    """(job, the queue its events arrive on) for `request`, or the error response of a full
    wait list (429) or a request the engine refuses (400). Call on the event loop."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def sink(event):  # on the worker's thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop is gone (shutting down)
            pass
    try:
        return worker.submit(request, sink), events
    except QueueFull as e:
        return _error(oa.ApiError(429, str(e), code="queue_full", kind="rate_limit_error"),
                      headers={"Retry-After": str(RETRY_AFTER_S)})
    except S2DError as e:
        return _error(oa.ApiError(400, str(e), param="prompt"))


def _answer_errors_as_openai(app: FastAPI) -> None:
    """Every error, also FastAPI's own (an unknown path, a body that is not JSON) and an
    unexpected one, answered as an OpenAI error object."""

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(oa.ApiError(e.status_code, str(e.detail), kind=kind))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        return _error(oa.ApiError(400, str(e)))

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        log.exception("unexpected error")
        return _error(oa.ApiError(500, f"internal error ({type(e).__name__})",
                                  kind="server_error"))


async def _whole(http: HttpRequest, job, events: asyncio.Queue, reply: oa.Reply):
    """Wait for the job's end (cancelling it if the client leaves) -> the response."""
    while True:
        try:
            event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                job.cancel()
                return _left(http, "before its answer was ready")
            continue
        if event["type"] == "done":
            return JSONResponse(reply.full(event["result"]))
        if event["type"] == "error":
            return _error(oa.ApiError(500, f"the engine failed: {event['message']}",
                                      kind="server_error"))


async def _stream(http: HttpRequest, job, events: asyncio.Queue, reply: oa.Reply,
                  include_usage: bool):
    """SSE chunks as the text grows; a client that stops reading cancels the job (the
    response task is cancelled: `finally`)."""
    first = True
    try:
        if reply.chat:  # OpenAI's first chat chunk: the role
            yield oa.sse(reply.chunk("", first=True))
            first = False
        while True:
            event = await events.get()
            if event["type"] == "text":
                yield oa.sse(reply.chunk(event["text"], first=first))
                first = False
            elif event["type"] == "done":
                result = event["result"]
                yield oa.sse(reply.chunk("", finish=result.finish_reason))
                if include_usage:
                    yield oa.sse(reply.usage_chunk(result))
                yield oa.sse("[DONE]")
                return
            else:  # the engine failed this request's chunk
                yield oa.sse(oa.ApiError(500, f"the engine failed: {event['message']}",
                                         kind="server_error").body())
                return
    finally:
        if not job.finished.is_set():
            job.cancel()
            _left(http, "during its streamed answer")

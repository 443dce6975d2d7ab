"""The OpenAI-compatible HTTP API (FastAPI). Framing only: the work is in handler.py.

Every error, FastAPI's own included, is answered with OpenAI's error JSON, and 400 rather than
FastAPI's 422 for an invalid body, because that is what OpenAI clients expect. With a tenants file,
every route but /health (and its alias /ping) and /version checks the API key first (auth.py), as one app-wide dependency.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import meshserve
from meshserve.shared.openai_protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from meshserve.shared.openai_responses import ResponsesRequest

from . import adapters, openapi, responses, tokenize
from .auth import AUTH_HEADER
from .handler import VARIANT_HEADER, VERSION_HEADER, Gateway, Generation, Kind

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code: nobody reads it, but logs should not say 200
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(body: dict, status_code: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status_code, media_type="application/json")


def error_response(e: OpenAIError) -> Response:
    r = json_response(e.body(), e.status_code)
    r.headers.update(e.headers)
    return r


def sse(data: dict | str) -> bytes:
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"data: " + payload + b"\n\n"


def internal_error() -> OpenAIError:
    return OpenAIError("internal server error", 500, type="server_error")


async def _sse_stream(gen: Generation) -> AsyncIterator[bytes]:
    """An error after the response started can only be told in the stream: an error event, then [DONE]."""
    try:
        async for chunk in gen.chunks():
            yield sse(chunk)
    except OpenAIError as e:
        yield sse(e.body())
    except Exception:  # noqa: BLE001
        log.exception("request %s failed while streaming", gen.request.request_id)
        yield sse(internal_error().body())
    finally:
        gen.close()
    yield sse("[DONE]")


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body is read already, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _responses_sse(call: responses.ResponsesCall) -> AsyncIterator[bytes]:
    """The Responses API's events: `event: <type>` and `data: <json>`; no [DONE] (OpenAI sends none)."""
    try:
        async for event in call.events():
            yield b"event: " + event["type"].encode() + b"\n" + sse(event)
    except Exception:  # noqa: BLE001
        log.exception("request %s failed while streaming", call.gen.request.request_id)
        yield b"event: error\n" + sse({"type": "error", "code": "server_error", "message": "internal server error",
                                        "param": None, "sequence_number": -1})
    finally:
        call.close()


async def _unless_disconnected(request: Request, coro):
    """The coroutine's result, or None when the client hangs up first. The coroutine is then
    cancelled and awaited: its cleanup (aborting the request) runs, and its result is never read
    while the cancellation is still under way."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})  # never raises; the outcome is read below
    if work.cancelled():
        return None
    return work.result()


async def _read_body(request: Request, limit: int, too_large) -> bytes:
    """The body, read no further than `limit` bytes (a declared Content-Length over it is refused
    before reading)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size)
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_body(request: Request, gw: Gateway):
    return gw.decode_body(await _read_body(request, gw.limits.max_body_bytes, gw.body_too_large))


def _model_headers(gen: Generation) -> dict[str, str]:
    """Which entry of its model served a request: a canary's version, a variant's name."""
    spec = gen.prepared.model.spec
    return {h: v for h, v in ((VERSION_HEADER, spec.version), (VARIANT_HEADER, spec.variant)) if v is not None}


REQUEST_ID_HEADER = "X-Request-Id"  # in: names the response (as `request_id`); out: the id it ran under


def create_app(gw: Gateway) -> FastAPI:
    async def authenticate(request: Request) -> None:
        """The API key, before anything else; the tenant is left in request.state.tenant."""
        path, header = request.url.path, request.headers.get(AUTH_HEADER)
        if path in ("/health", "/ping", "/version"):
            return
        if path == "/metrics":
            gw.auth.check_metrics(header)
            return
        request.state.tenant = gw.authenticate(header)

    app = FastAPI(title="meshserve gateway", version=meshserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", dependencies=[Depends(authenticate)],
                  description="OpenAI-compatible API of a meshserve mesh; docs/openai-api.md lists the fields.")

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        param = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or None
        return error_response(OpenAIError(f"{param + ': ' if param else ''}{err.get('msg', 'invalid request')}",
                                          param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(OpenAIError(str(e.detail), e.status_code, code=code))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(internal_error())

    async def generate(request: Request, kind: Kind) -> Response:
        body = await _json_body(request, gw)
        asked_id = request.headers.get(REQUEST_ID_HEADER)
        if asked_id and isinstance(body, dict) and body.get("request_id") is None:
            body = {**body, "request_id": asked_id}  # a proxy's id names the response, as vLLM takes it
        # (it may wait for a starting mesh: the client may leave meanwhile)
        gen = await _unless_disconnected(request, gw.submit(kind, body, getattr(request.state, "tenant", None)))
        if gen is None:
            return Response(status_code=CLIENT_CLOSED)
        extra = _model_headers(gen) | {REQUEST_ID_HEADER: gen.prepared.request.request_id or gen.request.request_id}
        if gen.stream:
            return StreamingResponse(_sse_stream(gen), media_type="text/event-stream", headers=SSE_HEADERS | extra)
        try:
            result = await _unless_disconnected(request, gen.body())
        finally:
            gen.close()
        if result is None:
            return Response(status_code=CLIENT_CLOSED)
        response = json_response(result)
        response.headers.update(extra)
        return response

    @app.post("/v1/completions", responses=openapi.responses(openapi.Completion, openapi.CompletionChunk,
                                                             ", then `data: [DONE]`"))
    async def completions(request: Request):
        return await generate(request, "completions")

    @app.post("/v1/chat/completions", responses=openapi.responses(openapi.ChatCompletion,
                                                                  openapi.ChatCompletionChunk, ", then `data: [DONE]`"))
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/responses", responses=openapi.responses(openapi.ResponseObject, openapi.ResponseEvent,
                                                           " (each preceded by `event: <its type>`)"))
    async def create_response(request: Request):
        """The Responses API, generated by the chat completions path."""
        req, chat = responses.prepare(await _json_body(request, gw))
        call = await _unless_disconnected(request, responses.submit(gw, req, chat,
                                                                    getattr(request.state, "tenant", None)))
        if call is None:
            return Response(status_code=CLIENT_CLOSED)
        extra = _model_headers(call.gen)
        if call.stream:
            return StreamingResponse(_responses_sse(call), media_type="text/event-stream", headers=SSE_HEADERS | extra)
        try:
            result = await _unless_disconnected(request, call.body())
        finally:
            call.close()
        if result is None:
            return Response(status_code=CLIENT_CLOSED)
        response = json_response(result)
        response.headers.update(extra)
        return response

    @app.post("/tokenize", responses=openapi.responses(tokenize.TokenizeResponse, errors=(400, 401, 404)))
    async def tokenize_(request: Request):
        """A prompt, or messages through the chat template, as token ids (vLLM's API)."""
        return json_response(tokenize.tokenize(gw, await _json_body(request, gw)))

    @app.post("/detokenize", responses=openapi.responses(tokenize.DetokenizeResponse, errors=(400, 401, 404)))
    async def detokenize_(request: Request):
        """Token ids as text, special tokens kept (vLLM's API)."""
        return json_response(tokenize.detokenize(gw, await _json_body(request, gw)))

    @app.get("/v1/models", responses={200: {"model": openapi.ModelList, "description": "the served models"}})
    async def models():
        return json_response(await gw.models())

    @app.get("/v1/models/{model:path}", responses={200: {"model": openapi.ModelCard, "description": "one model"},
                                                   404: {"model": openapi.ErrorBody, "description": "not served"}})
    async def model(model: str):
        """OpenAI's retrieve: the card /v1/models lists for this served name, alias or LoRA adapter."""
        return json_response(await gw.model(model))

    @app.post("/admin/models/reload", responses={200: {"description": "the models now served"},
                                                 400: {"model": openapi.ErrorBody, "description": "a bad manifest"}})
    async def reload_models():
        """Re-reads the model manifest (--models) here, in the scheduler and the model-loaders, as SIGHUP
        does (docs/models.md)."""
        return json_response(await gw.reload_models())

    @app.post("/v1/load_lora_adapter", responses={
        200: {"description": "the adapter is served under lora_name"},
        400: {"model": openapi.ErrorBody, "description": "an adapter that does not fit its base, or a name in use"},
        404: {"model": openapi.ErrorBody, "description": "base_model names no served model"}})
    async def load_lora_adapter(request: Request):
        """Serves a LoRA adapter (a PEFT directory) under its own name on its base model's workers, as
        vLLM's endpoint of that name does (docs/models.md, "LoRA adapters")."""
        return json_response(await gw.load_lora_adapter(await _json_body(request, gw)))

    @app.post("/v1/unload_lora_adapter", responses={
        200: {"description": "the adapter is no longer served"},
        400: {"model": openapi.ErrorBody, "description": "an adapter the manifest lists"},
        404: {"model": openapi.ErrorBody, "description": "no such adapter"}})
    async def unload_lora_adapter(request: Request):
        """Stops serving a LoRA adapter loaded at run time (requests already running finish)."""
        return json_response(await gw.unload_lora_adapter(await _json_body(request, gw)))

    @app.get("/version", responses={200: {"description": "this server's version, as vLLM's /version"}})
    async def version():
        return json_response({"version": meshserve.__version__})

    @app.get("/ping", responses={200: {"model": openapi.Health, "description": "as /health (vLLM's and SageMaker's name)"},
                                 503: {"model": openapi.ErrorBody, "description": "no scheduler, or no worker yet"}})
    @app.get("/health", responses={200: {"model": openapi.Health, "description": "a request can be served"},
                                   503: {"model": openapi.ErrorBody, "description": "no scheduler, or no worker yet"}})
    async def health():
        status = await gw.scheduler_status()
        if status is None:
            return error_response(OpenAIError("the scheduler does not answer", 503, type="server_error"))
        if not status.get("ready"):
            return error_response(OpenAIError("no worker is ready yet", 503, type="server_error"))
        if gw.auth.enabled:  # /health needs no key: it names no tenant
            status = {k: v for k, v in status.items() if k != "admission"}
        return json_response({"status": "ok", "scheduler": status})

    @app.get("/metrics", responses={200: {"description": "Prometheus metrics (text exposition format)",
                                          "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        gw.metrics.refresh(await gw.scheduler_status())
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    openapi.install(app, {
        "/v1/completions": [CompletionRequest], "/v1/chat/completions": [ChatCompletionRequest],
        "/v1/responses": [ResponsesRequest],
        "/tokenize": [tokenize.TokenizeCompletionRequest, tokenize.TokenizeChatRequest],
        "/detokenize": [tokenize.DetokenizeRequest],
        "/v1/load_lora_adapter": [adapters.LoadLoRAAdapterRequest],
        "/v1/unload_lora_adapter": [adapters.UnloadLoRAAdapterRequest]},
        extra_models=[openapi.CompletionChunk, openapi.ChatCompletionChunk, openapi.ResponseEvent])
    return app

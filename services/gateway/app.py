"""The OpenAI-compatible HTTP API (FastAPI). Framing only: the work is in handler.py.

Every error, FastAPI's own included, is answered with OpenAI's error JSON, and 400 rather than
FastAPI's 422 for an invalid body, because that is what OpenAI clients expect. With a tenants file,
every route but /health checks the API key first (auth.py), as one app-wide dependency.
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

from meshserve.shared.openai_protocol import OpenAIError

from .auth import AUTH_HEADER
from .handler import Gateway, Generation, Kind

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code: nobody reads it, but logs should not say 200


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


async def _body_unless_disconnected(request: Request, gen: Generation) -> dict | None:
    """The response body, or None when the client left first (then the request is aborted)."""
    work = asyncio.ensure_future(gen.body())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        return None
    return work.result()


def create_app(gw: Gateway) -> FastAPI:
    async def authenticate(request: Request) -> None:
        """The API key, before anything else; the tenant is left in request.state.tenant."""
        path, header = request.url.path, request.headers.get(AUTH_HEADER)
        if path == "/health":
            return
        if path == "/metrics":
            gw.auth.check_metrics(header)
            return
        request.state.tenant = gw.authenticate(header)

    app = FastAPI(title="meshserve gateway", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(authenticate)])

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
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise OpenAIError(f"the request body is not valid JSON: {e}") from None
        gen = await gw.submit(kind, body, getattr(request.state, "tenant", None))
        if gen.stream:
            return StreamingResponse(_sse_stream(gen), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            result = await _body_unless_disconnected(request, gen)
        finally:
            gen.close()
        return json_response(result) if result is not None else Response(status_code=CLIENT_CLOSED)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.get("/v1/models")
    async def models():
        return json_response(gw.models())

    @app.get("/health")
    async def health():
        status = await gw.scheduler_status()
        if status is None:
            return error_response(OpenAIError("the scheduler does not answer", 503, type="server_error"))
        if not status.get("ready"):
            return error_response(OpenAIError("no worker is ready yet", 503, type="server_error"))
        if gw.auth.enabled:  # /health needs no key: it names no tenant
            status = {k: v for k, v in status.items() if k != "admission"}
        return json_response({"status": "ok", "scheduler": status})

    @app.get("/metrics")
    async def metrics():
        gw.metrics.refresh(await gw.scheduler_status())
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    return app

"""Request handling shared by the HTTP and NATS front ends: validate, tokenize, submit, then turn the
token stream into an OpenAI response (one body, or streaming chunks). The front ends only frame it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Literal

import orjson

from meshserve.shared import telemetry
from meshserve.shared.bus import Bus
from meshserve.shared.limits import LimitError, check_context_length, check_token_ids
from meshserve.shared.openai_protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, chat_chunk,
                                              chat_logprobs, chat_response, completion_chunk, completion_logprobs,
                                              completion_response, parse_request, usage, usage_chunk)
from meshserve.shared.schemas import Abort, GenerateRequest, Logprob, Message, Sampling, TokenChunk, Usage
from meshserve.shared.tenants import Tenant
from meshserve.shared.tokenizer import IncrementalDetokenizer, Tokenizer

from .auth import Auth, rejection_reason
from .metrics import GatewayMetrics
from .request_log import RequestLog
from .streams import NotSubmitted, RequestStream, TokenStreams, submit

log = logging.getLogger(__name__)

Kind = Literal["completions", "chat"]
STATUS_TIMEOUT = 1.0
READY_POLL = 0.25  # how often a request waiting for the mesh to start asks the scheduler
RETRY_AFTER_S = 5  # the Retry-After of a 503 for a mesh that is not ready


@dataclass
class Prepared:
    kind: Kind
    request: CompletionRequest | ChatCompletionRequest
    prompt_token_ids: list[int]
    sampling: Sampling
    stop: list[str]  # stop strings: matched here, on the text; never sent
    priority: str
    tenant: Tenant | None = None


@dataclass
class Delta:
    """What one in-order chunk adds to the response."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprob | None] | None
    finish_reason: str | None


def _limit_error(e: LimitError, param: str | None = None) -> OpenAIError:
    return OpenAIError(str(e), param=param or e.param, code=e.code)


class Gateway:
    """What both front ends call; holds the connection, the tokenizer and the token streams."""

    def __init__(self, bus: Bus, tokenizer: Tokenizer, served_model_name: str, streams: TokenStreams,
                 metrics: GatewayMetrics, max_model_len: int = 8192, stream_timeout: float = 300.0,
                 request_log: RequestLog | None = None, auth: Auth | None = None, ready_timeout: float = 120.0):
        self.bus, self.tokenizer, self.served_model_name = bus, tokenizer, served_model_name
        self.auth = auth or Auth(None)  # API keys and classes (the tenants file); none: open
        self.streams, self.metrics = streams, metrics
        self.request_log = request_log  # a line per ended request (request_log.py); None: off
        self.max_model_len, self.stream_timeout = max_model_len, stream_timeout
        self.ready_timeout = ready_timeout  # how long a request waits for a starting mesh
        self.created = int(time.time())
        self._background: set[asyncio.Task] = set()

    # -- keys, validation and tokenization

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an Authorization header value (None: no tenants file); raises 401."""
        try:
            return self.auth.tenant(authorization)
        except OpenAIError as e:
            self.metrics.tenant_rejected(None, rejection_reason(e))
            raise

    def prepare(self, kind: Kind, body, tenant: Tenant | None = None) -> Prepared:
        """Raises OpenAIError(4xx) for anything wrong with the request."""
        req = parse_request(kind, body)
        self.check_model(req.model)
        priority = self.auth.request_class(body.get("priority"), tenant)
        if isinstance(req, ChatCompletionRequest):
            prompt = self.chat_prompt_ids(req)
            self._check_length(prompt, "messages")
            sampling = req.to_sampling(default_max=self.max_model_len - len(prompt))
        else:
            if isinstance(req.prompt, list):
                prompt = list(req.prompt)
                try:
                    check_token_ids(prompt, self.tokenizer.vocab_size)
                except LimitError as e:
                    raise _limit_error(e) from None
            else:
                prompt = self.tokenizer.encode(req.prompt)
            if not prompt:
                raise OpenAIError("the prompt encodes to no tokens", param="prompt")
            self._check_length(prompt, "prompt")
            sampling = req.to_sampling()
        try:
            sampling.check()
        except LimitError as e:
            raise OpenAIError(str(e)) from None
        return Prepared(kind, req, prompt, sampling, req.stop_strings(), priority, tenant)

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is the served name (or not given)."""
        if model not in (None, self.served_model_name):
            raise OpenAIError(f"the model {model!r} does not exist; this server serves "
                              f"{self.served_model_name!r}", 404, param="model", code="model_not_found")

    def chat_prompt_ids(self, req: ChatCompletionRequest, add_special_tokens: bool = False) -> list[int]:
        """The prompt of a chat request: its messages through the chat template, tokenized (what
        /tokenize answers for messages, so both must come from here)."""
        try:
            text = self.tokenizer.apply_chat_template(req.template_messages(),
                                                      add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template that raises is the caller's doing
            raise OpenAIError(f"could not apply the chat template: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_length(self, prompt: list[int], param: str) -> None:
        """The prompt alone: the scheduler checks with max_tokens against the workers' context
        (this gateway's --max-model-len may differ); this keeps a chat's default max_tokens positive."""
        try:
            check_context_length(len(prompt), None, self.max_model_len, param)
        except LimitError as e:
            raise _limit_error(e) from None

    # -- submission

    async def submit(self, kind: Kind, body, tenant: Tenant | None = None) -> "Generation":
        """Validates and submits (as `tenant`, from `authenticate`); raises OpenAIError before
        anything is sent to the client. The caller must `close()` the returned Generation."""
        came = time.time()
        try:
            p = self.prepare(kind, body, tenant)
        except OpenAIError as e:
            self._log_rejected(kind, body, came, e, tenant=tenant)
            self.metrics.tenant_rejected(tenant, rejection_reason(e))
            raise
        arrival = time.time()
        rid = uuid.uuid4().hex
        span = telemetry.start("gateway.request", None, request_id=rid, model=self.served_model_name,
                               prompt_tokens=len(p.prompt_token_ids))
        request = GenerateRequest(
            request_id=rid, model=self.served_model_name, prompt_token_ids=p.prompt_token_ids,
            sampling=p.sampling, priority=p.priority, stream_subject=self.streams.subject,
            arrival_time=arrival, trace=telemetry.inject_span(span), tenant=tenant and tenant.name)
        stream = self.streams.open(request)
        try:
            await self._submit_when_ready(request, stream)
        except OpenAIError as e:
            self._log_rejected(kind, body, arrival, e, p, rid)
            self.metrics.tenant_rejected(tenant, rejection_reason(e))
            span.end()
            self.streams.close(request.request_id)
            if e.status_code == 503:  # the reply may be what got lost: make sure nothing runs
                self.abort(request.request_id)
            if rejection_reason(e) is None:  # not refused at admission: it may have been admitted
                self.settle(request, 0)
            raise
        except BaseException as e:
            self._log_rejected(kind, body, arrival, e, p, rid)
            span.end()
            self.streams.close(request.request_id)
            self.abort(request.request_id)
            self.settle(request, 0)
            raise
        self.metrics.queue.observe(time.time() - arrival)
        self.metrics.prompt_tokens.inc(len(p.prompt_token_ids))
        self.metrics.tenant_admitted(tenant, len(p.prompt_token_ids))
        gen = Generation(self, p, request, stream)
        gen.span = span
        return gen

    async def _submit_when_ready(self, request: GenerateRequest, stream: RequestStream) -> None:
        """Submits; while the mesh is still starting (no scheduler, or no worker yet) the request waits
        for it, up to `ready_timeout` seconds, then gets a 503 with Retry-After."""
        deadline = time.monotonic() + self.ready_timeout
        retried = False
        while True:
            try:
                stream.scheduler_id = (await submit(self.bus, request)).scheduler_id
                return
            except NotSubmitted as e:
                refused = e
            waited = await self._until_ready(deadline)
            if waited is None or (waited is False and retried):
                # Timed out, or the scheduler says it is ready and still refuses: not a start-up matter.
                why = f"; waited {self.ready_timeout:g} s for the mesh to start" if waited is None else ""
                raise OpenAIError(refused.message + why, 503, type="server_error",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
            retried = waited is False  # ready at once: one more try (it may have just become ready)

    async def _until_ready(self, deadline: float) -> bool | None:
        """Polls the scheduler until it says a request can be served: False when it already did at
        the first ask, True when it did after waiting, None when `deadline` passed first."""
        first = True
        while True:
            left = deadline - time.monotonic()
            status = await self.scheduler_status(timeout=max(0.05, min(STATUS_TIMEOUT, left)))
            if status is not None and status.get("ready"):
                return not first
            first = False
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await asyncio.sleep(min(READY_POLL, left))

    def _log_rejected(self, kind: Kind, body, arrival: float, e: BaseException, p: Prepared | None = None,
                      rid: str | None = None, tenant: Tenant | None = None) -> None:
        if self.request_log:
            tenant = p.tenant if p else tenant
            priority = p.priority if p else None
            if priority is None and tenant is not None and isinstance(body, dict) and "priority" not in body:
                priority = tenant.default_priority  # the class it would have had
            self.request_log.log_rejected(kind, body, self.served_model_name, arrival, e,
                                          p and len(p.prompt_token_ids), priority,
                                          p and p.sampling.max_tokens, rid, tenant=tenant and tenant.name)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._publish_soon(self.bus.subjects.abort, Abort(request_id=request_id, reason=reason))

    def settle(self, request: GenerateRequest, output_tokens: int) -> None:
        """Tells the scheduler a tenant's request ended, with the tokens it generated (admission.py)."""
        if request.tenant is not None:
            self._publish_soon(self.bus.subjects.usage, Usage(request_id=request.request_id,
                                                              output_tokens=output_tokens))

    def _publish_soon(self, subject: str, msg: Message) -> None:
        """Publishes from a task of its own: callers are often being cancelled."""
        async def publish():
            try:
                await self.bus.publish(subject, msg)
            except Exception as e:  # noqa: BLE001 - nothing more to do for a gone request
                log.warning("could not publish %s for %s: %s", type(msg).__name__,
                            getattr(msg, "request_id", "?"), e)

        task = asyncio.get_running_loop().create_task(publish())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- the scheduler's view

    async def scheduler_status(self, timeout: float = STATUS_TIMEOUT) -> dict | None:
        """The scheduler's status reply, or None when it does not answer in time."""
        try:
            msg = await self.bus.nc.request(self.bus.subjects.scheduler_status, b"{}", timeout=timeout)
            status = orjson.loads(msg.data)
            return status if isinstance(status, dict) else None
        except Exception:  # noqa: BLE001 - no responders, timeout, garbage: all mean "not ready"
            return None

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "meshserve",
            "root": self.served_model_name, "parent": None, "max_model_len": self.max_model_len}]}


class Generation:
    """One submitted request: reads its token stream and builds the response."""

    def __init__(self, gw: Gateway, prepared: Prepared, request: GenerateRequest, stream: RequestStream):
        self.gw, self.prepared, self.request, self._stream = gw, prepared, request, stream
        self.span = telemetry.NOOP_SPAN  # the gateway.request span, ended by close()
        self.kind = prepared.kind
        self.stream = prepared.request.stream
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{request.request_id}"
        self.created = int(time.time())
        self.model = gw.served_model_name
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob | None] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self._detok = IncrementalDetokenizer(gw.tokenizer, stop=prepared.stop)
        self._want_logprobs = prepared.sampling.logprobs is not None
        self._last_token_time: float | None = None
        self.first_token_time: float | None = None  # for the request log
        self.finish_time: float | None = None
        self.error: Exception | None = None  # what ended it, when it failed
        self._closed = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def close(self) -> None:
        """Stops listening; aborts the request unless it finished (client gone, error, timeout)."""
        if self._closed:
            return
        self._closed = True
        self.span.end()
        self.gw.streams.close(self.request.request_id)
        if not self.done:
            self.gw.abort(self.request.request_id)
        self.gw.settle(self.request, len(self.token_ids))
        if self.gw.request_log:
            self.gw.request_log.log_generation(self)

    async def deltas(self) -> AsyncIterator[Delta]:
        """The response as in-order deltas; the last one has a finish_reason. Raises OpenAIError."""
        try:
            while not self.done:
                try:
                    chunk = await self._stream.next(self.gw.stream_timeout)
                except asyncio.TimeoutError:
                    raise OpenAIError(f"no tokens arrived for {self.gw.stream_timeout:g} s; the request was "
                                      "aborted", 504, type="server_error", code="timeout") from None
                yield await self._apply(chunk)
        except Exception as e:
            self.error = e
            raise

    async def _apply(self, chunk: TokenChunk) -> Delta:
        now = time.time()
        if chunk.num_cached_tokens:
            self.num_cached_tokens = chunk.num_cached_tokens
        seen = len(self._detok.token_ids)
        text = self._detok.add(chunk.token_ids)
        n = len(self._detok.token_ids) - seen  # fewer than sent when a stop string ended the output
        token_ids, logprobs = chunk.token_ids[:n], None if chunk.logprobs is None else chunk.logprobs[:n]
        finish = None
        if self._detok.stopped:
            finish = "stop"
            if not chunk.finished:
                self.gw.abort(self.request.request_id, reason="stop")
        elif chunk.finished:
            text += self._detok.flush()
            finish = chunk.finish_reason or "stop"
        self.token_ids += token_ids
        if self._want_logprobs:
            self.logprobs += logprobs if logprobs is not None else [None] * len(token_ids)
        self.text += text
        m = self.gw.metrics
        if token_ids:
            if self._last_token_time is None:
                self.first_token_time = now
                m.ttft.observe(now - self.request.arrival_time)
            else:
                m.observe_itl(now - self._last_token_time, len(token_ids))
            self._last_token_time = now
            m.generation_tokens.inc(len(token_ids))
            m.tenant_generated(self.prepared.tenant, len(token_ids))
        if finish:
            self.finish_reason = finish
            self.finish_time = now
            m.e2e.observe(now - self.request.arrival_time)
            m.finished(finish)
        return Delta(text, token_ids, logprobs, finish)

    def usage(self) -> dict:
        return usage(len(self.request.prompt_token_ids), len(self.token_ids), self.num_cached_tokens)

    def _logprobs(self, token_ids: list[int], logprobs: list[Logprob | None] | None,
                  text_offset: int) -> dict | None:
        if not self._want_logprobs:
            return None
        lps = logprobs if logprobs is not None else [None] * len(token_ids)
        decode = self.gw.tokenizer.decode
        if self.kind == "chat":
            return chat_logprobs(token_ids, lps, decode)
        return completion_logprobs(token_ids, lps, decode, text_offset)

    async def body(self) -> dict:
        """The whole (non-streaming) response."""
        async for _ in self.deltas():
            pass
        lp = self._logprobs(self.token_ids, self.logprobs, 0)
        build = chat_response if self.kind == "chat" else completion_response
        return build(self.id, self.model, self.text, self.finish_reason, self.usage(), lp)

    async def chunks(self) -> AsyncIterator[dict]:
        """The streaming response, chunk by chunk (OpenAI's JSON); raises OpenAIError mid-stream."""
        include_usage = bool(self.prepared.request.stream_options and
                             self.prepared.request.stream_options.include_usage)
        first, offset = True, 0
        async for d in self.deltas():
            if not (d.text or d.finish_reason or (self._want_logprobs and d.token_ids)):
                continue  # nothing to say yet (a held-back stop-string prefix, half a character)
            lp = self._logprobs(d.token_ids, d.logprobs, offset)
            offset += len(d.text)
            if self.kind == "chat":
                delta = {"role": "assistant", "content": d.text} if first else (
                    {"content": d.text} if d.text else {})
                chunk = chat_chunk(self.id, self.model, self.created, delta, d.finish_reason, lp)
            else:
                chunk = completion_chunk(self.id, self.model, self.created, d.text, d.finish_reason, lp)
            if include_usage:
                chunk["usage"] = None  # as OpenAI: every chunk has the key, only the last one a value
            first = False
            yield chunk
        if include_usage:
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            yield usage_chunk(self.id, obj, self.model, self.created, self.usage())

"""Request handling shared by the HTTP and NATS front ends: validate, tokenize, submit, then turn the
token stream into an OpenAI response (one body, or streaming chunks). The front ends only frame it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Literal

import orjson

from meshserve.shared import telemetry
from meshserve.shared.bus import Bus
from meshserve.shared.limits import (LimitError, RequestLimits, check_context_length, check_token_ids,
                                     json_depth_exceeds)
from meshserve.shared import tool_calls
from meshserve.shared.openai_protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, chat_choice,
                                              chat_chunk, chat_logprobs, chat_response, completion_choice,
                                              completion_chunk, completion_logprobs, completion_response,
                                              join_logprobs, parse_request, prediction_usage, prompt_fields, usage,
                                              usage_chunk, validate_body)
from meshserve.shared.reasoning import ReasoningParser, reasoning_fields, reasoning_setup, split_answer
from meshserve.shared.schemas import Abort, GenerateRequest, Logprob, Message, Sampling, TokenChunk, Usage
from meshserve.shared.tenants import Tenant, cache_salt
from meshserve.shared.tokenizer import IncrementalDetokenizer, Tokenizer

from .adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .auth import Auth, rejection_reason
from .catalog import Catalog, ModelEntry
from .metrics import GatewayMetrics
from .request_log import RequestLog
from .streams import MaybeSubmitted, NotSubmitted, RequestStream, TokenStreams, submit

log = logging.getLogger(__name__)

Kind = Literal["completions", "chat"]
STATUS_TIMEOUT = 1.0
READY_POLL = 0.25  # how often a request waiting for the mesh to start asks the scheduler
RETRY_AFTER_S = 5  # the Retry-After of a 503 for a mesh that is not ready
STATE_ORDER = ("mapped", "loading", "host", "disk", "failed", "unknown")  # a name's versions: the hottest shows
VERSION_HEADER = "meshserve-model-version"  # the version of the model that served a request
VARIANT_HEADER = "meshserve-model-variant"  # the variant (manifest `variant`) that served it


@dataclass
class Prompt:
    token_ids: list[int]
    text: str = ""  # what echo returns (a completion's)


@dataclass
class Prepared:
    kind: Kind
    request: CompletionRequest | ChatCompletionRequest
    prompts: list[Prompt]  # one; or a completion's batch of prompts, n choices each
    sampling: Sampling
    priority: str
    tenant: Tenant | None = None
    model: ModelEntry | None = None  # the served model it runs on (catalog.py)
    reasoning_prompt: str | None = None  # a chat prompt's word on its reasoning (reasoning.prompt_state)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.model.tokenizer

    @property
    def n(self) -> int:
        return self.request.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def choice_sampling(self, index: int) -> Sampling:
        """Choice i's parameters: its own seeded stream, seed + i."""
        s = self.sampling
        return s if index == 0 or s.seed is None else s.model_copy(update={"seed": s.seed + index})


@dataclass
class Delta:
    """What one in-order chunk adds to the response."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprob | None] | None
    finish_reason: str | None
    index: int = 0  # the choice


def _limit_error(e: LimitError, param: str | None = None) -> OpenAIError:
    return OpenAIError(str(e), param=param or e.param, code=e.code)


class Gateway:
    """What both front ends call; holds the connection, the tokenizer and the token streams."""

    def __init__(self, bus: Bus, tokenizer: Tokenizer, served_model_name: str, streams: TokenStreams,
                 metrics: GatewayMetrics, stream_timeout: float = 300.0,
                 request_log: RequestLog | None = None, auth: Auth | None = None, ready_timeout: float = 120.0,
                 generation_defaults: dict | None = None, catalog: Catalog | None = None,
                 limits: RequestLimits | None = None):
        """generation_defaults: the model's own sampling defaults (models_repo.generation_defaults),
        for what a request leaves unset. catalog: the models served (a manifest); none: this one."""
        self.bus, self.tokenizer, self.served_model_name = bus, tokenizer, served_model_name
        self.generation_defaults = dict(generation_defaults or {})
        self.catalog = catalog or Catalog.single(served_model_name, tokenizer, generation_defaults)
        self.auth = auth or Auth(None)  # API keys and classes (the tenants file); none: open
        self.streams, self.metrics = streams, metrics
        self.request_log = request_log  # a line per ended request (request_log.py); None: off
        self.stream_timeout = stream_timeout
        self.ready_timeout = ready_timeout  # how long a request waits for a starting mesh
        self.limits = limits or RequestLimits()  # body size, messages, stops, logprobs, nesting
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

    def body_too_large(self, size: int) -> OpenAIError:
        return OpenAIError(f"the request body has {size} bytes; this server accepts at most "
                           f"{self.limits.max_body_bytes} (--max-body-bytes)", 413, code="request_too_large")

    def decode_body(self, data: bytes):
        """A request body as JSON, within the size and nesting limits; raises OpenAIError(413/400)."""
        if len(data) > self.limits.max_body_bytes:
            raise self.body_too_large(len(data))
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise OpenAIError(f"the request body is not valid JSON: {e}") from None
        if json_depth_exceeds(body, self.limits.max_json_depth):
            raise OpenAIError(f"the request body nests arrays and objects deeper than {self.limits.max_json_depth} "
                              "levels (--max-json-depth)", code="json_too_deep")
        return body

    def prepare(self, kind: Kind, body, tenant: Tenant | None = None) -> Prepared:
        """Raises OpenAIError(4xx) for anything wrong with the request."""
        named = body.get("model") if isinstance(body, dict) else None
        priority = self.auth.request_class(body.get("priority") if isinstance(body, dict) else None, tenant)
        model = self.catalog.entry(named if isinstance(named, str) else None, priority, tenant and tenant.name)
        tokenizer, state = model.tokenizer, None
        req = parse_request(kind, body, tokenizer.vocab_size, self.limits)
        chat = isinstance(req, ChatCompletionRequest)
        if chat:
            req.check_reasoning(model.reasoning_parser)
            ids = req.truncate(self.chat_prompt_ids(req, model=model))
            self._check_length(ids, None, model, "messages")  # so that the default max_tokens is positive
            sampling, state = reasoning_setup(model.reasoning_parser, tokenizer, ids, req.to_sampling(
                model.max_model_len - len(ids), tokenizer, model.generation_defaults))
            prompts = [Prompt(ids)]
        else:
            prompts = [self._completion_prompt(x, req, tokenizer) for x in req.prompts]
            sampling = req.to_sampling(tokenizer, model.generation_defaults)
        for x in prompts:
            self._check_length(x.token_ids, sampling.max_tokens, model, "messages" if chat else "prompt")
        try:
            sampling.check()
        except LimitError as e:
            raise OpenAIError(str(e), param=e.param) from None
        return Prepared(kind, req, prompts, sampling, priority, tenant, model, state)

    @staticmethod
    def _completion_prompt(prompt: str | list[int], req: CompletionRequest, tokenizer: Tokenizer) -> Prompt:
        """A completion's prompt (text or token ids) as the token ids computed, and the text echo
        returns (what was given, or the kept tokens' text when truncate_prompt_tokens cut it)."""
        if isinstance(prompt, list):
            try:
                check_token_ids(prompt, tokenizer.vocab_size)
            except LimitError as e:
                raise _limit_error(e) from None
        ids, text = req.prompt_ids(prompt, tokenizer)
        if not ids:
            raise OpenAIError("the prompt encodes to no tokens", param="prompt")
        return Prompt(ids, text)

    def check_model(self, model: str | None) -> ModelEntry:
        """The model a request names (its served name or an alias; none: the first of the manifest);
        404 for any other name."""
        return self.catalog.entry(model)

    def chat_prompt_ids(self, req: ChatCompletionRequest, add_special_tokens: bool | None = None,
                        model: ModelEntry | None = None) -> list[int]:
        """The prompt of a chat request: its messages through the chat template, tokenized (what
        /tokenize answers for messages, so both must come from here)."""
        tokenizer = (model or self.check_model(req.model)).tokenizer
        try:
            return req.prompt_ids(tokenizer, add_special_tokens)
        except OpenAIError:
            raise
        except Exception as e:  # noqa: BLE001 - a template that raises is the caller's doing
            raise OpenAIError(f"could not apply the chat template: {e}", param="messages") from None

    def _check_length(self, prompt: list[int], max_tokens: int | None, model: ModelEntry, param: str) -> None:
        """Against the model's context (max_tokens None: the prompt alone); the scheduler checks again
        against its workers' context, which a worker's --max-model-len may shorten."""
        try:
            check_context_length(len(prompt), max_tokens, model.max_model_len, param)
        except LimitError as e:
            raise _limit_error(e) from None

    # -- submission

    async def submit(self, kind: Kind, body, tenant: Tenant | None = None) -> "Generation":
        """Validates and submits (as `tenant`, from `authenticate`); n choices of each prompt are n
        requests: the first, then the others, which share its prompt (choice k * n + i is prompt k's
        i-th). Raises OpenAIError before anything is sent to the client. The caller must `close()`
        the returned Generation."""
        came = time.time()
        try:
            p = self.prepare(kind, body, tenant)
        except OpenAIError as e:
            self._log_rejected(kind, body, came, e, tenant=tenant)
            self.metrics.tenant_rejected(tenant, rejection_reason(e))
            raise
        arrival = time.time()
        rid = uuid.uuid4().hex
        span = telemetry.start("gateway.request", None, request_id=rid, model=p.model.id,
                               model_version=p.model.spec.version, model_variant=p.model.spec.variant,
                               lora=p.model.lora and p.model.lora.name,
                               prompt_tokens=p.num_prompt_tokens, priority=p.priority)
        trace = telemetry.inject_span(span)
        ids = [rid if j == 0 else f"{rid}-{j}" for j in range(len(p.prompts) * p.n)]
        requests = [GenerateRequest(
            request_id=ids[k * p.n + i], model=p.model.id, prompt_token_ids=prompt.token_ids,
            sampling=p.choice_sampling(i), priority=p.priority, stream_subject=self.streams.subject,
            arrival_time=arrival, trace=trace, tenant=tenant and tenant.name,
            after=None if i == 0 else ids[k * p.n], lora=p.model.lora,
            cache_salt=cache_salt(tenant, p.request.cache_salt))
            for k, prompt in enumerate(p.prompts) for i in range(p.n)]
        streams = [self.streams.open(r) for r in requests]
        try:
            await self._submit_when_ready(streams[0])
            # the other prompts' first choices, then the rest: the scheduler then knows where their first went
            firsts = [s for j, s in enumerate(streams) if j and j % p.n == 0]
            others = [s for j, s in enumerate(streams) if j % p.n]
            for group in (firsts, others):
                await asyncio.gather(*(self._submit_when_ready(s) for s in group))
        except BaseException as e:
            self._log_rejected(kind, body, arrival, e, p, rid)
            if isinstance(e, OpenAIError):
                self.metrics.tenant_rejected(tenant, rejection_reason(e))
            span.end()
            lost = not isinstance(e, OpenAIError) or e.status_code == 503  # the reply may be what got lost
            admitted = not isinstance(e, OpenAIError) or rejection_reason(e) is None
            for r in requests:
                self.streams.close(r.request_id)
                if lost or len(requests) > 1:  # make sure nothing runs (the first may have been taken)
                    self.abort(r.request_id)
                if admitted or len(requests) > 1:  # not refused at admission: it may have been admitted
                    self.settle(r, 0)
            raise
        gen = Generation(self, p, requests, streams)
        gen.span = span
        gen.metrics.queue.observe(time.time() - arrival)
        gen.metrics.prompt_tokens.inc(p.num_prompt_tokens)
        gen.metrics.tenant_admitted(tenant, p.num_prompt_tokens)
        return gen

    async def _submit_when_ready(self, stream: RequestStream) -> None:
        """Submits; while the mesh is still starting (no scheduler, or no worker yet) the request waits
        for it, up to `ready_timeout` seconds, then gets a 503 with Retry-After. A submission that got
        no answer (the scheduler or the nats-server died with it) waits for the mesh the same way
        and goes again as a new attempt, the old one aborted."""
        deadline = time.monotonic() + self.ready_timeout
        retried = False
        while True:
            try:
                stream.scheduler_id = (await submit(self.bus, stream.request)).scheduler_id
                return
            except NotSubmitted as e:
                refused = e
            except MaybeSubmitted as e:
                refused = e
                abort = stream.supersede()
                log.warning("request %s: %s; sending it again as attempt %d", abort.request_id, e.message,
                            stream.request.attempt)
                self._publish_soon(self.bus.subjects.abort, abort)
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
            model = p.model.name if p else (body.get("model") if isinstance(body, dict) else None)
            self.request_log.log_rejected(kind, body, model or self.served_model_name, arrival, e,
                                          p and p.num_prompt_tokens, priority,
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

    async def models(self) -> dict:
        """Every model of the manifest, loaded or not. Beyond OpenAI's fields: `state` (the
        hottest tier it is in on some node: mapped, host or disk; or loading, or failed with
        `error`), `workers` serving it, its `aliases`, `version`, `pinned`, and generation_defaults
        (its own sampling defaults, once its tokenizer is loaded here). The states come from the
        scheduler's status; without an answer they are "unknown"."""
        status = await self.scheduler_status()
        states = (status or {}).get("models", {})
        manifest = self.catalog.manifest
        data = []
        for name in manifest.names:
            versions = manifest.versions(name)
            spec = versions[0]
            sts = [states.get(v.id, {}) for v in versions]
            hottest = min(sts, key=lambda x: STATE_ORDER.index(x.get("state", "unknown")))
            try:
                entry = self.catalog.entry_of(spec)
                defaults, max_model_len = entry.generation_defaults, entry.max_model_len
            except OpenAIError:
                defaults, max_model_len = {}, self.catalog.max_model_len(spec)
            parsers = self.catalog.parsers_of(spec)
            card = {"id": name, "object": "model", "created": self.created, "owned_by": "meshserve",
                    "root": spec.path if len(manifest.models) > 1 else name, "parent": None,
                    "max_model_len": max_model_len, "generation_defaults": defaults,
                    "state": hottest.get("state", "unknown"), "error": hottest.get("error"),
                    "workers": sum(x.get("workers", 0) for x in sts), "aliases": list(spec.aliases),
                    "version": spec.version, "pinned": spec.pinned, "load_times_s": hottest.get("load_times_s", {}),
                    "reasoning_parser": parsers["reasoning_parser"],
                    "tool_call_parser": parsers["tool_call_parser"] or tool_calls.DEFAULT_PARSER}
            if spec.share is not None:  # a canary: each version, its share and its state
                card["versions"] = [{"version": v.version, "share": v.share, "path": v.path,
                                     "state": x.get("state", "unknown"), "error": x.get("error"),
                                     "workers": x.get("workers", 0)} for v, x in zip(versions, sts)]
            if spec.variant is not None:  # variants: who each serves, its format and its state
                card["variants"] = [{"variant": v.variant, "priorities": v.priorities and list(v.priorities),
                                     "tenants": v.tenants and list(v.tenants), "path": v.path, "dtype": v.dtype,
                                     "quantization": v.quantization, "state": x.get("state", "unknown"),
                                     "error": x.get("error"), "workers": x.get("workers", 0)}
                                    for v, x in zip(versions, sts)]
            data.append(card)
        by_id = {c["id"]: c for c in data}
        for a in self.catalog.adapters.all():  # LoRA adapters: their base's state, unless they fail to load
            base = by_id.get(a.base.name, {})
            context = base.get("max_model_len") or self.catalog.max_model_len(a.base)
            got = await asyncio.to_thread(self.catalog.adapters.state, a)
            failed = isinstance(got, str)
            data.append({"id": a.name, "object": "model", "created": self.created, "owned_by": "meshserve",
                         "root": a.path, "parent": a.base.name, "max_model_len": context,
                         "state": "failed" if failed else base.get("state", "unknown"),
                         "error": got if failed else base.get("error"), "workers": base.get("workers", 0),
                         "aliases": [], "version": None, "pinned": False, "load_times_s": {},
                         "lora": {"path": a.path, "source": "runtime" if a.runtime else "manifest"}})
        return {"object": "list", "data": data}

    async def model(self, name: str) -> dict:
        """One model's card (OpenAI's GET /v1/models/{model}): by its served name, an alias or an
        adapter's name; 404 for any other."""
        adapter = self.catalog.adapters.find(name)
        versions = self.catalog.manifest.versions(name)
        want = adapter.name if adapter is not None else versions[0].name if versions else None
        card = next((c for c in (await self.models())["data"] if c["id"] == want), None)
        if card is None:
            self.catalog.entry(name)  # raises the 404 every endpoint answers for an unknown model
            raise OpenAIError(f"the model {name!r} does not exist", 404, param="model", code="model_not_found")
        return card

    async def load_lora_adapter(self, body) -> dict:
        """vLLM's POST /v1/load_lora_adapter: checks the adapter against its base (a 4xx saying why it
        does not fit) and serves it under lora_name from then on (adapters.py)."""
        req = validate_body(LoadLoRAAdapterRequest, body)
        a = await asyncio.to_thread(self.catalog.adapters.load, req)
        log.info("LoRA adapter %s loaded from %s for %s", a.name, a.path, a.base.name)
        return {"object": "lora_adapter", "lora_name": a.name, "lora_path": a.path, "parent": a.base.name,
                "message": f"Success: LoRA adapter '{a.name}' added successfully."}

    async def unload_lora_adapter(self, body) -> dict:
        """vLLM's POST /v1/unload_lora_adapter: no new request may name it (those running finish)."""
        a = self.catalog.adapters.unload(validate_body(UnloadLoRAAdapterRequest, body))
        log.info("LoRA adapter %s unloaded", a.name)
        return {"object": "lora_adapter", "lora_name": a.name, "parent": a.base.name,
                "message": f"Success: LoRA adapter '{a.name}' removed successfully."}

    async def reload_models(self) -> dict:
        """Re-reads the manifest here and has the scheduler (and through it the model-loaders) do the
        same; a model no longer listed is refused from now on, drains, and is unloaded."""
        from meshserve.shared.manifest import ManifestError

        try:
            m = self.catalog.reload()
        except ManifestError as e:
            raise OpenAIError(f"the manifest was not reloaded: {e}", 400, code="invalid_manifest") from None
        try:
            msg = await self.bus.nc.request(self.bus.subjects.scheduler("reload"), b"{}", timeout=10)
            scheduler = orjson.loads(msg.data)
        except Exception as e:  # noqa: BLE001 - reported, the gateway's part is done
            scheduler = {"ok": False, "error": f"the scheduler did not answer: {e}"}
        return {"models": m.names, "scheduler": scheduler}


class Choice:
    """One choice of a request: reads its token stream (a request of its own in the mesh)."""

    def __init__(self, gen: "Generation", index: int, request: GenerateRequest, stream: RequestStream):
        self.gen, self.index, self.request, self._stream = gen, index, request, stream
        self.prompt = gen.prepared.prompts[index // gen.prepared.n]
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob | None] = []
        self.prompt_logprobs: list[Logprob | None] | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self._detok = IncrementalDetokenizer(gen.prepared.tokenizer, **gen.prepared.request.text_options())
        self._last_token_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def workers(self) -> list[str]:
        return self._stream.workers

    async def deltas(self) -> AsyncIterator[Delta]:
        """This choice as in-order deltas; the last one has a finish_reason. Raises OpenAIError."""
        gw = self.gen.gw
        while not self.done:
            try:
                chunk = await self._stream.next(gw.stream_timeout)
            except asyncio.TimeoutError:
                raise OpenAIError(f"no tokens arrived for {gw.stream_timeout:g} s; the request was "
                                  "aborted", 504, type="server_error", code="timeout") from None
            yield self._apply(chunk)

    def _apply(self, chunk: TokenChunk) -> Delta:
        now = time.time()
        if chunk.num_cached_tokens:
            self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        seen = len(self._detok.token_ids)
        text = self._detok.add(chunk.token_ids)
        n = len(self._detok.token_ids) - seen  # fewer than sent when a stop string ended the output
        token_ids, logprobs = chunk.token_ids[:n], None if chunk.logprobs is None else chunk.logprobs[:n]
        finish = None
        if self._detok.stopped:
            finish = "stop"
            if not chunk.finished:
                self.gen.gw.abort(self.request.request_id, reason="stop")
        elif chunk.finished:
            text += self._detok.flush()
            finish = chunk.finish_reason or "stop"
        self.token_ids += token_ids
        if self.gen.want_logprobs:
            self.logprobs += logprobs if logprobs is not None else [None] * len(token_ids)
        self.text += text
        m = self.gen.metrics
        if token_ids:
            if self._last_token_time is None:
                self.first_token_time = now
                if self.gen.first_token_time == now:  # the request's first token, of any choice
                    m.ttft.observe(now - self.request.arrival_time)
            else:
                m.observe_itl(now - self._last_token_time, len(token_ids))
            self._last_token_time = now
            m.generation_tokens.inc(len(token_ids))
            m.tenant_generated(self.gen.prepared.tenant, len(token_ids))
        if finish:
            self.finish_reason = finish
            self.finish_time = now
            if self.gen.done:
                m.e2e.observe(now - self.request.arrival_time)
                m.finished(self.gen.finish_reason)
        return Delta(text, token_ids, logprobs, finish, self.index)


class Generation:
    """One submitted request, its n choices: reads their token streams and builds the response."""

    def __init__(self, gw: Gateway, prepared: Prepared, requests: list[GenerateRequest],
                 streams: list[RequestStream]):
        self.gw, self.prepared = gw, prepared
        self.request = requests[0]
        self.span = telemetry.NOOP_SPAN  # the gateway.request span, ended by close()
        self.kind = prepared.kind
        self.stream = prepared.request.stream
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{prepared.request.request_id or self.request.request_id}"
        self.created = int(time.time())
        self.model = prepared.model.name
        self.metrics = gw.metrics.of(prepared.model.spec.name)  # its series: the model it runs on
        self.want_logprobs = prepared.sampling.logprobs is not None
        self.echo = isinstance(prepared.request, CompletionRequest) and prepared.request.echo
        self.chat_echo = prepared.request.echoed() if self.kind == "chat" else ""  # vLLM's chat echo
        self.tool_mode = prepared.request.tool_mode() if self.kind == "chat" else "none"
        self.choices = [Choice(self, i, r, s) for i, (r, s) in enumerate(zip(requests, streams))]
        self.error: Exception | None = None  # what ended it, when it failed
        self._closed = False

    # what the request log and single-choice callers read
    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.done else None

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.choices for t in c.token_ids]

    @property
    def num_cached_tokens(self) -> int:
        """Of each prompt once (its first choice's)."""
        return sum(c.num_cached_tokens for c in self.choices[::self.prepared.n])

    @property
    def workers(self) -> list[str]:
        """The workers whose tokens the client got, in turn, over every choice."""
        out: list[str] = []
        for c in self.choices:
            out += [w for w in c.workers if w not in out]
        return out

    @property
    def first_token_time(self) -> float | None:
        return min((c.first_token_time for c in self.choices if c.first_token_time is not None), default=None)

    @property
    def finish_time(self) -> float | None:
        return max((c.finish_time for c in self.choices), default=None) if self.done else None

    def close(self) -> None:
        """Stops listening; aborts the choices that did not finish (client gone, error, timeout)."""
        if self._closed:
            return
        self._closed = True
        self.span.end()
        for c in self.choices:
            self.gw.streams.close(c.request.request_id)
            if not c.done:
                self.gw.abort(c.request.request_id)
            self.gw.settle(c.request, len(c.token_ids))
        if self.gw.request_log:
            self.gw.request_log.log_generation(self)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every choice's deltas as they come (each in order); raises OpenAIError."""
        try:
            if len(self.choices) == 1:
                async for d in self.choices[0].deltas():
                    yield d
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(c: Choice):
                try:
                    async for d in c.deltas():
                        queue.put_nowait(d)
                except Exception as e:  # noqa: BLE001 - handed to the reader
                    queue.put_nowait(e)
                queue.put_nowait(None)

            tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
            try:
                left = len(tasks)
                while left:
                    item = await queue.get()
                    if item is None:
                        left -= 1
                    elif isinstance(item, Exception):
                        raise item
                    else:
                        yield item
            finally:
                for t in tasks:
                    t.cancel()
        except Exception as e:
            self.error = e
            raise

    def usage(self) -> dict:
        """With a prediction, how much of it the answer took, once the answer is whole."""
        predicted = self.prepared.sampling.prediction
        details = prediction_usage(predicted, [c.token_ids for c in self.choices]) if predicted and self.done else None
        return usage(self.prepared.num_prompt_tokens, len(self.token_ids), self.num_cached_tokens, details)

    def _logprobs(self, token_ids: list[int], logprobs: list[Logprob | None] | None,
                  text_offset: int) -> dict | None:
        if not self.want_logprobs:
            return None
        lps = logprobs if logprobs is not None else [None] * len(token_ids)
        decode = self.prepared.request.token_text(self.prepared.tokenizer)
        if self.kind == "chat":
            return chat_logprobs(token_ids, lps, decode)
        return completion_logprobs(token_ids, lps, decode, text_offset)

    def _echo(self, c: Choice) -> tuple[str, dict | None]:
        """The prompt as echo returns it: its text, and its tokens' logprobs (the first null)."""
        if not self.want_logprobs:
            return c.prompt.text, None
        ids = c.prompt.token_ids
        lps = c.prompt_logprobs or [None] * len(ids)
        return c.prompt.text, completion_logprobs(ids, lps, self.prepared.request.token_text(self.prepared.tokenizer),
                                                  top=self.prepared.request.logprobs)

    def reasoning_parser(self) -> ReasoningParser | None:
        """A fresh parser of the model's reasoning (chat only; shared/reasoning.py), or None."""
        name = self.prepared.model.reasoning_parser
        return ReasoningParser(name, self.prepared.reasoning_prompt) if name is not None and self.kind == "chat" else None

    def _tool_output(self, text: str) -> tuple[str | None, list[tool_calls.ToolCall]]:
        """(content, calls) of a chat choice's answer under the request's tool_choice."""
        named = self.prepared.request.tool_choice.function["name"] if self.tool_mode == "named" else None
        return tool_calls.read_calls(self.tool_mode, text, named, self.prepared.model.tool_call_parser,
                                     self.prepared.request.parallel_tool_calls)

    async def body(self) -> dict:
        """The whole (non-streaming) response."""
        async for _ in self.deltas():
            pass
        choices = []
        for c in self.choices:
            lp = self._logprobs(c.token_ids, c.logprobs, 0)
            if self.kind == "chat":
                reasoning, answer = split_answer(self.prepared.model.reasoning_parser, c.text,
                                                 self.prepared.request.include_reasoning, self.prepared.reasoning_prompt)
                content, calls = self._tool_output(answer)
                if self.chat_echo:
                    content = self.chat_echo + (content or "")
                finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
                choices.append(chat_choice(c.index, content, finish, lp, [t.openai() for t in calls] or None))
                choices[-1]["message"].update(reasoning)
            elif self.echo:
                text, plp = self._echo(c)
                if plp is not None:
                    plp = join_logprobs(plp, self._logprobs(c.token_ids, c.logprobs, len(text)))
                choices.append(completion_choice(c.index, text + c.text, c.finish_reason, plp))
            else:
                choices.append(completion_choice(c.index, c.text, c.finish_reason, lp))
            if self.kind != "chat":
                choices[-1].update(self.prompt_fields(c))
            if self.prepared.request.return_token_ids:
                choices[-1]["token_ids"] = c.token_ids
        build = chat_response if self.kind == "chat" else completion_response
        out = build(self.id, self.model, "", None, self.usage(), choices=choices)
        if self.kind == "chat":
            out.update(self.prompt_fields(self.choices[0]))  # vLLM's place for chat: beside the choices
        return out

    def prompt_fields(self, c: Choice) -> dict:
        return prompt_fields(self.prepared.request, c.prompt.token_ids, c.prompt_logprobs,
                             self.prepared.tokenizer.decode)

    async def chunks(self) -> AsyncIterator[dict]:
        """The streaming response, chunk by chunk (OpenAI's JSON); raises OpenAIError mid-stream.
        Each chunk carries one choice's delta, with its index."""
        options = self.prepared.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)  # vLLM's: the usage so far in each
        state = {c.index: _ChunkState(self, c) for c in self.choices}
        async for d in self.deltas():
            for chunk in state[d.index].chunks(d):
                if include_usage or continuous:  # as OpenAI: every chunk has the key, only the last one a value
                    chunk["usage"] = self.usage() if continuous else None
                yield chunk
        if include_usage:
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            yield usage_chunk(self.id, obj, self.model, self.created, self.usage())


class _ChunkState:
    """One choice's part of a streamed response: role first, echo, content or tool-call deltas."""

    def __init__(self, gen: Generation, choice: Choice):
        self.gen, self.choice = gen, choice
        self.first, self.offset = True, 0
        self.unsent_ids: list[int] = []  # return_token_ids: output tokens no chunk has carried yet
        self.sent_prompt = False
        self.reasoning = gen.reasoning_parser()  # its model's reasoning parser: reasoning deltas apart
        self.answer = ""  # with one: the text after the reasoning, so far
        self.auto = tool_calls.AutoParser(gen.prepared.model.tool_call_parser, gen.prepared.request.parallel_tool_calls) \
            if gen.tool_mode == "auto" else None
        self.named_call = (tool_calls.ToolCall(gen.prepared.request.tool_choice.function["name"], "")
                           if gen.tool_mode == "named" else None)
        self.call_opened = False  # the named call's first chunk (id, name) went out

    def _chunk(self, delta_or_text, finish: str | None = None, logprobs: dict | None = None) -> dict:
        g = self.gen
        if g.kind == "chat":
            return chat_chunk(g.id, g.model, g.created, delta_or_text, finish, logprobs, self.choice.index)
        return completion_chunk(g.id, g.model, g.created, delta_or_text, finish, logprobs, self.choice.index)

    def chunks(self, d: Delta) -> list[dict]:
        """The chunks of a delta; with return_token_ids (vLLM's) the last of them carries the
        delta's token ids (and those of deltas that made no chunk), and the choice's first chunk
        its prompt's."""
        out = self._chunks(d)
        if self.gen.prepared.request.return_token_ids:
            self.unsent_ids += d.token_ids
            if out:
                if not self.sent_prompt:
                    first = out[0]
                    (first if self.gen.kind == "chat" else first["choices"][0])["prompt_token_ids"] = \
                        self.choice.prompt.token_ids
                    self.sent_prompt = True
                out[-1]["choices"][0]["token_ids"], self.unsent_ids = self.unsent_ids, []
        return out

    def _reasoning_delta(self, d: Delta, out: list[dict]) -> Delta:
        """The delta's reasoning as a chunk of its own (`reasoning_content` and `reasoning`, the role
        with it when it is the first); returns the delta with its answer text only."""
        reasoning, answer = self.reasoning.feed(d.text)
        if d.finish_reason:
            rest = self.reasoning.finish()
            reasoning, answer = reasoning + rest[0], answer + rest[1]
        self.answer += answer
        fields = reasoning_fields(reasoning, self.gen.prepared.request.include_reasoning) if reasoning else {}
        if fields:
            out.append(self._chunk({"role": "assistant", **fields} if self.first else fields))
            self.first = False
        return dataclasses.replace(d, text=answer)

    def _chunks(self, d: Delta) -> list[dict]:
        g, out = self.gen, []
        if g.kind != "chat":
            if self.first and g.echo:
                text, plp = g._echo(self.choice)
                out.append(self._chunk(text, None, plp))
                self.offset = len(text)
            self.first = False
            if d.text or d.finish_reason or (g.want_logprobs and d.token_ids):
                out.append(self._chunk(d.text, d.finish_reason, g._logprobs(d.token_ids, d.logprobs, self.offset)))
                self.offset += len(d.text)
            return out
        lp = g._logprobs(d.token_ids, d.logprobs, 0)
        if self.first and g.chat_echo:
            out.append(self._chunk({"role": "assistant", "content": g.chat_echo}))
            self.first = False
        if self.reasoning is not None:
            d = self._reasoning_delta(d, out)
        role = {"role": "assistant"} if self.first else {}
        finish = d.finish_reason
        if g.tool_mode == "none":
            if d.text or d.finish_reason or (g.want_logprobs and d.token_ids):
                delta = {**role, "content": d.text} if (d.text or self.first) else {}
                out.append(self._chunk(delta, finish, lp))
                self.first = False
            return out
        if self.named_call is not None:  # the output is the arguments: stream them as they come
            call = self.named_call
            if not self.call_opened:
                out.append(self._chunk({**role, "content": None, "tool_calls": [
                    {"index": 0, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]}))
                self.first, self.call_opened = False, True
            if d.text:
                out.append(self._chunk({"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]}, None, lp))
            if finish:
                out.append(self._chunk({}, "tool_calls" if finish == "stop" else finish))
            return out
        # auto: content as it comes until a call opens; required: all at the end
        content = self.auto.feed(d.text) if self.auto is not None else ""
        if content or (self.first and self.auto is not None and d.text):
            out.append(self._chunk({**role, "content": content}, None, lp))
            self.first, role = False, {}
        if finish:
            if self.auto is not None:
                rest, calls = self.auto.finish()
            else:
                answer = self.answer if self.reasoning is not None else self.choice.text
                rest, calls = "", tool_calls.parse_required(answer)
                if not calls:
                    rest = answer
            if rest:
                out.append(self._chunk({**role, "content": rest}))
                self.first, role = False, {}
            for k, call in enumerate(calls):
                out.append(self._chunk({**role, "tool_calls": [call.openai(k)]}))
                self.first, role = False, {}
            if self.first:
                out.append(self._chunk({**role, "content": ""}))
            out.append(self._chunk({}, "tool_calls" if calls and finish == "stop" else finish))
        return out

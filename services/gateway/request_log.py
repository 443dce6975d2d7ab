"""The gateway's request log: one JSON line per finished request, for `meshserve analyze`.

Every request that reached the handler is logged once, when it ends: finished (a `finish_reason`),
failed (an `error` with its HTTP status and message, `finish_reason` null) or given up by its client
(`error.status` 499). A line:

    {"arrival": 1732900000.123, "id": "3f2a...", "response_id": "chatcmpl-3f2a...",
     "model": "smollm2-135m-instruct", "class": "normal",
     "tenant": "acme", "endpoint": "chat", "stream": true, "prompt_tokens": 412, "cached_tokens": 0,
     "output_tokens": 87, "max_tokens": 256, "ttft": 0.081, "e2e": 1.93, "finish_reason": "stop", "error": null,
     "workers": ["node0-prefill-0", "node0-decode-1"]}

`response_id` is the `id` the client got (a request's vLLM `request_id` names it; a
failed request has none); `arrival` is unix time in seconds (when the request was tokenized and submitted; for a request that
failed validation, when it came in); `ttft` and `e2e` are seconds from `arrival` to the first
output token and to the last one (or to the failure); `ttft` is null when no token came;
`prompt_tokens` is null when the request failed before it was tokenized; `tenant` is the tenant whose
API key the request carried (the tenants file), null without one; `workers` are the workers whose
tokens the client got, in turn (a prefill -> decode handoff names two; a worker lost midway and its
replacement, two; empty when no token came).

The file rotates by size: when a line would take it past `max_bytes`, `requests.jsonl` becomes
`requests.jsonl.1` (`.1` becomes `.2`, ... up to `backups`; the oldest is dropped). Lines are written
with one unbuffered `write` each, on the event loop: a few hundred bytes into the page cache cost
microseconds, and a reader sees a line as soon as the request it describes has ended. One file per
gateway process: two gateways must not share a path (their rotations would race).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import orjson

log = logging.getLogger(__name__)

DEFAULT_PATH = "~/.cache/meshserve/logs/requests.jsonl"
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_BACKUPS = 5
CLIENT_CLOSED = 499


class RequestLog:
    def __init__(self, path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS):
        self.path = Path(path).expanduser()
        self.max_bytes, self.backups = max_bytes, backups
        self._fd: int | None = None
        self._size = 0
        self._failed = False
        try:
            self._open()
        except OSError as e:  # e.g. a read-only home: serve anyway, say so, try again on the next line
            log.warning("could not open the request log %s: %s", self.path, e)
            self._failed = True

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = None
        if self.backups > 0:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._open()

    def write(self, record: dict) -> None:
        """Appends one line; never raises (a full disk must not fail requests)."""
        try:
            line = orjson.dumps(record) + b"\n"
            if self._fd is None:
                self._open()
            if self._size and self.max_bytes > 0 and self._size + len(line) > self.max_bytes:
                self._rotate()
            os.write(self._fd, line)
            self._size += len(line)
            self._failed = False
        except Exception as e:  # noqa: BLE001
            if not self._failed:  # once per run of failures, not once per request
                log.warning("could not write the request log %s: %s", self.path, e)
            self._failed = True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- the records

    def log_generation(self, gen, now: float | None = None) -> None:
        """A submitted request that ended (handler.Generation): finished, failed or cancelled."""
        now = time.time() if now is None else now
        req = gen.request
        arrival = req.arrival_time
        if gen.finish_reason is not None:
            error = None
            end = gen.finish_time or now
        else:
            error = _error(gen.error)
            end = now
        self.write({
            "arrival": arrival, "id": req.request_id, "response_id": gen.id, "model": req.model,
            "class": req.priority, "tenant": req.tenant, "endpoint": gen.kind, "stream": bool(gen.stream),
            "prompt_tokens": gen.prepared.num_prompt_tokens,
            "cached_tokens": gen.num_cached_tokens, "output_tokens": len(gen.token_ids),
            "max_tokens": req.sampling.max_tokens,
            "ttft": None if gen.first_token_time is None else gen.first_token_time - arrival,
            "e2e": end - arrival, "finish_reason": gen.finish_reason, "error": error, "workers": gen.workers})

    def log_rejected(self, kind: str, body, model: str, arrival: float, error, prompt_tokens: int | None = None,
                     priority: str | None = None, max_tokens: int | None = None, request_id: str | None = None,
                     now: float | None = None, tenant: str | None = None) -> None:
        """A request that failed before any token could come (validation, submission)."""
        now = time.time() if now is None else now
        if isinstance(body, dict):  # what the client asked for, even if that was the problem
            if priority is None:
                p = body.get("priority", "normal")
                priority = p if isinstance(p, str) else None
            if isinstance(body.get("model"), str):
                model = body["model"]
        self.write({
            "arrival": arrival, "id": request_id, "model": model, "class": priority, "tenant": tenant,
            "endpoint": kind,
            "stream": isinstance(body, dict) and body.get("stream") is True, "prompt_tokens": prompt_tokens,
            "cached_tokens": 0, "output_tokens": 0, "max_tokens": max_tokens, "ttft": None, "e2e": now - arrival,
            "finish_reason": None, "error": _error(error), "workers": []})


def _error(e: BaseException | None) -> dict:
    """None or a cancellation: the client went away (or the gateway is stopping)."""
    if e is None or isinstance(e, asyncio.CancelledError):
        return {"status": CLIENT_CLOSED, "message": "cancelled: the client went away or the gateway stopped"}
    return {"status": getattr(e, "status_code", 500), "message": str(e) or type(e).__name__}

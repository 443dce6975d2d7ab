"""`meshserve batch --url URL`: the OpenAI Batch file format, sent to a running mesh over HTTP.

Each line's body is POSTed to its url on the gateway, as the `background` class unless the body
names a `priority`, with `Authorization: Bearer <--api-key>` when one is given. Up to
--concurrency lines are in flight at once; a 429 or 503 (a tenant's quota, a full class queue) is
retried after the server's Retry-After, up to --max-retries times, then written as the line's
result. Results are written in input order, in the same shape as the in-process runner's.
"""

from __future__ import annotations

import asyncio
import sys

import httpx
import orjson

from meshserve.shared.openai_protocol import OpenAIError

from .batch import _error_result, _kind, _read_line, _result, write_results

BATCH_CLASS = "background"
RETRY_STATUSES = (429, 503)
MAX_RETRY_WAIT = 60.0


def base_url(url: str) -> str:
    """The server's root: lines name their path from /v1 on, so a URL given with /v1 loses it."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def request_body(item: dict) -> dict:
    """A line's body as sent: background class unless it says otherwise. Raises OpenAIError."""
    _kind(item)
    body = item.get("body")
    if not isinstance(body, dict):
        raise OpenAIError("body must be a JSON object", param="body")
    if body.get("stream") is True:
        raise OpenAIError("stream is not supported in a batch; each result is one response body", param="stream")
    return body if "priority" in body else {**body, "priority": BATCH_CLASS}


def _retry_after(r: httpx.Response) -> float:
    try:
        return min(MAX_RETRY_WAIT, max(0.0, float(r.headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0


async def _one(client: httpx.AsyncClient, item: dict, max_retries: int) -> dict:
    cid = item.get("custom_id")
    try:
        body = request_body(item)
    except OpenAIError as e:
        return _error_result(cid, e)
    retries = 0
    while True:
        try:
            r = await client.post(item["url"], content=orjson.dumps(body),
                                  headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            return _error_result(cid, OpenAIError(f"the server could not be reached: {e}", 503, type="server_error"))
        if r.status_code not in RETRY_STATUSES or retries == max_retries:
            break
        retries += 1
        await asyncio.sleep(_retry_after(r))
    try:
        answer = r.json()
    except ValueError:
        answer = {"error": {"message": r.text[:1000] or f"HTTP {r.status_code}", "type": "server_error",
                            "param": None, "code": None}}
    if r.status_code == 200:
        return _result(cid, 200, answer)
    err = answer.get("error") if isinstance(answer, dict) else None
    err = err if isinstance(err, dict) else {}
    return _result(cid, r.status_code, answer,
                   {"code": err.get("code") or err.get("type"), "message": err.get("message")})


async def run_remote(lines: list[bytes], url: str, api_key: str | None = None, concurrency: int = 8,
                     max_retries: int = 5, timeout: float = 600.0) -> list[dict]:
    """The result of every non-blank line, in input order."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max(1, concurrency))
    async with httpx.AsyncClient(base_url=base_url(url), headers=headers,
                                 timeout=httpx.Timeout(timeout, connect=10.0)) as client:
        async def run(line: bytes) -> dict:
            try:
                item = _read_line(line)
            except OpenAIError as e:
                return _error_result(None, e)
            async with gate:
                return await _one(client, item, max_retries)

        return await asyncio.gather(*(run(line) for line in lines if line.strip()))


def main(args) -> int:
    inp = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")
    with inp:
        lines = inp.read().splitlines()
    results = asyncio.run(run_remote(lines, args.url, args.api_key, args.concurrency, args.max_retries))
    out = sys.stdout.buffer if args.output == "-" else open(args.output, "wb")
    with out:
        ok, failed = write_results(results, out)
    print(f"{ok} succeeded, {failed} failed", file=sys.stderr)
    return 0

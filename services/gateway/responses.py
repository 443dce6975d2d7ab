"""/v1/responses on the chat path: the request is translated into a chat completions body
(shared/openai_responses.py), submitted as any chat request is, and its chat chunks are turned
into a Response object or the Responses streaming events."""

from __future__ import annotations

import time
from typing import AsyncIterator

from meshserve.shared.openai_protocol import OpenAIError
from meshserve.shared.openai_responses import (ResponsesRequest, chat_body, message_item, output_text,
                                               parse_responses_request, response_object, response_usage, status_of,
                                               wants_logprobs)

from .handler import Gateway, Generation


class ResponsesCall:
    """One submitted /v1/responses request. The caller must `close()` it."""

    def __init__(self, req: ResponsesRequest, gen: Generation):
        self.req, self.gen = req, gen
        rid = gen.request.request_id
        self.id, self.item_id = f"resp_{rid}", f"msg_{rid}"
        self.created_at = int(time.time())
        self.stream = req.stream
        self.want_logprobs = wants_logprobs(req)
        self.text = ""
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def close(self) -> None:
        self.gen.close()

    async def _deltas(self) -> AsyncIterator[tuple[str, list[dict]]]:
        """(text, logprobs) of each chat chunk, accumulated into text, logprobs, finish_reason, usage."""
        async for chunk in self.gen.chunks():
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            for choice in chunk["choices"]:
                text = choice["delta"].get("content") or ""
                lps = (choice.get("logprobs") or {}).get("content") or []
                self.text += text
                self.logprobs += lps
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
                if text or lps:
                    yield text, lps

    def _part(self) -> dict:
        return output_text(self.text, self.logprobs if self.want_logprobs else None)

    def _response(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        return response_object(self.id, self.created_at, self.req, self.gen.model, status, output,
                               response_usage(self.usage), error)

    async def body(self) -> dict:
        """The whole Response (not streamed)."""
        async for _ in self._deltas():
            pass
        status = status_of(self.finish_reason)
        return self._response(status, [message_item(self.item_id, status, [self._part()])])

    async def events(self) -> AsyncIterator[dict]:
        """The streaming events, in OpenAI's order, each with its sequence_number. An error after the
        stream started is an `error` event, then `response.failed`."""
        seq = 0

        def event(type_: str, **fields) -> dict:
            nonlocal seq
            seq += 1
            return {"type": type_, "sequence_number": seq - 1, **fields}

        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=self._response("in_progress", []))
        yield event("response.in_progress", response=self._response("in_progress", []))
        yield event("response.output_item.added", output_index=0,
                    item=message_item(self.item_id, "in_progress", []))
        yield event("response.content_part.added", **where,
                    part=output_text("", [] if self.want_logprobs else None))
        try:
            async for text, lps in self._deltas():
                yield event("response.output_text.delta", **where, delta=text,
                            logprobs=lps if self.want_logprobs else [])
        except OpenAIError as e:
            yield event("error", code=e.code or e.type, message=e.message, param=e.param)
            item = message_item(self.item_id, "incomplete", [self._part()])
            yield event("response.failed", response=self._response(
                "failed", [item], {"code": "server_error", "message": e.message}))
            return
        status = status_of(self.finish_reason)
        part = self._part()
        yield event("response.output_text.done", **where, text=self.text,
                    logprobs=self.logprobs if self.want_logprobs else [])
        yield event("response.content_part.done", **where, part=part)
        item = message_item(self.item_id, status, [part])
        yield event("response.output_item.done", output_index=0, item=item)
        yield event("response.completed" if status == "completed" else "response.incomplete",
                    response=self._response(status, [item]))


def prepare(body) -> tuple[ResponsesRequest, dict]:
    """The parsed request and its chat completions body; raises OpenAIError(4xx)."""
    req = parse_responses_request(body)
    return req, chat_body(req)


async def submit(gw: Gateway, req: ResponsesRequest, chat: dict, tenant=None) -> ResponsesCall:
    return ResponsesCall(req, await gw.submit("chat", chat, tenant))

"""/v1/responses on the chat path: the request is translated into a chat completions body
(shared/openai_responses.py), submitted as any chat request is, and its chat chunks are turned
into a Response object or the Responses streaming events: output items in order, the reasoning
(with a reasoning parser), the message (when it has text, or nothing else), the function calls."""

from __future__ import annotations

import time
from typing import AsyncIterator

from meshserve.shared.openai_protocol import OpenAIError
from meshserve.shared.openai_responses import (ResponsesRequest, chat_body, function_call_item, message_item,
                                               output_text, parse_responses_request, reasoning_item,
                                               response_object, response_usage, status_of, wants_logprobs)

from .handler import Gateway, Generation


class ResponsesCall:
    """One submitted /v1/responses request. The caller must `close()` it. A model with a reasoning
    parser gives a `reasoning` output item before the message."""

    def __init__(self, req: ResponsesRequest, gen: Generation):
        self.req, self.gen = req, gen
        rid = gen.request.request_id
        self.id, self.item_id, self.reasoning_id = f"resp_{rid}", f"msg_{rid}", f"rs_{rid}"
        self.created_at = int(time.time())
        self.stream = req.stream
        self.want_logprobs = wants_logprobs(req)
        self.text = ""
        self.reasoning: str | None = None  # None: the answer had none
        self.logprobs: list[dict] = []
        self.calls: list[dict] = []  # the chat answer's tool calls: {"id", "function": {"name", "arguments"}}
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def close(self) -> None:
        self.gen.close()

    async def _deltas(self) -> AsyncIterator[tuple[str, str, list[dict], list[dict]]]:
        """(reasoning, text, logprobs, tool call deltas) of each chat chunk, accumulated into
        reasoning, text, logprobs, calls, finish_reason, usage. A call's first delta has its id and
        name (an auto answer's call comes whole; a named one's arguments as they are written)."""
        async for chunk in self.gen.chunks():
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            for choice in chunk["choices"]:
                thought = choice["delta"].get("reasoning_content") or ""
                text = choice["delta"].get("content") or ""
                lps = (choice.get("logprobs") or {}).get("content") or []
                calls = choice["delta"].get("tool_calls") or []
                if thought:
                    self.reasoning = (self.reasoning or "") + thought
                self.text += text
                self.logprobs += lps
                for tc in calls:
                    if tc["index"] == len(self.calls):
                        self.calls.append({"id": tc["id"], "function": {"name": tc["function"]["name"], "arguments": ""}})
                    self.calls[tc["index"]]["function"]["arguments"] += tc["function"].get("arguments") or ""
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
                if thought or text or lps or calls:
                    yield thought, text, lps, calls

    def _part(self) -> dict:
        return output_text(self.text, self.logprobs if self.want_logprobs else None)

    def _response(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        return response_object(self.id, self.created_at, self.req, self.gen.model, status, output,
                               response_usage(self.usage), error)

    def _call_item(self, k: int, status: str, arguments: str | None = None) -> dict:
        call = self.calls[k]
        return function_call_item(self._call_id(k), status, call["id"], call["function"]["name"],
                                  call["function"]["arguments"] if arguments is None else arguments)

    def _output(self, status: str) -> list[dict]:
        thought = [] if self.reasoning is None else [reasoning_item(self.reasoning_id, status, self.reasoning)]
        message = [message_item(self.item_id, status, [self._part()])] if self.text or not self.calls else []
        return thought + message + [self._call_item(k, status) for k in range(len(self.calls))]

    async def body(self) -> dict:
        """The whole Response (not streamed)."""
        async for _ in self._deltas():
            pass
        status = status_of(self.finish_reason)
        return self._response(status, self._output(status))

    def _call_id(self, k: int) -> str:
        return f"fc_{self.gen.request.request_id}_{k}"

    async def events(self) -> AsyncIterator[dict]:
        """The streaming events, in OpenAI's order, each with its sequence_number: the reasoning
        item's (when the model reasons) as its text comes, then the message's, then each function
        call's with its arguments as they come. An error after the stream started is an `error`
        event, then `response.failed`."""
        seq, index = 0, 0  # the next event's number; the output index of the item being written
        opened = None  # the item being written: "reasoning", "message", or a call's index

        def event(type_: str, **fields) -> dict:
            nonlocal seq
            seq += 1
            return {"type": type_, "sequence_number": seq - 1, **fields}

        def where() -> dict:
            return {"item_id": self.item_id if opened == "message" else self.reasoning_id, "output_index": index,
                    "content_index": 0}

        def open_(kind: str | int) -> list[dict]:
            nonlocal opened
            out = close()
            opened = kind
            if kind == "reasoning":
                return out + [event("response.output_item.added", output_index=index,
                                    item=reasoning_item(self.reasoning_id, "in_progress", ""))]
            if kind == "message":
                return out + [event("response.output_item.added", output_index=index,
                                    item=message_item(self.item_id, "in_progress", [])),
                              event("response.content_part.added", **where(),
                                    part=output_text("", [] if self.want_logprobs else None))]
            return out + [event("response.output_item.added", output_index=index,
                                item=self._call_item(kind, "in_progress", ""))]

        def close(status: str = "completed") -> list[dict]:
            nonlocal opened, index
            if opened == "reasoning":
                item = reasoning_item(self.reasoning_id, status, self.reasoning or "")
                out = [event("response.reasoning_text.done", **where(), text=self.reasoning or "")]
            elif opened == "message":
                part = self._part()
                item = message_item(self.item_id, status, [part])
                out = [event("response.output_text.done", **where(), text=self.text,
                             logprobs=self.logprobs if self.want_logprobs else []),
                       event("response.content_part.done", **where(), part=part)]
            elif opened is not None:  # a call
                item = self._call_item(opened, status)
                out = [event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=item["arguments"])]
            else:
                return []
            opened, index = None, index + 1
            return out + [event("response.output_item.done", output_index=index - 1, item=item)]

        yield event("response.created", response=self._response("in_progress", []))
        yield event("response.in_progress", response=self._response("in_progress", []))
        try:
            async for thought, text, lps, calls in self._deltas():
                if thought:
                    for e in open_("reasoning") if opened != "reasoning" else []:
                        yield e
                    yield event("response.reasoning_text.delta", **where(), delta=thought)
                if text or lps:
                    for e in open_("message") if opened != "message" else []:
                        yield e
                    yield event("response.output_text.delta", **where(), delta=text,
                                logprobs=lps if self.want_logprobs else [])
                for tc in calls:
                    for e in open_(tc["index"]) if opened != tc["index"] else []:
                        yield e
                    if tc["function"].get("arguments"):
                        yield event("response.function_call_arguments.delta", item_id=self._call_id(tc["index"]),
                                    output_index=index, delta=tc["function"]["arguments"])
        except OpenAIError as e:
            yield event("error", code=e.code or e.type, message=e.message, param=e.param)
            for x in close("incomplete"):
                yield x
            yield event("response.failed", response=self._response(
                "failed", self._output("incomplete"), {"code": "server_error", "message": e.message}))
            return
        status = status_of(self.finish_reason)
        if not self.calls and opened != "message":  # an empty answer is still a message
            for e in open_("message"):
                yield e
        for e in close(status):
            yield e
        yield event("response.completed" if status == "completed" else "response.incomplete",
                    response=self._response(status, self._output(status)))


def prepare(body) -> tuple[ResponsesRequest, dict]:
    """The parsed request and its chat completions body; raises OpenAIError(4xx)."""
    req = parse_responses_request(body)
    return req, chat_body(req)


async def submit(gw: Gateway, req: ResponsesRequest, chat: dict, tenant=None) -> ResponsesCall:
    return ResponsesCall(req, await gw.submit("chat", chat, tenant))

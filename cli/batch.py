"""`meshserve batch`: the OpenAI Batch file format, run through the in-process engine, or with
`--url` sent to a running mesh over HTTP (batch_remote.py).

Every valid line is added to the engine at once, so they are served by continuous batching
together; a bad line gets its own error result and the others still run. Results are written
in input order. The request fields are those of the HTTP API (shared/openai_protocol.py): n
choices (later ones wait for the first's prompt to be cached), echo, structured output, tools.
"""

from __future__ import annotations

import dataclasses
import sys
import uuid
from typing import IO, TYPE_CHECKING

import orjson

from meshserve.shared import tool_calls
from meshserve.shared.limits import RequestLimits
from meshserve.shared.reasoning import prompt_state, reasoning_setup, split_answer
from meshserve.shared.openai_protocol import (ChatCompletionRequest, OpenAIError, chat_choice, chat_logprobs,
                                              chat_response, completion_choice, completion_logprobs,
                                              completion_response, join_logprobs, new_id, parse_request,
                                              prediction_usage, prompt_fields, usage)

if TYPE_CHECKING:
    from meshserve.shared.engine.llm import LLM, Completion

URLS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _result(custom_id, status: int, body: dict, error: dict | None = None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": new_id("req"), "body": body}, "error": error}


def _error_result(custom_id, e: OpenAIError) -> dict:
    return _result(custom_id, e.status_code, e.body(), {"code": e.code or e.type, "message": e.message})


def _read_line(line: bytes) -> dict:
    try:
        item = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise OpenAIError(f"the line is not valid JSON: {e}") from None
    if not isinstance(item, dict):
        raise OpenAIError("each line must be a JSON object")
    return item


def _kind(item: dict) -> str:
    """The endpoint of a line ("completions" or "chat"); raises OpenAIError for another method or url."""
    if item.get("method", "POST") != "POST":
        raise OpenAIError("method must be POST", param="method")
    kind = URLS.get(item.get("url"))
    if kind is None:
        raise OpenAIError(f"url must be one of {sorted(URLS)}", param="url", code="invalid_url")
    return kind


def _prepare(llm: LLM, item: dict, served: str, reasoning: str | None = None):
    """Turns one input line into (kind, request, its prompts' ids, the texts echo returns of them,
    sampling params); raises OpenAIError."""
    from meshserve.shared.engine import wire

    kind = _kind(item)
    # the file is the user's own: a line may bring its own chat template
    req = parse_request(kind, item.get("body"), llm.tokenizer.vocab_size, RequestLimits(trust_request_chat_template=True))
    if req.model not in (None, served, llm.model_name):
        raise OpenAIError(f"the model {req.model!r} does not exist; this batch serves {served!r}",
                          status_code=404, param="model", code="model_not_found")
    if isinstance(req, ChatCompletionRequest):
        req.check_reasoning(reasoning)
        try:
            prompt = req.truncate(req.prompt_ids(llm.tokenizer))
        except OpenAIError:
            raise
        except Exception as e:  # a template that raises is the caller's doing
            raise OpenAIError(f"could not apply the chat template: {e}", param="messages") from None
        sampling, _ = reasoning_setup(reasoning, llm.tokenizer, prompt, req.to_sampling(
            llm.engine.max_model_len - len(prompt), llm.tokenizer, llm.generation_defaults))
        prompts, texts = [prompt], [""]
    else:
        prompts, texts = zip(*(req.prompt_ids(p, llm.tokenizer) for p in req.prompts))
        sampling = req.to_sampling(llm.tokenizer, llm.generation_defaults)
    return kind, req, list(prompts), list(texts), wire.sampling_params(sampling, **req.text_options())


def _add(llm: LLM, prompts: list[list[int]], params, n: int, cache_salt: str | None) -> list[Completion]:
    """n choices of each prompt: the first, then the others after it (they share its prompt's blocks),
    seed + i each. A prompt the engine refuses takes back the ones added before it."""
    out: list[Completion] = []
    try:
        for prompt in prompts:
            first = llm.add(prompt, params, cache_salt=cache_salt)
            out += [first] + [llm.add(prompt, params if params.seed is None else
                                      dataclasses.replace(params, seed=params.seed + i), after=first.request_id,
                                      cache_salt=cache_salt)
                              for i in range(1, n)]
    except Exception:
        for c in out:
            llm.engine.abort(c.request_id)
        raise
    return out


def _body(llm: LLM, kind: str, served: str, req, cs: list[Completion], texts: list[str],
          params, reasoning: str | None = None, tool_parser: str | None = None) -> dict:
    """texts: each prompt's text as echo returns it; params: the line's SamplingParams; reasoning,
    tool_parser: how chat answers are read (shared/reasoning.py, shared/tool_calls.py)."""
    firsts = cs[::req.n]  # each prompt's first choice
    want_logprobs = params.logprobs is not None
    u = usage(sum(len(c.prompt_token_ids) for c in firsts), sum(len(c.token_ids) for c in cs),
              sum(c.num_cached_tokens for c in firsts),
              prediction_usage(params.prediction, [c.token_ids for c in cs]) if params.prediction else None)
    dec = req.token_text(llm.tokenizer)  # what names a token in logprobs
    choices, extras = [], []  # the latter: vLLM's fields of each choice's prompt
    chat = kind == "chat"
    state = prompt_state(llm.tokenizer, cs[0].prompt_token_ids) if chat and reasoning else None  # one prompt
    echoed = req.echoed() if chat else ""
    for i, c in enumerate(cs):
        extras.append(fields := prompt_fields(req, c.prompt_token_ids, c.prompt_logprobs, llm.tokenizer.decode))
        if chat:
            lp = chat_logprobs(c.token_ids, c.logprobs, dec) if want_logprobs else None
            mode = req.tool_mode()
            thought, answer = split_answer(reasoning, c.text, req.include_reasoning, state)
            content, calls = tool_calls.read_calls(mode, answer, req.tool_choice.function["name"]
                                                   if mode == "named" else None, tool_parser, req.parallel_tool_calls)
            if echoed:
                content = echoed + (content or "")
            finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            choices.append(chat_choice(i, content, finish, lp, [t.openai() for t in calls] or None))
            choices[-1]["message"].update(thought)
            if req.return_token_ids:
                choices[-1]["token_ids"] = c.token_ids
            continue
        lp = completion_logprobs(c.token_ids, c.logprobs, dec) if want_logprobs else None
        text = c.text
        if req.echo:
            prompt_text = texts[i // req.n]
            if want_logprobs:
                plp = completion_logprobs(c.prompt_token_ids, c.prompt_logprobs or [None] * len(c.prompt_token_ids),
                                          dec, top=req.logprobs)
                lp = join_logprobs(plp, completion_logprobs(c.token_ids, c.logprobs, dec, len(prompt_text)))
            text = prompt_text + text
        choices.append(completion_choice(i, text, c.finish_reason, lp) | fields)
        if req.return_token_ids:
            choices[-1]["token_ids"] = c.token_ids
    build = chat_response if kind == "chat" else completion_response
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    out = build(f"{prefix}-{req.request_id}" if req.request_id else new_id(prefix), served, "", None, u,
                choices=choices)
    if kind == "chat":  # vLLM's place for chat: the one prompt's, beside the choices
        out.update(extras[0])
    return out


def run_batch(llm: LLM, inp: IO[bytes], out: IO[bytes], served: str, reasoning: str | None = None,
              tool_parser: str | None = None) -> tuple[int, int]:
    """Returns (succeeded, failed). reasoning, tool_parser: how chat answers are read
    (--reasoning-parser, --tool-call-parser)."""
    from meshserve.shared.engine.llm_engine import RequestError

    results: list[dict | None] = []
    pending: list[tuple[int, str, object, list[Completion], list[str], object, object]] = []
    for line in inp:
        if not line.strip():
            continue
        cid = None
        try:
            item = _read_line(line)
            cid = item.get("custom_id")
            kind, req, prompts, texts, params = _prepare(llm, item, served, reasoning)
            cs = _add(llm, prompts, params, req.n, req.cache_salt)
            pending.append((len(results), kind, req, cs, texts, params, cid))
            results.append(None)
        except OpenAIError as e:
            results.append(_error_result(cid, e))
        except RequestError as e:
            results.append(_error_result(cid, OpenAIError(str(e))))
    llm.run()
    for i, kind, req, cs, texts, params, cid in pending:
        failed = next((c.error for c in cs if c.error), None)
        results[i] = _error_result(cid, OpenAIError(f"generation failed: {failed}")) if failed else \
            _result(cid, 200, _body(llm, kind, served, req, cs, texts, params, reasoning, tool_parser))
    return write_results(results, out)


def write_results(results: list[dict], out: IO[bytes]) -> tuple[int, int]:
    """Writes the result lines; returns (succeeded, failed)."""
    failed = 0
    for r in results:
        failed += r["response"]["status_code"] != 200
        out.write(orjson.dumps(r) + b"\n")
    return len(results) - failed, failed


def main(args) -> int:
    if getattr(args, "url", None):
        from .batch_remote import main as remote_main

        return remote_main(args)
    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.llm_engine import EngineConfig

    # The files first: a wrong path is told at once, not after loading the model.
    inp = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")
    out = sys.stdout.buffer if args.output == "-" else open(args.output, "wb")
    with inp, out:
        llm = LLM(args.model, args.dtype, EngineConfig(), quantization=args.quantization)
        served = args.served_model_name or args.model
        ok, failed = run_batch(llm, inp, out, served, getattr(args, "reasoning_parser", None),
                               getattr(args, "tool_call_parser", None))
    print(f"{ok} succeeded, {failed} failed", file=sys.stderr)
    return 0

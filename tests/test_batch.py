"""`meshserve batch` as a user runs it: a real subprocess, the OpenAI Batch file format."""

from __future__ import annotations

import subprocess
import sys

import json

import jsonschema
import orjson

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}}, "required": ["x", "ok"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}


def test_batch_command(tiny_llama, tmp_path):
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0,
                  "return_token_ids": True, "request_id": "line-1"}},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "logprobs": 2}},
        {"custom_id": "ids", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0.8, "seed": 3}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "bad-param", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "top_p": 7}},
        {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "max_tokens": 100000}},
        # issue 10's fields through the in-process engine
        {"custom_id": "n", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The quick brown fox", "max_tokens": 4, "n": 3, "seed": 5}},
        {"custom_id": "schema", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "JSON"}], "max_tokens": 60, "temperature": 0,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}},
        {"custom_id": "tool", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 60, "temperature": 0,
                  "tools": [TOOL], "tool_choice": "required"}},
        {"custom_id": "echo", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The quick brown fox", "max_tokens": 0, "echo": True, "logprobs": 1,
                  "prompt_logprobs": 2}},
        # a batch of prompts in one line: each prompt's choices, in order; one too long fails the line
        {"custom_id": "prompts", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": ["Hello there", "The quick brown fox"], "max_tokens": 5, "temperature": 0, "echo": True}},
        {"custom_id": "prompts-too-long", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": ["x", "x " * 300], "max_tokens": 2}},
        # --reasoning-parser qwen3: an answer opening with <think> comes apart (forced here by a regex)
        {"custom_id": "think", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Think"}], "max_tokens": 30,
                  "guided_regex": "<think>hm</think>ok"}},
        {"custom_id": "think-hidden", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Think"}], "max_tokens": 30,
                  "guided_regex": "<think>hm</think>ok", "include_reasoning": False}},
        # --tool-call-parser llama3_json: an answer that is a JSON call is a call under tool_choice auto
        {"custom_id": "llama3-call", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 40, "tools": [TOOL],
                  "guided_regex": r'\{"name": "weather", "parameters": \{"city": "Paris", "days": 2\}\}'}},
        # OpenAI's predicted outputs: the same answer, and how much of the prediction it took
        {"custom_id": "predicted", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 12, "temperature": 0,
                  "prediction": {"type": "content", "content": "The weather is nice and sunny today"}}},
        {"custom_id": "unpredicted", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 12, "temperature": 0}},
        # a regex that needs a token allowed_token_ids leaves out: the line fails, saying so
        {"custom_id": "no-token", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Hi", "max_tokens": 5, "guided_regex": "yes", "allowed_token_ids": [5, 6]}},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\nnot json\n")
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "batch", "-i", str(inp), "-o", str(out),
                        "--model", str(tiny_llama), "--dtype", "float32", "--served-model-name", "tiny",
                        "--reasoning-parser", "qwen3", "--tool-call-parser", "llama3_json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert [x["custom_id"] for x in results] == [x["custom_id"] for x in lines] + [None]
    by = {x["custom_id"]: x for x in results}
    think = by["think"]["response"]["body"]["choices"][0]["message"]
    assert (think["reasoning_content"], think["content"]) == ("hm", "ok")
    call = by["llama3-call"]["response"]["body"]["choices"][0]
    assert call["finish_reason"] == "tool_calls" and call["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in call["message"]["tool_calls"]] \
        == [("weather", {"city": "Paris", "days": 2})]
    hidden = by["think-hidden"]["response"]["body"]["choices"][0]["message"]
    assert "reasoning_content" not in hidden and hidden["content"] == "ok"
    chat = by["chat"]["response"]["body"]  # vLLM's fields: request_id, return_token_ids
    assert chat["id"] == "chatcmpl-line-1" and len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    for cid in ("chat", "text", "ids"):
        assert by[cid]["response"]["status_code"] == 200 and by[cid]["error"] is None
        body = by[cid]["response"]["body"]
        assert body["model"] == "tiny" and body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert by["chat"]["response"]["body"]["object"] == "chat.completion"
    assert isinstance(by["chat"]["response"]["body"]["choices"][0]["message"]["content"], str)
    lp = by["text"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == by["text"]["response"]["body"]["usage"]["completion_tokens"]
    assert by["ids"]["response"]["body"]["usage"]["prompt_tokens"] == 4
    for cid in ("bad-url", "bad-param", "too-long", "prompts-too-long", "no-token", None):
        assert by[cid]["response"]["status_code"] == 400
        assert by[cid]["response"]["body"]["error"]["message"]
        assert by[cid]["error"]["message"]
    assert "top_p" in by["bad-param"]["response"]["body"]["error"]["message"]
    assert "allowed_token_ids and the response format together allow none" in by["no-token"]["error"]["message"]
    predicted = by["predicted"]["response"]["body"]
    details = predicted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] > 0
    assert predicted["choices"][0]["message"] == by["unpredicted"]["response"]["body"]["choices"][0]["message"]
    assert "13 succeeded, 6 failed" in r.stderr
    n = by["n"]["response"]["body"]
    assert [c["index"] for c in n["choices"]] == [0, 1, 2] and n["usage"]["completion_tokens"] == 12
    assert len({c["text"] for c in n["choices"]}) > 1  # seed, seed + 1, seed + 2
    jsonschema.validate(json.loads(by["schema"]["response"]["body"]["choices"][0]["message"]["content"]), SCHEMA)
    tool = by["tool"]["response"]["body"]["choices"][0]
    assert tool["finish_reason"] == "tool_calls" and tool["message"]["content"] is None
    call = tool["message"]["tool_calls"][0]
    assert call["function"]["name"] == "weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL["function"]["parameters"])
    batch = by["prompts"]["response"]["body"]
    text_prompt = by["text"]["response"]["body"]["usage"]["prompt_tokens"]
    assert [c["index"] for c in batch["choices"]] == [0, 1] and batch["usage"]["prompt_tokens"] > text_prompt
    assert batch["choices"][0]["text"].startswith("Hello there")
    assert batch["choices"][1]["text"] == "The quick brown fox" + by["text"]["response"]["body"]["choices"][0]["text"]
    echo = by["echo"]["response"]["body"]["choices"][0]
    assert echo["text"] == "The quick brown fox" and echo["logprobs"]["token_logprobs"][0] is None
    assert len(echo["logprobs"]["tokens"]) == by["echo"]["response"]["body"]["usage"]["prompt_tokens"] > 1
    assert all(v < 0 for v in echo["logprobs"]["token_logprobs"][1:])
    assert all(len(top) == 1 for top in echo["logprobs"]["top_logprobs"][1:])  # logprobs=1 alternative
    plp = echo["prompt_logprobs"]  # vLLM's, with its own 2 alternatives, equal to echo's logprobs
    assert plp[0] is None and len(plp) == len(echo["logprobs"]["tokens"])
    for entry, v in zip(plp[1:], echo["logprobs"]["token_logprobs"][1:]):
        assert 2 <= len(entry) <= 3 and v in [e["logprob"] for e in entry.values()]

"""The gateway's wider OpenAI surface, against a real gateway process and a real nats-server:
/tokenize and /detokenize, /v1/responses through the official openai client, the OpenAPI schema
checked against real responses, a client that hangs up while waiting, and a request that waits for
a starting mesh. The mesh behind it is test_gateway's StandIn (scripted tokens), as there."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from test_gateway import (NS, SCRIPT, SERVED, SLOW, StandIn, check_error, free_port, nats_url,  # noqa: F401
                          tokenizer, wait_for)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def gw(nats_url, tiny_llama, tmp_path_factory):  # noqa: F811
    """A gateway process: (base URL, its log file). Requests wait up to 20 s for a starting mesh."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("surface") / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshserve.services.gateway.main", "--nats-url", nats_url, "--namespace", NS,
             "--port", str(port), "--model", str(tiny_llama), "--served-model-name", SERVED,
             "--max-model-len", "128", "--stream-timeout", "5", "--ready-timeout", "20"],
            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, log_path.read_text()
        try:
            return httpx.get(f"{base}/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 60, "the gateway")
    yield base, log_path
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log_path.read_text()


@pytest.fixture
def base(gw):
    return gw[0]


@pytest.fixture
def mesh(nats_url, tokenizer):  # noqa: F811
    with StandIn(nats_url, tokenizer) as m:
        yield m


@pytest.fixture
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=20)


def errors_logged(log_path) -> list[str]:
    return [line for line in log_path.read_text().splitlines()
            if any(w in line for w in ("ERROR", "Traceback", "InvalidStateError", "internal error"))]


# ------------------------------------------------------------------ /tokenize, /detokenize


def test_tokenize_detokenize_round_trip(base, tokenizer):  # noqa: F811
    text = "Hello world! The quick brown fox, 42 times."
    r = httpx.post(f"{base}/tokenize", json={"model": SERVED, "prompt": text, "add_special_tokens": False,
                                             "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 128
    assert body["token_strs"] == [tokenizer.id_to_token(t) for t in body["tokens"]]
    back = httpx.post(f"{base}/detokenize", json={"model": SERVED, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    again = httpx.post(f"{base}/tokenize", json={"prompt": back.json()["prompt"], "add_special_tokens": False})
    assert again.json()["tokens"] == body["tokens"] and again.json()["token_strs"] is None
    # add_special_tokens (the default) is what a completion's prompt gets
    plain = httpx.post(f"{base}/tokenize", json={"prompt": text}).json()
    assert plain["tokens"] == tokenizer.encode(text)


def test_tokenize_messages_is_the_chat_prompt(base, mesh, client, tokenizer):  # noqa: F811
    r = httpx.post(f"{base}/tokenize", json={"model": SERVED, "messages": CHAT}).json()
    want = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    assert r["tokens"] == want and r["count"] == len(want)
    client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=2)
    assert mesh.submits[-1].prompt_token_ids == r["tokens"]  # exactly what a chat request sends
    # detokenized, it is the rendered template, special tokens and all
    text = httpx.post(f"{base}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text == tokenizer.apply_chat_template(CHAT)
    no_prompt = httpx.post(f"{base}/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=False),
                                                   add_special_tokens=False)


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("/detokenize", {"model": "gpt-9", "tokens": [5]}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True}, 400,
     "continue_final_message"),  # the last message is the user's: nothing to continue
    ("/detokenize", {"tokens": [5, 10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenize_errors(base, path, body, status, param):
    check_error(httpx.post(base + path, json=body), status, param)


# ------------------------------------------------------------------ /v1/responses


def test_responses_not_streamed(client, mesh, tokenizer):  # noqa: F811
    r = client.responses.create(model=SERVED, input="Hello there", instructions="Be brief.", max_output_tokens=5,
                                temperature=0.5, top_p=0.9, extra_body={"top_k": 7, "priority": "interactive"})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == SERVED
    assert r.output_text == tokenizer.decode(mesh.script[:5])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.usage.input_tokens_details.cached_tokens == 3
    assert r.instructions == "Be brief." and r.max_output_tokens == 5 and r.temperature == 0.5
    sub = mesh.submits[-1]  # the chat request it became
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert sub.prompt_token_ids == tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert r.usage.input_tokens == len(sub.prompt_token_ids)
    assert (sub.sampling.temperature, sub.sampling.top_p, sub.sampling.top_k, sub.sampling.max_tokens) == \
        (0.5, 0.9, 7, 5)
    assert sub.priority == "interactive"
    # messages with input_text parts, an assistant turn as output_text; to the end of the output
    r = client.responses.create(model=SERVED, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "!"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "Tell me more."}])
    assert r.status == "completed" and r.output_text == tokenizer.decode(mesh.script)
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    turns = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Tell me more."}]
    assert mesh.submits[-1].prompt_token_ids == tokenizer.encode(tokenizer.apply_chat_template(turns),
                                                                 add_special_tokens=False)


def test_responses_streamed(client, mesh, tokenizer):  # noqa: F811
    events = list(client.responses.create(model=SERVED, input="Hi", max_output_tokens=7, stream=True,
                                          top_logprobs=1, include=["message.output_text.logprobs"]))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    want = tokenizer.decode(mesh.script[:7])
    assert len(deltas) > 1 and "".join(d.delta for d in deltas) == want
    assert sum(len(d.logprobs) for d in deltas) == 7 and deltas[0].logprobs[0].logprob == -0.5
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == want and all(e.item_id == done.item_id for e in deltas)
    final = events[-1].response
    assert final.output_text == want and final.usage.output_tokens == 7 and final.status == "incomplete"
    assert len(final.output[0].content[0].logprobs) == 7
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    # to the end of the output: response.completed; the stream helper accumulates the same text
    with client.responses.stream(model=SERVED, input="Hi") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == tokenizer.decode(mesh.script)


WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_responses_function_tools(client, mesh, tokenizer, base):  # noqa: F811
    """Function tools on /v1/responses are chat's: the model's call (here Hermes-style, scripted) is a
    `function_call` output item, whole and streamed (its arguments in one delta); the function's
    output goes back as a `function_call_output` item, which reaches the chat template as the
    assistant's tool call and the tool's message. (Text before calls, several calls and
    parallel_tool_calls: test_request_options_mesh.py, whose model has room for them.)"""
    mesh.script = tokenizer.encode(CALL, add_special_tokens=False)
    r = client.responses.create(model=SERVED, input="Weather in Paris?", tools=[WEATHER])
    (item,) = r.output
    assert (item.type, item.name, json.loads(item.arguments), item.status) == ("function_call", "weather",
                                                                                {"city": "Paris"}, "completed")
    assert item.call_id.startswith("call_") and item.id.startswith("fc_") and r.status == "completed"
    assert r.tools[0].name == "weather"
    events = list(client.responses.create(model=SERVED, input="Weather in Paris?", tools=[WEATHER], stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "response.completed"]
    assert events[4].arguments == events[3].delta == item.arguments and events[-1].response.output[0].name == "weather"
    with client.responses.stream(model=SERVED, input="Weather?", tools=[WEATHER]) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output[0].arguments == item.arguments
    doc = httpx.get(f"{base}/openapi.json").json()  # the document describes these bodies and events too
    body = {"input": "Weather?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "weather"}}
    _validator(doc, "ResponseObject").validate(httpx.post(f"{base}/v1/responses", json=body, timeout=20).json())
    with httpx.stream("POST", f"{base}/v1/responses", json={**body, "stream": True}, timeout=20) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                _validator(doc, "ResponseEvent").validate(json.loads(line[6:]))
    # the call and its output, sent back: the chat messages a chat request with the same turns has
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": item.call_id, "name": "weather", "arguments": item.arguments},
             {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}]
    client.responses.create(model=SERVED, input=turns, tools=[WEATHER])
    chat = [turns[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": item.call_id, "type": "function", "function": {"name": "weather", "arguments": item.arguments}}]},
        {"role": "tool", "tool_call_id": item.call_id, "content": "sunny"}]
    want = httpx.post(f"{base}/tokenize", json={"model": SERVED, "messages": chat,
                                                "tools": [{"type": "function", "function": {
                                                    k: v for k, v in WEATHER.items() if k != "type"}}]}).json()
    assert mesh.submits[-1].prompt_token_ids == want["tokens"]


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "web_search"}]),  # hosted tools: this server runs none
    ("tools", [{"type": "function", "name": "f", "parameters": {"type": "object"}, "defer_loading": True}]),
    ("tool_choice", {"type": "file_search"}),
    ("previous_response_id", "resp_123"),
    ("store", True),
    ("background", True),
    ("conversation", "conv_1"),
    ("truncation", "auto"),
    ("reasoning", {"effort": "high"}),  # this model's chat template does not read reasoning_effort
    ("reasoning", {"summary": "auto"}),
    ("include", ["file_search_call.results"]),
    ("max_tokens", 5),
    ("messages", [{"role": "user", "content": "hi"}]),
    ("n", 2),
    ("presence_penalty", 3),  # a chat option out of its range, refused by the chat path itself
    ("temperature", 5),
])
def test_responses_refuses_what_it_does_not_honour(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=SERVED, input="hi", extra_body={field: value})
    err = e.value.body
    assert e.value.status_code == 400 and set(err) == {"message", "type", "param", "code"}
    assert field in (err["param"] or "") + err["message"], err


def test_responses_input_errors(base, mesh):
    for item, param in (({"type": "item_reference", "id": "msg_1"}, "input.0.type"),
                        ({"type": "function_call_output", "output": "x"}, "input.0.call_id"),
                        ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "input.0"),
                        ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]},
                         "input.0.content.0.type")):
        check_error(httpx.post(f"{base}/v1/responses", json={"input": [item]}), 400, param)
    check_error(httpx.post(f"{base}/v1/responses", json={"model": "gpt-9", "input": "hi"}), 404, "model")
    check_error(httpx.post(f"{base}/v1/responses", json={"instructions": "x"}), 400, "input")
    # inert fields are accepted
    r = httpx.post(f"{base}/v1/responses", json={"input": "hi", "user": "u", "metadata": {"k": "v"}, "store": False,
                                                 "parallel_tool_calls": False, "tool_choice": "none", "tools": []})
    assert r.status_code == 200 and r.json()["status"] == "completed", r.text


# ------------------------------------------------------------------ the OpenAPI schema


def _validator(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


def test_openapi_describes_the_real_bodies(base, mesh, client):
    doc = httpx.get(f"{base}/openapi.json").json()
    paths = doc["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize", "/v1/models",
            "/health", "/metrics"} <= set(paths)
    jsonschema.Draft202012Validator.check_schema({"components": doc["components"]})

    def schema_of(path: str, status: str = "200", method: str = "post") -> str:
        return paths[path][method]["responses"][status]["content"]["application/json"]["schema"]["$ref"].rsplit("/")[-1]

    def request_schema(path: str) -> dict:
        return {**paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"],
                "components": doc["components"]}

    calls = [  # path, body, the response's schema (None: the route's own)
        ("/v1/completions", {"model": SERVED, "prompt": "x", "max_tokens": 3, "logprobs": 1}),
        ("/v1/chat/completions", {"model": SERVED, "messages": CHAT, "max_tokens": 3, "logprobs": True,
                                  "top_logprobs": 1}),
        ("/v1/responses", {"model": SERVED, "input": "x", "max_output_tokens": 3}),
        ("/tokenize", {"prompt": "hello", "return_token_strs": True}),
        ("/tokenize", {"messages": CHAT}),
        ("/detokenize", {"tokens": [5, 6, 7]}),
    ]
    for path, body in calls:
        jsonschema.validate(body, request_schema(path))
        r = httpx.post(base + path, json=body, timeout=20)
        assert r.status_code == 200, r.text
        _validator(doc, schema_of(path)).validate(r.json())
    for path, method in (("/v1/models", "get"), ("/health", "get")):
        _validator(doc, schema_of(path, method=method)).validate(httpx.get(base + path).json())
    # errors: the documented error body
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "top_p": 0})
    assert r.status_code == 400
    _validator(doc, schema_of("/v1/completions", "400")).validate(r.json())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"max_tokens": 3}, request_schema("/v1/completions"))  # no prompt: not a valid body
    # streams: every chunk, and every event, validates against the schemas the document names
    for path, body, chunk_schema in (
            ("/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": True,
                                 "stream_options": {"include_usage": True}}, "CompletionChunk"),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "stream": True,
                                      "stream_options": {"include_usage": True}}, "ChatCompletionChunk"),
            ("/v1/responses", {"input": "x", "max_output_tokens": 4, "stream": True}, "ResponseEvent")):
        assert chunk_schema in paths[path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"][
            "description"]
        v = _validator(doc, chunk_schema)
        with httpx.stream("POST", base + path, json=body, timeout=20) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        objects = [json.loads(d) for d in data if d != "[DONE]"]
        assert len(objects) >= 3
        for o in objects:
            v.validate(o)


# ------------------------------------------------------------------ a client that hangs up while waiting


def test_client_gone_while_waiting_logs_no_error(gw, mesh, client):
    base, log_path = gw
    port = int(base.rsplit(":", 1)[1])
    before = len(mesh.submits)
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 30, "seed": SLOW}),
                       ("/v1/responses", {"input": "x", "max_output_tokens": 30, "seed": SLOW})):
        data = json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        wait_for(lambda: len(mesh.submits) > before, 10, "the submission")
        before = len(mesh.submits)
        sock.close()  # while the gateway waits for the tokens
        rid = mesh.submits[-1].request_id
        assert wait_for(lambda: mesh.aborted(rid), 5, "the disconnect Abort")
    # (an error would have been logged before the Abort was even published)
    assert errors_logged(log_path) == []
    assert client.completions.create(model=SERVED, prompt="x", max_tokens=2).usage.completion_tokens == 2


# ------------------------------------------------------------------ a request that arrives before the mesh


def test_request_waits_for_a_starting_mesh(base, nats_url, tokenizer, gw):  # noqa: F811
    """No scheduler at first: the request waits (the gateway's --ready-timeout is 20 s) and completes once
    one is up, instead of a 503. (tests/test_startup.py does the same with `meshserve up`.)"""
    assert httpx.get(f"{base}/health").status_code == 503
    got = {}

    def ask():
        got["r"] = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)

    asked = threading.Event()
    watcher = _StatusWatcher(nats_url, asked)  # sees the waiting request ask whether the mesh is ready
    t = threading.Thread(target=ask)
    t.start()
    try:
        assert asked.wait(10), "the request did not ask the scheduler whether it is ready"
    finally:
        watcher.stop()
    assert t.is_alive(), got["r"].text
    with StandIn(nats_url, tokenizer) as m:
        t.join(25)
        assert not t.is_alive()
        r = got["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(m.script[:3])
    assert errors_logged(gw[1]) == []


class _StatusWatcher:
    """Listens (without answering) on the scheduler's status subject, on its own thread and loop."""

    def __init__(self, url: str, seen: threading.Event):
        import asyncio

        from meshserve.shared.bus import Bus

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            self.bus = await Bus.connect(url, namespace=NS)

            async def on_status(msg):
                seen.set()

            await self.bus.nc.subscribe(self.bus.subjects.scheduler_status, cb=on_status)
            await self.bus.nc.flush()

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def stop(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.bus.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


# ------------------------------------------------------------------ meshserve bench with the server's tokenizer


def test_bench_uses_the_servers_tokenize(base, mesh, tmp_path, tokenizer):  # noqa: F811
    """The served name ("tiny") is no model bench knows: it builds prompts from the server's /tokenize,
    so their lengths are exact in the server's tokens."""
    import yaml

    wl = tmp_path / "w.yaml"
    wl.write_text(yaml.safe_dump({"name": "w", "num_requests": 4, "prompt_len": {"dist": "uniform", "low": 5,
                                                                                "high": 20}, "output_len": 2}))
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "bench", "--url", f"{base}/v1", "--model", SERVED,
                        "--workload", str(wl), "--seed", "1", "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    report = json.loads(r.stdout)
    assert report["tokenizer"] == f"{base}/tokenize" and report["completed"] == 4
    from meshserve.bench.workload import load_workload

    want = sorted(q.prompt_len for q in load_workload(wl).generate(1, vocab_size=100))
    sent = mesh.submits[-4:]
    assert sorted(len(s.prompt_token_ids) for s in sent) == want  # exact lengths
    special = {0, 1, 2}  # the tiny tokenizer's special tokens: never drawn
    assert all(0 <= t < tokenizer.vocab_size and t not in special for s in sent for t in s.prompt_token_ids)

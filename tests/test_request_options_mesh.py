"""Issue 10's request options through a real mesh (`meshserve up`, one prefill and one decode worker,
so prompts over 32 tokens are prefilled on one worker and decoded on the other), with the official
openai client: structured outputs (many schemas at once, greedy and sampled, streamed and not,
beside unconstrained requests, across the handoff, and over the NATS API), tool calls, n choices,
logit_bias, allowed tokens and bad words, the model's own generation defaults, echo with prompt
logprobs against Transformers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import time

import httpx
import jsonschema
import nats
import orjson
import pytest
import torch
from json_schemas import SCHEMAS
import openai
from openai import AsyncOpenAI, OpenAI

from mesh_util import Mesh
from meshserve.shared.tokenizer import Tokenizer
from tiny_model import make_tiny_llama

# Over 32 tokens: the prefill worker computes it, then hands it to the decode worker.
LONG = "Answer in JSON: the weather in Paris today, with numbers."  # 35 tokens, 74 as a chat
TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
DEFAULTS = {"repetition_penalty": 1.2, "top_p": 0.95}  # the model's generation_config.json


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = make_tiny_llama(tmp_path_factory.mktemp("tiny-defaults"))
    cfg = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**cfg, **DEFAULTS}))
    return d


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mesh(model_dir, tmp_path_factory):
    # --reasoning-parser qwen3: an answer that does not open with <think> (all the random model's) is
    # unchanged; test_reasoning_content_apart forces one that does
    with Mesh(model_dir, tmp_path_factory.mktemp("mesh-options"), prefill=1, decode=1,
              extra=["--trust-request-chat-template", "--reasoning-parser", "qwen3"]) as m:
        m.client = OpenAI(base_url=m.url + "/v1", api_key="unused")
        m.tokenizer = Tokenizer.from_hf_dir(model_dir)
        yield m


def chat(content: str = LONG) -> list[dict]:
    return [{"role": "user", "content": content}]


async def _one_schema(client: AsyncOpenAI, model: str, i: int, schema: dict):
    kw = dict(model=model, messages=chat(), max_tokens=120, temperature=0 if i % 2 else 1.0, seed=i,
              response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                      "strict": True}})
    if i % 3:  # streamed
        text, finish = "", None
        async for c in await client.chat.completions.create(stream=True, **kw):
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        return text, finish
    r = await client.chat.completions.create(**kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


async def _all_schemas(mesh):
    client = AsyncOpenAI(base_url=mesh.url + "/v1", api_key="unused")
    free = [client.chat.completions.create(model=mesh.model, messages=chat(), max_tokens=16, temperature=0)
            for _ in range(4)]
    out = await asyncio.gather(*(_one_schema(client, mesh.model, i, s) for i, s in enumerate(SCHEMAS)), *free)
    await client.close()
    return out[:len(SCHEMAS)], out[len(SCHEMAS):]


def test_json_schemas_all_at_once_across_the_handoff(mesh):
    replies, free = asyncio.run(_all_schemas(mesh))
    for (text, finish), schema in zip(replies, SCHEMAS):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert all(r.usage.completion_tokens == 16 for r in free)
    # Both workers streamed: the first tokens on the prefill worker, the rest on the decode worker
    # (heartbeats carry the counts, every 0.5 s: the last one may not be in yet).
    deadline, streamed = time.monotonic() + 10, {}
    while time.monotonic() < deadline:
        streamed = {w["role"]: w["tokens_streamed"] > 0 for w in mesh.ask("scheduler.status")["workers"]}
        if streamed == {"prefill": True, "decode": True}:
            break
        time.sleep(0.25)
    fallbacks = [ln for ln in mesh.log.read_text().splitlines() if "no decode worker" in ln][:5]
    assert streamed == {"prefill": True, "decode": True}, fallbacks


def test_structured_output_over_nats_and_vllm_fields(mesh):
    async def ask(body):
        nc = await nats.connect(mesh.nats_url)
        try:
            return orjson.loads((await nc.request(f"{mesh.namespace}.v1.completions", orjson.dumps(body),
                                                  timeout=120)).data)
        finally:
            await nc.close()

    schema = SCHEMAS[7]
    r = asyncio.run(ask({"prompt": LONG, "max_tokens": 100, "guided_json": schema, "seed": 1}))
    jsonschema.validate(json.loads(r["choices"][0]["text"]), schema)
    c = mesh.client
    r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=20, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=20, temperature=0,
                             extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].text)
    r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=30, temperature=0,
                             extra_body={"guided_grammar": 'start: "(" d ("+" d)* ")"\nd: /[0-9]/'})
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", r.choices[0].text)


def _reassemble(stream) -> tuple[dict[int, dict], str, str | None]:
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            if tc.function:
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return calls, content, finish


def test_tool_calls(mesh):
    c = mesh.client
    tools = [TOOL, OTHER]
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    # required: always valid calls of declared functions, arguments matching
    for seed in range(3):
        r = c.chat.completions.create(model=mesh.model, messages=chat(), tools=tools, tool_choice="required",
                                      max_tokens=80, seed=seed)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls
        for call in ch.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    # a named function, streamed and not: the deltas reassemble to the same call
    kw = dict(model=mesh.model, messages=chat(), tools=tools, max_tokens=80, temperature=0,
              tool_choice={"type": "function", "function": {"name": "weather"}})
    call = c.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    assert call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    calls, content, finish = _reassemble(c.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert (calls[0]["name"], calls[0]["arguments"]) == ("weather", call.function.arguments) and calls[0]["id"]
    # auto: the model's own Hermes-style call is read back. A random model would not write one, so
    # the regex makes it write exactly that format (a call with a free choice of city).
    hermes = r'Sure\. <tool_call>\n\{"name": "weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'
    kw = dict(model=mesh.model, messages=chat(), tools=tools, tool_choice="auto", max_tokens=80, seed=4,
              extra_body={"guided_regex": hermes})
    ch = c.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure."
    args = json.loads(ch.message.tool_calls[0].function.arguments)
    jsonschema.validate(args, TOOL["function"]["parameters"])
    calls, content, finish = _reassemble(c.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content.strip() == "Sure." and json.loads(calls[0]["arguments"]) == args
    # two calls: both, or with parallel_tool_calls false only the first (vLLM's rule), whole and streamed
    two = hermes + r'\n<tool_call>\n\{"name": "weather", "arguments": \{"city": "Oslo", "days": 3\}\}\n</tool_call>'
    kw["extra_body"], kw["max_tokens"] = {"guided_regex": two}, 180
    assert [json.loads(t.function.arguments)["city"] for t in c.chat.completions.create(**kw).choices[0]
            .message.tool_calls][1:] == ["Oslo"]
    one = c.chat.completions.create(**kw, parallel_tool_calls=False).choices[0].message.tool_calls
    assert [json.loads(t.function.arguments) for t in one] == [args]
    calls, content, finish = _reassemble(c.chat.completions.create(stream=True, parallel_tool_calls=False, **kw))
    assert finish == "tool_calls" and [json.loads(x["arguments"]) for x in calls.values()] == [args]
    # /v1/responses: the message, then each call as a function_call item (one with parallel_tool_calls false)
    kw2 = dict(model=mesh.model, input=chat(), max_output_tokens=180, tools=[{"type": "function", **TOOL["function"]}],
               extra_body={"guided_regex": two})
    for parallel, calls in ((True, 2), (False, 1)):
        r = c.responses.create(**kw2, parallel_tool_calls=parallel, temperature=0)
        assert [o.type for o in r.output] == ["message"] + ["function_call"] * calls
        cities = [json.loads(o.arguments)["city"] for o in r.output[1:]]
        assert r.output[0].content[0].text.strip() == "Sure." and cities[0] in ("Paris", "Rome")
        assert cities[1:] == ["Oslo"][:calls - 1]
    # the history with an assistant call and the tool's answer is accepted
    history = chat() + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = c.chat.completions.create(model=mesh.model, messages=history, tools=tools, max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_n_choices_logit_bias_and_generation_defaults(mesh, hf):
    c = mesh.client
    # n: each choice is the seeded stream seed + index; streamed chunks carry their choice's index
    r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=8, n=3, seed=11, temperature=1.0)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    alone = [c.completions.create(model=mesh.model, prompt=LONG, max_tokens=8, seed=11 + i, temperature=1.0)
             .choices[0].text for i in range(3)]
    assert [ch.text for ch in r.choices] == alone and len(set(alone)) > 1
    texts = {0: "", 1: "", 2: ""}
    for chunk in c.completions.create(model=mesh.model, prompt=LONG, max_tokens=8, n=3, seed=11, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert list(texts.values()) == alone
    # prefill once: a fresh 38-token prompt, three choices; the second and third find its full blocks
    before = mesh.ask("scheduler.status")["prefix_hits"]
    fresh = "Tomorrow, " + LONG  # shifted: none of its blocks is cached yet
    n_prompt = len(mesh.tokenizer.encode(fresh))
    c.completions.create(model=mesh.model, prompt=fresh, max_tokens=2, n=3)
    full = n_prompt // 16 * 16
    deadline = time.monotonic() + 10  # the workers' counters reach the scheduler with their heartbeats
    while mesh.ask("scheduler.status")["prefix_hits"] - before < 2 * full and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mesh.ask("scheduler.status")["prefix_hits"] - before >= 2 * full > 0
    # chat with n
    r = c.chat.completions.create(model=mesh.model, messages=chat(), max_tokens=4, n=2, seed=3)
    assert [ch.index for ch in r.choices] == [0, 1]
    # logit_bias: +100 on one token makes it the whole output
    tok = mesh.tokenizer.encode(" the")[0]
    r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=5, logit_bias={str(tok): 100})
    assert r.choices[0].text == mesh.tokenizer.decode([tok] * 5)
    # the model's generation defaults: shown, and applied (repetition_penalty 1.2 here) when unset
    model = c.models.list().data[0]
    assert model.model_extra["generation_defaults"] == DEFAULTS
    ids = mesh.tokenizer.encode(LONG)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=12, min_new_tokens=12, do_sample=False, repetition_penalty=1.2,
                          eos_token_id=[2],
                          pad_token_id=0)[0, len(ids):].tolist()
    r = c.completions.create(model=mesh.model, prompt=ids, max_tokens=12, temperature=0,
                             extra_body={"min_tokens": 12})
    assert r.choices[0].text == mesh.tokenizer.decode(ref)


def test_allowed_tokens_and_bad_words_match_transformers(mesh, hf):
    """vLLM's allowed_token_ids and bad_words through the mesh, against Transformers' generate with
    the same restriction (`prefix_allowed_tokens_fn`, `bad_words_ids` of the word's two forms), the
    model's repetition_penalty default applying to both."""
    c, tok = mesh.client, mesh.tokenizer
    ids = tok.encode(LONG)

    def reference(**kw) -> str:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=10, min_new_tokens=10, do_sample=False, repetition_penalty=1.2,
                              eos_token_id=[2], pad_token_id=0, **kw)[0, len(ids):].tolist()
        return tok.decode(out)

    def ours(**body) -> str:
        return c.completions.create(model=mesh.model, prompt=ids, max_tokens=10, temperature=0,
                                    extra_body={"min_tokens": 10, **body}).choices[0].text

    plain = ours()
    allowed = tok.encode(" the weather in Paris", add_special_tokens=False)
    got = got_allowed = ours(allowed_token_ids=allowed)
    assert got == reference(prefix_allowed_tokens_fn=lambda batch, sent: allowed) and got != plain
    with torch.inference_mode():
        first = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=4, do_sample=False, repetition_penalty=1.2, pad_token_id=0)[0, len(ids):]
    word = tok.decode(first[1:3].tolist()).strip()  # a word the model would write
    forms = [tok.encode(f, add_special_tokens=False) for f in (word, " " + word)]
    assert word and all(ids[-len(f) + 1:] != f[:-1] for f in forms if len(f) > 1)  # no match across the prompt's end
    got = ours(bad_words=[word])
    assert got == reference(bad_words_ids=forms) and got != plain
    for body, param in (({"allowed_token_ids": [10**6]}, "allowed_token_ids"), ({"allowed_token_ids": []}, None),
                        ({"bad_words": ["  "]}, "bad_words")):
        with pytest.raises(openai.BadRequestError) as e:
            ours(**body)
        assert param is None or e.value.body.get("param") == param, e.value.body
    # a regex that needs a token allowed_token_ids leaves out fails there, whole or streamed, with
    # why (not an arbitrary token), and the mesh goes on serving
    words = dict(allowed_token_ids=allowed, guided_regex=" the weather in London")
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids, min_tokens and the "
                                                     "response format together allow none"):
        ours(**words)
    with pytest.raises(openai.APIError, match="allow none"):
        for _ in c.completions.create(model=mesh.model, prompt=ids, max_tokens=10, stream=True, extra_body=words):
            pass
    assert ours(allowed_token_ids=allowed) == got_allowed


def test_reasoning_content_apart(mesh):
    """`--reasoning-parser qwen3`: a chat answer that opens with <think> comes as `reasoning_content`
    (and vLLM's newer `reasoning`) and `content`, whole or streamed (the tags are several tokens of
    this tokenizer, so they arrive cut); include_reasoning: false leaves the reasoning out. The
    answer is forced by a regex, the random model having no thoughts of its own."""
    c = mesh.client
    body = dict(model=mesh.model, messages=chat(), max_tokens=40, temperature=0,
                extra_body={"guided_regex": "<think>weigh it</think>\n\nyes"})
    m = c.chat.completions.create(**body).choices[0].message
    assert (m.model_extra["reasoning_content"], m.model_extra["reasoning"], m.content) == ("weigh it", "weigh it",
                                                                                          "\n\nyes")
    reasoning, content, roles = "", "", []
    for chunk in c.chat.completions.create(**body, stream=True):
        for ch in chunk.choices:
            reasoning += ch.delta.model_extra.get("reasoning_content") or ""
            content += ch.delta.content or ""
            roles += [ch.delta.role] if ch.delta.role else []
    assert (reasoning, content, roles) == ("weigh it", "\n\nyes", ["assistant"])
    body["extra_body"] = {**body["extra_body"], "include_reasoning": False}
    m = c.chat.completions.create(**body).choices[0].message
    assert "reasoning_content" not in (m.model_extra or {}) and m.content == "\n\nyes"
    plain = c.chat.completions.create(model=mesh.model, messages=chat(), max_tokens=4, temperature=0)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})  # no <think>: all content
    # /v1/responses: a reasoning item (its text whole, as OpenAI returns an open model's) before the message
    rb = dict(model=mesh.model, input=LONG, max_output_tokens=40, temperature=0,
              extra_body={"guided_regex": "<think>weigh it</think>\n\nyes"})
    r = c.responses.create(**rb)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "weigh it" and r.output_text == "\n\nyes"
    events = list(c.responses.create(**rb, stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "weigh it"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nyes"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, events[kinds.index("response.completed")].response.output[k].type) for k, i in enumerate(done)] \
        == [("reasoning", "reasoning"), ("message", "message")]
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    # completions are not parsed: the text is the model's, tags and all
    r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=40, temperature=0,
                             extra_body={"guided_regex": "<think>a</think>b"})
    assert r.choices[0].text == "<think>a</think>b"


def test_chat_templates_own_and_continued(mesh):
    """Through `meshserve up --trust-request-chat-template`: a chat's own template and a continued
    final message give the prompt they render, so the completion of that prompt's ids."""
    c = mesh.client
    own = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if add_generation_prompt %} answer:{% endif %}{% endfor %}"
    msgs = [{"role": "user", "content": LONG}]
    r = c.chat.completions.create(model=mesh.model, messages=msgs, max_tokens=6, temperature=0,
                                  extra_body={"chat_template": own})
    ids = mesh.tokenizer.encode(f"user: {LONG} answer:", add_special_tokens=False)
    want = c.completions.create(model=mesh.model, prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    msgs += [{"role": "assistant", "content": "The weather"}]
    r = c.chat.completions.create(model=mesh.model, messages=msgs, max_tokens=6, temperature=0,
                                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    ids = mesh.tokenizer.encode(mesh.tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
                                .rsplit("The weather", 1)[0] + "The weather", add_special_tokens=False)
    want = c.completions.create(model=mesh.model, prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    # vLLM's chat echo: the continued message's text first, whole and in the first streamed chunk
    echo = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    r = c.chat.completions.create(model=mesh.model, messages=msgs, max_tokens=6, temperature=0, extra_body=echo)
    assert r.choices[0].message.content == "The weather" + want
    chunks = [ch.choices[0].delta for ch in c.chat.completions.create(
        model=mesh.model, messages=msgs, max_tokens=6, temperature=0, stream=True, extra_body=echo) if ch.choices]
    assert (chunks[0].role, chunks[0].content) == ("assistant", "The weather")
    assert "".join(d.content or "" for d in chunks) == "The weather" + want
    plain = c.chat.completions.create(model=mesh.model, messages=msgs[:1], max_tokens=6, temperature=0,
                                      extra_body={"echo": True})  # the last message is the user's: nothing
    assert plain.choices[0].message.content == c.chat.completions.create(
        model=mesh.model, messages=msgs[:1], max_tokens=6, temperature=0).choices[0].message.content


def test_skip_special_tokens_false_shows_them(mesh):
    c = mesh.client
    body = {"ignore_eos": True, "logit_bias": {"2": 100}}  # the end-of-turn token, three times
    r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=3, extra_body=body)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 3
    r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=3,
                             extra_body={**body, "skip_special_tokens": False})
    assert r.choices[0].text == mesh.tokenizer.decode([2] * 3, skip_special_tokens=False) != ""


def test_echo_logprobs_equal_transformers(mesh, hf):
    """The prompt tokens' logprobs (lm-eval's local-completions: echo, logprobs, max_tokens 0), first
    null, equal Transformers' in fp32, also when the prompt is already in the prefix cache."""
    c = mesh.client
    ids = mesh.tokenizer.encode(LONG)
    with torch.inference_mode():
        lp = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    want = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    c.completions.create(model=mesh.model, prompt=LONG, max_tokens=2, temperature=0)  # now it is cached
    for max_tokens in (0, 3):
        r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=max_tokens, echo=True, logprobs=1,
                                 temperature=0)
        ch = r.choices[0]
        assert ch.text.startswith(LONG) and ch.logprobs.token_logprobs[0] is None
        got = torch.tensor(ch.logprobs.token_logprobs[1:len(ids)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        assert len(ch.logprobs.tokens) == len(ids) + max_tokens == len(ch.logprobs.text_offset)
        assert r.usage.completion_tokens == max_tokens


def test_vllm_prompt_logprobs_equal_transformers(mesh, hf):
    """vLLM's `prompt_logprobs: k` (completions: in each choice; chat: beside the choices): per
    prompt token, first null, {token id: {logprob, rank, decoded_token}} with the token's own entry
    and its k likeliest, equal to Transformers' in fp32; echo's alternatives stay `logprobs` many;
    with stream it is refused, as vLLM does."""
    c, tok = mesh.client, mesh.tokenizer
    ids = tok.encode(LONG)

    def check(plp: list, prompt: list[int], k: int) -> None:
        with torch.inference_mode():
            lp = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert plp[0] is None and len(plp) == len(prompt)
        for p, (t, entry) in enumerate(zip(prompt[1:], plp[1:])):
            own = entry[str(t)]
            assert own["logprob"] == pytest.approx(float(lp[p, t]), abs=1e-4) and own["decoded_token"] == tok.decode([t])
            best = lp[p].topk(k)
            tops = sorted((e for e in entry.values() if e["rank"] <= k), key=lambda e: e["rank"])
            assert [e["rank"] for e in tops] == list(range(1, k + 1))
            assert [e["logprob"] for e in tops] == pytest.approx(best.values.tolist(), abs=1e-4)
            assert len(entry) in (k, k + 1) and own["rank"] >= 1

    r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=2, echo=True, logprobs=1,
                             extra_body={"prompt_logprobs": 3})
    ch = r.choices[0]
    check(ch.model_extra["prompt_logprobs"], ids, 3)
    assert all(len(t) == 1 for t in ch.logprobs.top_logprobs[1:])  # echo shows logprobs=1 alternative
    body = {"model": mesh.model, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2,
            "prompt_logprobs": 2}
    r = httpx.post(mesh.url + "/v1/chat/completions", json=body, timeout=60).json()
    prompt = httpx.post(mesh.url + "/tokenize", json={"model": mesh.model, "messages": body["messages"],
                                                       "add_generation_prompt": True}).json()["tokens"]
    assert r["usage"]["prompt_tokens"] == len(prompt)
    check(r["prompt_logprobs"], prompt, 2)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        c.completions.create(model=mesh.model, prompt=LONG, max_tokens=2, stream=True,
                             extra_body={"prompt_logprobs": 1})


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(mesh):
    """vLLM's cache_salt through the mesh: a prompt's cached blocks are hits only for requests of
    the same salt (and none of the unsalted ones'), the completion the same either way."""
    c = mesh.client
    prompt = "Salted: " + LONG * 2  # over 64 tokens, not cached by any other test

    def cached(salt: str | None) -> tuple[int, str]:
        r = c.completions.create(model=mesh.model, prompt=prompt, max_tokens=4, temperature=0,
                                 extra_body={} if salt is None else {"cache_salt": salt})
        details = r.usage.prompt_tokens_details
        return (details.cached_tokens if details else 0) or 0, r.choices[0].text

    first = cached(None)
    assert cached("tenant-a") == (0, first[1]) and cached("tenant-b") == (0, first[1])
    again = [cached(s) for s in ("tenant-a", "tenant-b", None)]
    assert all(n >= 64 and text == first[1] for n, text in again), again
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        c.completions.create(model=mesh.model, prompt=prompt, max_tokens=1, extra_body={"cache_salt": ""})


def test_request_id_names_the_response(mesh):
    """vLLM's request_id: the response's id, streamed or not; two requests reusing one both finish."""
    c = mesh.client
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda _: c.completions.create(model=mesh.model, prompt=LONG, max_tokens=4, temperature=0,
                                                          extra_body={"request_id": "job-7"}), range(2)))
    assert [r.id for r in rs] == ["cmpl-job-7"] * 2 and rs[0].choices[0].text == rs[1].choices[0].text
    chunks = list(c.chat.completions.create(model=mesh.model, messages=chat(), max_tokens=3, stream=True,
                                            extra_body={"request_id": "job-8"}))
    assert {ch.id for ch in chunks} == {"chatcmpl-job-8"}


def test_token_ids_beside_the_text(mesh):
    """vLLM's return_token_ids: the prompt's and the output's ids (streamed: the prompt's in the
    first chunk, each chunk's own after; chat: the prompt's beside the choices), which decode to the
    text; return_tokens_as_token_ids names logprobs' tokens "token_id:<id>"."""
    c, tok = mesh.client, mesh.tokenizer
    ids = tok.encode(LONG)
    r = c.completions.create(model=mesh.model, prompt=LONG, max_tokens=6, temperature=0, n=2,
                             extra_body={"return_token_ids": True})
    for ch in r.choices:
        assert ch.model_extra["prompt_token_ids"] == ids and len(ch.model_extra["token_ids"]) == 6
        assert tok.decode(ch.model_extra["token_ids"]) == ch.text
    got, prompt = [], None
    for chunk in c.completions.create(model=mesh.model, prompt=LONG, max_tokens=6, temperature=0, stream=True,
                                      extra_body={"return_token_ids": True}):
        for ch in chunk.choices:
            prompt = prompt or ch.model_extra.get("prompt_token_ids")
            got += ch.model_extra.get("token_ids") or []
    assert prompt == ids and got == r.choices[0].model_extra["token_ids"]
    body = {"model": mesh.model, "messages": chat(), "max_tokens": 5, "temperature": 0, "return_token_ids": True,
            "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    out = httpx.post(mesh.url + "/v1/chat/completions", json=body, timeout=60).json()
    template = httpx.post(mesh.url + "/tokenize", json={"model": mesh.model, "messages": chat(),
                                                        "add_generation_prompt": True}).json()["tokens"]
    assert out["prompt_token_ids"] == template
    choice = out["choices"][0]
    assert tok.decode(choice["token_ids"]) == choice["message"]["content"]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(a["token"].startswith("token_id:") for e in choice["logprobs"]["content"] for a in e["top_logprobs"])
    with pytest.raises(openai.BadRequestError, match="return_token_ids"):
        c.responses.create(model=mesh.model, input="hi", max_output_tokens=2, extra_body={"return_token_ids": True})


def test_a_batch_of_prompts_is_each_prompt_alone(mesh):
    """`prompt` as a list of texts or of token-id lists (OpenAI's and vLLM's batch): prompt k's i-th
    choice is choice k * n + i, its text what that prompt alone gives, echo its own prompt; usage
    counts each prompt once. Streamed chunks carry the same indexes."""
    c = mesh.client
    prompts = [LONG, "The quick brown fox", "Hello"]  # one handed off, two prefilled on the decode worker
    alone = [c.completions.create(model=mesh.model, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    r = c.completions.create(model=mesh.model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in r.choices] == list(range(6))
    assert [ch.text for ch in r.choices] == [t for t in alone for _ in range(2)]
    n_prompt = sum(len(mesh.tokenizer.encode(p)) for p in prompts)
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 36
    ids = [mesh.tokenizer.encode(p) for p in prompts]
    echo = c.completions.create(model=mesh.model, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert [ch.text for ch in echo.choices] == [mesh.tokenizer.decode(i) + t for i, t in zip(ids, alone)]
    texts, usage = {}, None
    for chunk in c.completions.create(model=mesh.model, prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                      stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
        usage = chunk.usage or usage
    assert [texts[i] for i in range(3)] == alone and usage.prompt_tokens == n_prompt
    with pytest.raises(openai.BadRequestError, match="maximum context length"):  # one too long: none runs
        c.completions.create(model=mesh.model, prompt=["Hello", "x " * 300], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="choices in one request"):
        c.completions.create(model=mesh.model, prompt=["Hello"] * 20, max_tokens=4, n=8)


def test_a_predicted_output_changes_no_token(mesh):
    """OpenAI's Predicted Outputs: the answer is the same with a prediction as without (its tokens
    are only proposed for verification; the mesh's model speculates not, so the workers do it for
    these requests alone), whole and streamed; usage says how many of the prediction's tokens the
    answer has, in order, and how many not. Completions have no such field."""
    import httpx

    from meshserve.shared.openai_protocol import prediction_usage

    c, tok = mesh.client, mesh.tokenizer
    body = dict(model=mesh.model, messages=chat(), max_tokens=16, temperature=0)
    plain = c.chat.completions.create(**body, extra_body={"return_token_ids": True})
    text, ids = plain.choices[0].message.content, plain.choices[0].model_extra["token_ids"]
    assert plain.usage.completion_tokens_details is None

    def drafted() -> float:
        lines = httpx.get(mesh.url + "/metrics").text.splitlines()
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("meshserve:spec_decode_num_draft_tokens_total"))

    before = drafted()
    for prediction in (tok.decode(ids), tok.decode(ids[:10]) + " and then something else",
                       [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]):
        r = c.chat.completions.create(**body, prediction={"type": "content", "content": prediction})
        assert r.choices[0].message.content == text
        whole = prediction if isinstance(prediction, str) else text
        want = prediction_usage(tok.encode(whole, add_special_tokens=False), [ids])
        assert r.usage.completion_tokens_details.model_dump(exclude_none=True) == want
    chunks = list(c.chat.completions.create(**body, stream=True, stream_options={"include_usage": True},
                                            prediction={"type": "content", "content": text}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens_details.model_dump(exclude_none=True) == \
        prediction_usage(tok.encode(text, add_special_tokens=False), [ids])
    deadline = time.monotonic() + 30
    while drafted() <= before and time.monotonic() < deadline:  # counters come with the heartbeats
        time.sleep(0.2)
    assert drafted() > before
    for call in (lambda: c.completions.create(model=mesh.model, prompt="hi", max_tokens=2,
                                              extra_body={"prediction": {"type": "content", "content": "x"}}),
                 lambda: c.chat.completions.create(**body, prediction={"type": "text", "content": "x"})):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert "prediction" in str(e.value.body)


def test_prediction_usage_counts_the_tokens_the_answer_has_in_order():
    from meshserve.shared.openai_protocol import prediction_usage

    assert prediction_usage([1, 2, 3, 4], [[1, 2, 9, 4]]) == {"accepted_prediction_tokens": 3,
                                                              "rejected_prediction_tokens": 1}
    assert prediction_usage([1, 2], [[2, 1], [1, 2]]) == {"accepted_prediction_tokens": 3,
                                                         "rejected_prediction_tokens": 1}


def test_template_variables_are_honoured_where_the_template_reads_them(mesh):
    """`documents` (vLLM's) and `reasoning_effort` (OpenAI's) reach a chat template that reads them
    (here the request's own); one that does not would ignore them, so they are refused by name."""
    c, tok = mesh.client, mesh.tokenizer
    template = ("{% for d in documents or [] %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% if reasoning_effort is defined %}(effort {{ reasoning_effort }}){% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    extra = {"chat_template": template, "documents": [{"title": "a", "text": "the sky is green"}],
             "reasoning_effort": "low"}
    r = httpx.post(mesh.url + "/tokenize", json={"model": mesh.model, "messages": chat("hi"), **extra})
    assert r.status_code == 200 and tok.decode(r.json()["tokens"]) == "[doc a: the sky is green](effort low)hi"
    out = c.chat.completions.create(model=mesh.model, messages=chat("hi"), max_tokens=2, extra_body=extra)
    assert out.usage.prompt_tokens == r.json()["count"]
    for name, value in (("documents", extra["documents"]), ("reasoning_effort", "high")):
        with pytest.raises(openai.BadRequestError) as e:  # the model's template reads neither
            c.chat.completions.create(model=mesh.model, messages=chat("hi"), max_tokens=2, extra_body={name: value})
        assert e.value.body["param"] == name and "does not read it" in e.value.body["message"]

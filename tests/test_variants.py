"""Variants of one model by request class and tenant (docs/models.md "Variants"): the manifest form,
its checks, the routing (a tenant's entry, then a class's, then the default), the scheduler's
resolution of a bare served name, and a mesh test in which a background request runs on the int8
entry and an interactive one on the fp32 entry of the same source, each with its own variant's
greedy tokens (Transformers on the target's weights; on the dequantized int8 weights for int8)."""

from __future__ import annotations

import concurrent.futures
import json
import time
import types

import httpx
import pytest
import torch

from meshserve.shared.manifest import ManifestError, load_manifest

TOKENS = 10


def _write(tmp_path, text: str):
    f = tmp_path / "models.yaml"
    f.write_text(text)
    return f


def test_variants_route_by_tenant_then_class_then_default(tmp_path, tiny_llama):
    m = load_manifest(_write(tmp_path, f"""
- {{name: chat, variant: bf16, path: '{tiny_llama}', aliases: [default]}}
- {{name: chat, variant: int8, path: '{tiny_llama}', quantization: int8, priorities: [background], tenants: [nightly]}}
- {{name: chat, variant: acme, path: '{tiny_llama}', quantization: int8, tenants: [acme]}}
- {{name: other, path: '{tiny_llama}'}}
"""))
    assert m.ids == ["chat@bf16", "chat@int8", "chat@acme", "other"] and m.names == ["chat", "other"]
    pick = lambda name, priority=None, tenant=None: m.pick(name, 0.5, priority, tenant).id  # noqa: E731
    assert pick("chat", "background") == "chat@int8"  # its class
    assert pick("chat", "interactive") == pick("chat", "normal") == pick("chat") == "chat@bf16"  # the default
    assert pick("chat", "interactive", "nightly") == "chat@int8"  # its tenant, whatever the class
    assert pick("chat", "background", "acme") == "chat@acme"  # a tenant's entry before a class's
    assert pick("chat", "interactive", "someone-else") == "chat@bf16"
    assert pick("default", "background") == "chat@int8"  # an alias reaches every variant of its name
    assert pick(None, "background") == "chat@int8" and pick("other", "background") == "other"
    assert m.get("chat@int8").quantization == "int8" and m.tenant_names == {"nightly", "acme"}


@pytest.mark.parametrize("entries,words", [
    ("- {name: c, variant: a, path: P}\n- {name: c, variant: b, path: P}",
     "exactly one variant without `priorities` and `tenants`.*it has 'a', 'b'"),
    ("- {name: c, variant: a, path: P, priorities: [background]}", "exactly one variant.*it has none"),
    ("- {name: c, variant: a, path: P}\n- {name: c, path: P, priorities: [background]}",
     "each of its entries needs a `variant`"),
    ("- {name: c, variant: a, path: P}\n- {name: c, variant: a, path: P, tenants: [t]}", "lists a variant twice"),
    ("- {name: c, variant: a, path: P}\n- {name: c, variant: b, path: P, priorities: [background]}\n"
     "- {name: c, variant: d, path: P, priorities: [normal, background]}",
     "the class 'background' is listed by two variants \\('b' and 'd'\\)"),
    ("- {name: c, variant: a, path: P}\n- {name: c, variant: b, path: P, tenants: [t]}\n"
     "- {name: c, variant: d, path: P, tenants: [t], priorities: [normal]}",
     "the tenant 't' is listed by two variants"),
    ("- {name: c, variant: a, path: P, version: '1', share: 100}", "mixes canary versions"),
    ("- {name: c, variant: a, path: P}\n- {name: c, variant: b, path: P, priorities: [batch]}",
     "priorities.0: Input should be 'interactive', 'normal' or 'background'"),
    ("- {name: c, variant: a, path: P}\n- {name: c, variant: b, path: P, priorities: []}", "at least 1 item"),
    ("- {name: c, variant: 'a b', path: P}", "variant: String should match pattern"),
    ("- {name: c, variant: x, path: P}\n- {name: c@x, path: P}", "both 'c@x' inside the mesh"),
])
def test_variant_manifest_errors_say_what_is_wrong(tmp_path, tiny_llama, entries, words):
    with pytest.raises(ManifestError, match=words):
        load_manifest(_write(tmp_path, entries.replace("path: P", f"path: '{tiny_llama}'")))


def test_scheduler_resolves_a_bare_served_name_like_the_gateway(tmp_path, tiny_llama):
    """A request naming the served name, not an entry's id (a gateway without the manifest), runs on
    the variant of its class and tenant; an id stays as it is."""
    from meshserve.services.scheduler.main import Scheduler
    from meshserve.shared.schemas import GenerateRequest, Sampling

    f = _write(tmp_path, f"- {{name: chat, variant: fp32, path: '{tiny_llama}'}}\n"
                         f"- {{name: chat, variant: int8, path: '{tiny_llama}', quantization: int8, "
                         "priorities: [background], tenants: [nightly]}\n")
    s = Scheduler(None, types.SimpleNamespace(models=str(f)))

    def req(model, priority="normal", tenant=None):
        return GenerateRequest(request_id="r", model=model, prompt_token_ids=[5], sampling=Sampling(max_tokens=1),
                               priority=priority, stream_subject="x", arrival_time=0.0, tenant=tenant)

    assert s.resolve_model(req("chat", "background")).model == "chat@int8"
    assert s.resolve_model(req("chat", "interactive")).model == "chat@fp32"
    assert s.resolve_model(req("chat", "interactive", "nightly")).model == "chat@int8"
    assert s.resolve_model(req("chat@fp32", "background")).model == "chat@fp32"  # an id: as the gateway chose
    assert s.resolve_model(req("nope")).model == "nope"  # refused later, as any unknown model


# -- the mesh


def _logprobs(hf, prompt: list[int], out: list[int]) -> list[float]:
    """Transformers' log-probability of each generated token (one forward pass over prompt + output)."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[i, t].item() for i, t in enumerate(out)]


@pytest.fixture(scope="module")
def oracles(tiny_llama):
    """Per variant: Transformers' greedy tokens and their logprobs on a fixed prompt, fp32 on the
    target's weights, int8 on its dequantized int8 weights (tests/test_int8.py)."""
    from oracle import hf_greedy
    from test_int8 import dequantized_hf
    from transformers import AutoModelForCausalLM

    from meshserve.shared.models_repo import load_tokenizer

    g = torch.Generator().manual_seed(50)  # a prompt whose greedy tokens differ between the variants
    prompt = torch.randint(3, 384, (12,), generator=g).tolist()
    tok = load_tokenizer(str(tiny_llama))
    out = {}
    for variant, hf in (("fp32", AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()),
                        ("int8", dequantized_hf(tiny_llama, tied=False))):
        tokens = hf_greedy(hf, [prompt], TOKENS, [2])[0]
        assert 2 not in tokens  # the prompt was chosen so that neither stops early
        out[variant] = {"text": tok.decode(tokens), "logprobs": _logprobs(hf, prompt, tokens)}
    # The two variants are told apart by their texts (the argmax moves at the 4th token) and logprobs.
    assert out["fp32"]["text"] != out["int8"]["text"]
    assert max(abs(a - b) for a, b in zip(out["fp32"]["logprobs"], out["int8"]["logprobs"])) > 1e-3
    return prompt, out


def test_background_runs_on_the_int8_variant_and_interactive_on_fp32(tiny_llama, tmp_path, oracles):
    from mesh_util import Mesh
    from openai import OpenAI

    prompt, want = oracles
    manifest = _write(tmp_path, f"""
- {{name: chat, variant: fp32, path: '{tiny_llama}'}}
- {{name: chat, variant: int8, path: '{tiny_llama}', quantization: int8, priorities: [background], tenants: [nightly]}}
""")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n"
                       "  - {name: web, api_keys: [sk-web], default_priority: interactive}\n"
                       "  - {name: nightly, api_keys: [sk-nightly]}\n")
    log = tmp_path / "requests.jsonl"
    # Two workers, one per variant (worker i starts on the manifest's entry i): no switch needed.
    with Mesh(tiny_llama, tmp_path, prefill=0, decode=2, env={"MESHSERVE_REQUEST_LOG": str(log)},
              extra=["--models", str(manifest), "--tenants", str(tenants)]) as m:
        def variants() -> dict[str, dict]:
            cards = httpx.get(m.url + "/v1/models", headers={"Authorization": "Bearer sk-web"}, timeout=10).json()
            return {v["variant"]: v for v in next(c for c in cards["data"] if c["id"] == "chat")["variants"]}

        deadline = time.monotonic() + 60
        while {v["workers"] for v in variants().values()} != {1}:  # both workers up, each on its entry
            assert time.monotonic() < deadline, variants()
            time.sleep(0.2)

        def complete(key: str, priority: str | None):
            client = OpenAI(base_url=m.url + "/v1", api_key=key, max_retries=0, timeout=120)
            raw = client.completions.with_raw_response.create(
                model="chat", prompt=prompt, max_tokens=TOKENS, temperature=0, logprobs=1,
                extra_body={"priority": priority} if priority else None)
            r = raw.parse()
            return raw.headers.get("meshserve-model-variant"), r

        calls = [("sk-web", None), ("sk-web", "background"), ("sk-nightly", "normal")]
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:  # both variants at once
            got = list(pool.map(lambda c: complete(*c), calls))
        for (variant, r), expected in zip(got, ("fp32", "int8", "int8")):
            assert variant == expected
            assert r.model == "chat" and r.choices[0].text == want[variant]["text"], (variant, r.choices[0].text)
            lps = r.choices[0].logprobs.token_logprobs
            assert len(lps) == TOKENS
            assert max(abs(a - b) for a, b in zip(lps, want[variant]["logprobs"])) < 1e-4, variant
        raw = OpenAI(base_url=m.url + "/v1", api_key="sk-web", max_retries=0, timeout=120).responses.with_raw_response \
            .create(model="chat", input="Hello", max_output_tokens=2, extra_body={"priority": "background"})
        assert raw.headers.get("meshserve-model-variant") == "int8" and raw.parse().model == "chat"
        card = variants()
        assert card["int8"]["priorities"] == ["background"] and card["int8"]["tenants"] == ["nightly"]
        assert card["int8"]["quantization"] == "int8" and card["fp32"]["priorities"] is None
        assert {v["workers"] for v in card.values()} == {1}
        assert m.ask("scheduler.status")["model_switches"] == 0
        deadline, lines = time.monotonic() + 10, []
        while time.monotonic() < deadline:  # each request's line is written when it ends (this mesh's own log)
            lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            if len(lines) >= len(calls) + 1:
                break
            time.sleep(0.1)
        by_tenant = sorted((x["tenant"], x["class"], x["model"]) for x in lines)
        assert by_tenant == [("nightly", "normal", "chat@int8"), ("web", "background", "chat@int8"),
                             ("web", "background", "chat@int8"), ("web", "interactive", "chat@fp32")], by_tenant

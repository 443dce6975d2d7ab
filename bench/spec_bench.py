"""The speculative decoding benchmark: one stream decoding --tokens tokens after a --prompt-tokens
prompt in the in-process engine on the default model, with and without prompt-lookup speculation,
side by side, for bf16 and int8 weights, on two workloads:

- copy: a chat request to repeat a text with one change (the output copies from the prompt:
  editing, extraction), where prompt lookup finds what comes next;
- chat: an ordinary chat question, where it rarely does.

Three ways, side by side: no speculation, prompt lookup, and OpenAI's Predicted Outputs on an
engine that does not speculate otherwise (`prediction`: the copy workload's prediction is the text
to repeat, as an editor sends the file being edited; the chat workload gets the same text, a
prediction that is wrong, for what one costs).

    meshserve bench-spec [--model M] [--variants bfloat16,bfloat16+int8] [--prompt-tokens 128]
                         [--tokens 128] [--k 4] [--batch-sizes 1] [--json OUT]

Per run: milliseconds per output token (wall, after the first), the draft tokens proposed and
accepted (acceptance rate), tokens per verification step, and whether the greedy output equals the
run without speculation (it must). --batch-sizes 1,4,8,16 also runs that many copies of the copy
workload at once, with and without speculation (output tokens/s): where speculation stops paying,
which is what --speculative-disable-by-batch-size is set from.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from meshserve.bench.quant_bench import TEXT
from meshserve.bench.report import emit_json
from meshserve.shared.models_repo import DEFAULT_MODEL

COPY_ASK = "Repeat the following text exactly, word for word, but write 'harbor' instead of 'harbour':\n\n"
CHAT_ASK = ("I am planning a week of walking along the coast in the north of Scotland in the spring. What "
            "should I pack, how far can I expect to walk each day, and what should I know about the weather, "
            "the tides and finding a place to sleep? ")


def prompts(tokenizer, n: int) -> dict[str, tuple[list[int], list[int]]]:
    """The two workloads' prompts, n tokens each (the text cut to fit, the chat template around it),
    each with its prediction: the text the copy workload repeats."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))

    def chat(ask: str, body: str) -> tuple[list[int], str]:
        words = body.split(" ")
        lo, hi = 0, len(words)
        while lo < hi:  # the longest body whose prompt has at most n tokens
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if len(encode(ask + " ".join(words[:mid]))) <= n else (lo, mid - 1)
        return encode(ask + " ".join(words[:lo])), " ".join(words[:lo])

    copy, text = chat(COPY_ASK, TEXT)
    predicted = tokenizer.encode(text, add_special_tokens=False)
    return {"copy": (copy, predicted), "chat": (chat(CHAT_ASK, "Thank you! " * n)[0], predicted)}


def run(llm, prompt: list[int], n: int, streams: int = 1, prediction: list[int] | None = None) -> dict:
    from meshserve.shared.engine.sequence import SamplingParams

    eng = llm.engine
    before = dict(eng.stats["spec_decode"]) if eng.speculator else {}
    cs = [llm.add(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, prediction=prediction))
          for _ in range(streams)]
    t0 = time.perf_counter()
    while eng.has_unfinished():
        llm.outputs.process(eng.step())
    wall = time.perf_counter() - t0
    c = cs[0]
    t = c.token_times
    out = {"ms_per_token": 1000 * (t[-1] - t[0]) / max(1, len(c.token_ids) - 1),
           "output_tokens_per_s": sum(len(x.token_ids) for x in cs) / wall, "tokens": len(c.token_ids),
           "token_ids": c.token_ids}
    spec = eng.stats["spec_decode"]
    if spec:
        d = {k: spec[k] - before.get(k, 0) for k in spec}
        out |= {"draft_tokens": d["num_draft_tokens"], "accepted_tokens": d["num_accepted_tokens"],
                "verification_steps": d["num_verification_steps"],
                "acceptance_rate": d["num_accepted_tokens"] / max(1, d["num_draft_tokens"]),
                "tokens_per_verification_step": (d["num_accepted_tokens"] + d["num_verification_steps"])
                / max(1, d["num_verification_steps"])}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshserve bench-spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--variants", default="bfloat16,bfloat16+int8", help="comma-separated dtype[+quantization]")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded after the prompt")
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--prompt-lookup-max", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1", help="streams at once, comma-separated (more than 1: the copy "
                    "workload only, for the batch size where speculation stops paying)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.llm_engine import EngineConfig
    from meshserve.shared.engine.speculative import SpeculativeConfig

    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    res: dict = {"command": "meshserve bench-spec " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "model": a.model, "threads": torch.get_num_threads(), "k": a.k, "runs": {}}
    for variant in a.variants.split(","):
        dtype, _, quantization = variant.partition("+")
        spec = SpeculativeConfig("ngram", num_speculative_tokens=a.k, prompt_lookup_max=a.prompt_lookup_max,
                                 disable_by_batch_size=max(batch_sizes))
        for name, cfg in (("none", EngineConfig()), ("ngram", EngineConfig(speculative=spec)),
                          ("prediction", EngineConfig())):
            llm = LLM(a.model, dtype, config=cfg, quantization=quantization or None)
            ps = prompts(llm.tokenizer, a.prompt_tokens)
            run(llm, ps["chat"][0][:16], 8)  # warm up
            for workload, (prompt, predicted) in ps.items():
                for b in batch_sizes if workload == "copy" else [1]:
                    key = f"{variant}/{workload}/{name}" + (f"/batch{b}" if b > 1 else "")
                    r = run(llm, prompt, a.tokens, b, predicted if name == "prediction" else None)
                    r["prompt_tokens"] = len(prompt)
                    base = res["runs"].get(key.replace(f"/{name}", "/none"))
                    if base is not None:
                        r["same_output_as_none"] = r["token_ids"] == base["token_ids"]
                        r["speedup"] = base["ms_per_token"] / r["ms_per_token"] if b == 1 else \
                            r["output_tokens_per_s"] / base["output_tokens_per_s"]
                    res["runs"][key] = r
                    print(f"{key}: {r['ms_per_token']:.2f} ms/token, {r['output_tokens_per_s']:.1f} tokens/s"
                          + (f", acceptance {r['acceptance_rate']:.2f}, {r['tokens_per_verification_step']:.2f} "
                             f"tokens/verification, speedup {r.get('speedup', 1):.2f}" if "acceptance_rate" in r
                             else ""), file=sys.stderr)
            del llm
    for r in res["runs"].values():
        del r["token_ids"]
    emit_json(res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

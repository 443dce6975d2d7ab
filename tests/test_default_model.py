"""The oracle checks on the real default model (SmolLM2-135M-Instruct, dequantized from its GGUF),
when it is in the cache: greedy tokens through the engine equal Transformers' on the same weights."""

from __future__ import annotations

import pytest
import torch
from oracle import hf_greedy

from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_gguf

MAX_NEW = 12
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
         "The quick brown fox jumps over", "In machine learning, a transformer is",
         "Water boils at", "Le chat est", "import numpy as np\n", "Q: What is 2+2?\nA:",
         "The three primary colors are", "My favourite food is", "Hello! How are you", "SELECT * FROM",
         "The sun rises in the", "A haiku about autumn:\n"]


@pytest.fixture(scope="module")
def setup(default_model_file):
    from transformers import AutoModelForCausalLM

    from meshserve.shared.tokenizer import Tokenizer

    cfg, sd = load_gguf(default_model_file)
    model = LlamaModel.from_hf(cfg, sd, torch.float32)
    tok = Tokenizer.from_gguf(default_model_file)
    # Different lengths, and a shared prefix so prefix caching has something to find.
    prompts = [tok.encode(t) for t in TEXTS]
    prompts[-1] = prompts[-1] + tok.encode(" " + " ".join(TEXTS[:6]))
    prompts.append(prompts[-1] + tok.encode(" and more"))
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_file.parent), gguf_file=default_model_file.name,
                                              dtype=torch.float32).eval()
    ref = hf_greedy(hf, prompts, MAX_NEW, cfg.eos_token_ids)
    return model, prompts, ref


@pytest.mark.parametrize("chunk,prefix,blocks", [(512, True, 4096), (7, False, 4096), (64, True, 14)])
def test_default_model_greedy_matches_transformers(setup, chunk, prefix, blocks):
    model, prompts, ref = setup
    sched = SchedulerConfig(max_num_batched_tokens=max(chunk, 64), prefill_chunk_size=chunk)
    eng = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=blocks, enable_prefix_caching=prefix,
                                        scheduler=sched), model_name="smollm2")
    first = eng.generate(prompts[:-1], SamplingParams(max_tokens=MAX_NEW, temperature=0))
    last = eng.generate(prompts[-1:], SamplingParams(max_tokens=MAX_NEW, temperature=0))
    assert first + last == ref
    if blocks < 100:
        assert eng.stats["num_preemptions"] > 0
    if prefix:
        assert eng.stats["prefix_hits"] > 0

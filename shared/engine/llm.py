"""The engine in one process, with its tokenizer: for the batch command, benchmarks and tests.

In the mesh the gateway reads the token stream; here OutputProcessor does the same job:
it detokenizes each request incrementally and ends it when a stop string appears.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from ..models_repo import DEFAULT_MODEL, generation_defaults, load_model_files
from ..model.llama import LlamaModel
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .llm_engine import EngineConfig, LLMEngine, RequestOutput
from .sampler import TokenLogprobs
from .sequence import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with params.prompt_logprobs (echo)
    arrival_time: float = 0.0
    token_times: list[float] = field(default_factory=list)  # when each step's tokens came out
    error: str | None = None  # why it failed (finish_reason "error")


class OutputProcessor:
    """Turns engine outputs into text per request, and stops requests whose stop string appeared."""

    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.active: dict[str, tuple[Completion, IncrementalDetokenizer]] = {}

    def add(self, completion: Completion, params: SamplingParams) -> None:
        self.active[completion.request_id] = (completion, IncrementalDetokenizer(
            self.tokenizer, params.stop, params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output))

    def process(self, outputs: list[RequestOutput]) -> list[Completion]:
        """Applies one step's outputs; returns the completions that finished."""
        now, done = time.monotonic(), []
        for out in outputs:
            c, detok = self.active[out.request_id]
            c.token_ids += out.new_token_ids
            c.logprobs += out.new_logprobs
            c.token_times.append(now)
            c.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            detok.add(out.new_token_ids)
            finished, reason = out.finished, out.finish_reason
            if detok.stopped and not finished:
                self.engine.abort(out.request_id, "stop")
                finished, reason = True, "stop"
            if finished:
                detok.flush()
                c.text, c.finish_reason, c.error = detok.text, reason, out.error
                del self.active[out.request_id]
                done.append(c)
        return done


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "bfloat16", config: EngineConfig | None = None,
                 device: str = "cpu", quantization: str | None = None, kv_cache_dtype: str | None = None):
        """device: "cpu", or "cuda" / "cuda:N" (weights and KV arena there, kernels/cuda_ops.py).
        quantization: None, or "int8" (weight-only int8 projections, kernels/int8_linear.py).
        kv_cache_dtype: "auto" or "int8" (EngineConfig.kv_cache_dtype; None: the config's)."""
        if kv_cache_dtype is not None:
            config = replace(config or EngineConfig(), kv_cache_dtype=kv_cache_dtype)
        cfg, state_dict, self.tokenizer = load_model_files(model)
        net = LlamaModel.from_hf(cfg, state_dict, DTYPES[dtype], device=device, quantization=quantization)
        del state_dict
        eos = sorted(set(cfg.eos_token_ids) | set(self.tokenizer.eos_token_ids))
        self.model_name = model
        self.generation_defaults = generation_defaults(model)  # generation_config.json's sampling fields
        draft = None
        spec = config.speculative if config is not None else None
        if spec is not None and spec.method == "draft":  # the draft model, in the same dtype and on the same device
            dcfg, dsd, _ = load_model_files(spec.model)
            draft = LlamaModel.from_hf(dcfg, dsd, DTYPES[dtype], device=device)
            del dsd
        self.engine = LLMEngine(net, config, eos_token_ids=eos, model_name=str(model), tokenizer=self.tokenizer,
                                draft_model=draft)
        self.outputs = OutputProcessor(self.engine, self.tokenizer)
        self._next_id = 0

    def add(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
            priority: int | str = "normal", after: str | None = None, lora: str | None = None,
            cache_salt: str | None = None) -> Completion:
        """after: the request id of an earlier choice of the same prompt (n > 1; LLMEngine.add_request).
        lora: an adapter added with `self.engine.load_lora(name, path)`. cache_salt: only requests with
        the same salt share prefix-cache blocks."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        seq = self.engine.add_request(request_id, ids, params, priority=priority, after=after, lora=lora,
                                      cache_salt=cache_salt)
        c = Completion(request_id, ids, arrival_time=seq.arrival_time)
        self.outputs.add(c, params)
        return c

    def run(self) -> list[Completion]:
        """Steps until every added request has finished; returns them in the order they finished."""
        done = []
        while self.engine.has_unfinished():
            done += self.outputs.process(self.engine.step())
        return done

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        completions = [self.add(p, sp) for p, sp in zip(prompts, plist)]
        self.run()
        return completions

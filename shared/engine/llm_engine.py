"""The engine: requests in, tokens out, one scheduled batch per step.

    step():  schedule -> swap KV of preempted sequences out / resumed ones in -> run the model on
             the batch -> append each new token -> check stops

Detokenization and stop strings belong to whoever reads the tokens (the gateway in the mesh,
OutputProcessor in process); they call abort() when a stop string matches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshserve.kernels.paged_attention import use_decode_kernel
from meshserve.shared.kv_layout import check_kv_cache_dtype, kv_arena_dtype, kv_arena_shape, kv_bytes_per_block
from meshserve.shared.limits import LimitError, check_context_length, check_token_ids
from meshserve.shared.model.llama import Interrupted
from meshserve.shared.model.lora import LoRAWeights

from .block_pool import BlockPool
from .constraints import ConstraintError, Grammars
from .kv_cache_manager import KVCacheManager
from .model_runner import ModelRunner
from .policy import INTERACTIVE
from .sampler import NO_TOKEN, TokenLogprobs
from .scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from .sequence import NORMAL, PRIORITIES, SamplingParams, Sequence, SequenceStatus, priority_level
from .speculative import SpeculativeConfig, Speculator
from .swap import HostSwap

# An interrupted step (LLMEngine.urgent) computes nothing it keeps: it is not ended when what is
# left of it would take less than this (the request then waits that long, not the whole step).
MIN_LEFT_S = 0.02


@dataclass
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_bytes
    kv_cache_bytes: int = 2 << 30
    max_model_len: int | None = None  # None: the model's context length (ModelConfig.context_length)
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Host memory for the KV of sequences preempted by swap (0: preemption recomputes). In the
    # mesh the worker puts the kv-pool's host tier there instead (set_swapper).
    swap_space_bytes: int = 1 << 30
    # Speculative decoding (speculative.py; None: off). A draft model is given to LLMEngine.
    speculative: SpeculativeConfig | None = None
    # "auto": K/V in the model's dtype; "int8": int8 with a float32 scale per token and KV head
    # (shared/kv_layout.py, kernels/paged_attention.py), CPU only.
    kv_cache_dtype: str = "auto"


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    # The prompt tokens' logprobs (the first None), in the request's first output, when asked for.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None  # why it failed (finish_reason "error"): the request's own fault


class RequestError(ValueError):
    """A request the engine can never serve (too long, bad parameters)."""


class LLMEngine:
    def __init__(self, model, config: EngineConfig | None = None, eos_token_ids: list[int] | None = None,
                 model_name: str = "", kv_cache: torch.Tensor | None = None, tokenizer=None, draft_model=None):
        """kv_cache: an arena mapped from the kv-pool (the mesh); then the engine starts holding no
        blocks and its owner leases them (block_pool.add_free). The engine runs on the model's
        device (LlamaModel.from_hf(..., device="cuda")); its own arena is allocated there.
        tokenizer: the model's (shared/tokenizer.py), for structured output; without it a request
        with a constraint is refused. draft_model: for config.speculative with method "draft" (the
        same vocabulary as model)."""
        self.model = model
        self.config = config = config or EngineConfig()
        cfg = model.cfg
        self.max_model_len = config.max_model_len or cfg.context_length
        if cfg.sliding_window and self.max_model_len > cfg.sliding_window:
            raise ValueError(f"max_model_len {self.max_model_len} is beyond the model's sliding window of "
                             f"{cfg.sliding_window} tokens, which this engine does not apply")
        device = getattr(model, "device", None)
        check_kv_cache_dtype(config.kv_cache_dtype)
        kv_dtype = getattr(torch, kv_arena_dtype(config.kv_cache_dtype, model.dtype))
        if kv_cache is None:
            num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // kv_bytes_per_block(
                cfg, config.block_size, kv_dtype))
            kv_cache = torch.zeros(kv_arena_shape(cfg, num_blocks, config.block_size, kv_dtype), dtype=kv_dtype,
                                   device=device)  # beside the weights
            free = None
        else:
            if kv_cache.dtype != kv_dtype:
                raise ValueError(f"the KV arena holds {kv_cache.dtype} but this engine runs --kv-cache-dtype "
                                 f"{config.kv_cache_dtype} ({kv_dtype}): start the node's kv-pool and workers with "
                                 "the same --kv-cache-dtype")
            num_blocks, free = kv_cache.shape[2] // config.block_size, []
        self.kv_cache = kv_cache
        use_decode_kernel(kv_cache[0])  # builds the compiled attention kernel now, not on the first request
        self.block_pool = BlockPool(num_blocks, free_blocks=free)
        # The most blocks its owner may ever hold (the mesh: the node's arena's size now, or its
        # model's KV quota on the node), and why, when below the pool's: a request that needs more
        # can never run.
        self.block_limit: int | None = None
        self.block_limit_why = ""
        self.kv_cache_manager = KVCacheManager(self.block_pool, config.block_size, config.enable_prefix_caching,
                                               model_name)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        if config.swap_space_bytes > 0 and free is None:
            self.set_swapper(HostSwap(kv_cache, config.block_size, config.swap_space_bytes))
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else cfg.eos_token_ids)
        self.grammars = None if tokenizer is None else Grammars(tokenizer, cfg.vocab_size, sorted(self.eos_token_ids))
        self.loras: dict[str, LoRAWeights] = {}  # adapters requests may name (add_lora), applied per row
        self.runner = ModelRunner(model, self.kv_cache, config.block_size, sorted(self.eos_token_ids), self.grammars,
                                  self.loras)
        self.requests: dict[str, Sequence] = {}
        # Set (from any thread) when an interactive request is on its way to this engine: a step in
        # progress with no interactive sequence ends at the next layer (computing nothing) unless
        # what is left of it is shorter than MIN_LEFT_S, so the request waits about a layer instead
        # of a whole batch chunk. None: never.
        self.urgent: threading.Event | None = None
        self.interrupted_steps = 0
        self.owes_step = False  # interrupted: the next such step runs to its end (the batch progresses)
        self.last_step_tokens = 0  # tokens the last step computed (or began to)
        self.last_step_decode_only = False  # the last step computed decodes only (and ran to its end)
        self.speculator = None
        if config.speculative is not None:
            if draft_model is not None and draft_model.cfg.vocab_size != cfg.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft_model.cfg.vocab_size}) is not the model's "
                                 f"({cfg.vocab_size}): it needs the same tokenizer")
            self.speculator = Speculator(config.speculative, self.max_model_len, config.block_size, draft_model,
                                         self.grammars)
            self.scheduler.max_draft_tokens = config.speculative.num_speculative_tokens

    def load_lora(self, name: str, path: str, base_names: tuple[str, ...] = ()) -> LoRAWeights:
        """Reads and checks the PEFT adapter at `path` against this model (shared/lora.py; raises
        LoRAError saying why it does not fit) and adds it under `name` (replacing one not in use)."""
        w = LoRAWeights.load(name, path, self.model.cfg, self.model.dtype, self.model.device, base_names)
        self.add_lora(w)
        return w

    def add_lora(self, weights: LoRAWeights) -> None:
        if weights.name in self.loras and self.lora_in_use(weights.name):
            raise RequestError(f"the LoRA adapter {weights.name!r} is in use: it cannot be replaced now")
        self.loras[weights.name] = weights

    def remove_lora(self, name: str) -> None:
        """Drops an adapter no sequence uses (RequestError while one does)."""
        if self.lora_in_use(name):
            raise RequestError(f"the LoRA adapter {name!r} is in use by a running request")
        self.loras.pop(name, None)

    def lora_in_use(self, name: str) -> bool:
        return any(s.lora == name for s in list(self.requests.values()))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, output_token_ids: list[int] | None = None,
                    priority: int | str = NORMAL, after: str | None = None, lora: str | None = None,
                    cache_salt: str | None = None) -> Sequence:
        """output_token_ids: tokens already generated elsewhere (a re-dispatch): recomputed, then continued.
        priority: "interactive" (0), "normal" (1) or "background" (2); see scheduler.py.
        after: the request id of a sibling with the same prompt (the first choice of n): this one
        waits until that one's prompt is in the prefix cache, so the prompt is computed once.
        lora: the name of an adapter added with load_lora/add_lora (None: the base model).
        cache_salt: only requests with the same salt share prefix-cache blocks."""
        try:
            params.validate()
            priority = priority_level(priority)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if lora is not None and lora not in self.loras:
            raise RequestError(f"no LoRA adapter {lora!r} is loaded in this engine")
        vocab = self.model.cfg.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("bad_words", [t for w in params.bad_words for t in w]),
                          ("reasoning tags", [*(params.reasoning_end or ()), *(params.reasoning_start or ())]),
                          ("prediction", params.prediction or ())):
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(f"{name} token ids must be in [0, {vocab})")
        if params.constraint is not None:
            if self.grammars is None:
                raise RequestError("structured output needs the model's tokenizer, which this engine lacks")
            try:
                self.grammars.matcher(*params.constraint)  # compiled now (and cached): errors surface here
            except ConstraintError as e:
                raise RequestError(f"invalid {params.constraint[0]} constraint: {e}") from None
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running")
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        try:
            check_token_ids(prompt_token_ids, vocab)
            check_context_length(n, params.max_tokens, self.max_model_len)
        except LimitError as e:
            raise RequestError(str(e)) from None
        cap = self.block_pool.num_blocks if self.block_limit is None else min(self.block_limit,
                                                                                self.block_pool.num_blocks)
        if self.kv_cache_manager.blocks_needed(n + params.max_tokens) > cap:
            raise RequestError(f"the request needs {n + params.max_tokens} tokens of KV cache; "
                               f"the pool holds {cap * self.config.block_size}"
                               + (f" ({self.block_limit_why})" if cap < self.block_pool.num_blocks else ""))
        self._propose_prediction(params)
        seq = self.new_sequence(request_id, prompt_token_ids, params, arrival_time, output_token_ids, priority, lora,
                                cache_salt)
        self.requests[request_id] = seq
        self.scheduler.add(seq, self.requests.get(after) if after is not None else None)
        return seq

    def new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     arrival_time: float | None = None, output_token_ids: list[int] | None = None,
                     priority: int | str = NORMAL, lora: str | None = None, cache_salt: str | None = None) -> Sequence:
        """A sequence that may continue output generated elsewhere, its seeded stream included; lora:
        the name of one of this engine's adapters (its identity then salts the prefix-cache keys)."""
        key = self.loras[lora].key if lora is not None else None
        seq = Sequence(request_id, prompt_token_ids, params, arrival_time, priority_level(priority), lora, key,
                       cache_salt)
        if output_token_ids:
            seq.token_ids += output_token_ids
            seq.prompt_logprobs = None  # they went out with the first token
            if seq.generator is not None:  # one draw per generated token, as the sampler does
                for _ in output_token_ids:
                    torch.empty(self.model.cfg.vocab_size).exponential_(generator=seq.generator)
        return seq

    def _propose_prediction(self, params: SamplingParams) -> None:
        """A request with a predicted output on an engine that speculates not: from now on it has a
        speculator that proposes predictions only (speculative.py)."""
        if params.prediction and self.speculator is None:
            self.speculator = Speculator(None, self.max_model_len, self.config.block_size, grammars=self.grammars)
            self.scheduler.max_draft_tokens = self.speculator.config.num_speculative_tokens

    def detach(self, request_id: str) -> tuple[Sequence, list[int], list[int]]:
        """Takes a running sequence out of this engine with its KV blocks (prefill -> decode handoff).
        Returns (sequence, block ids, block ids this engine keeps sharing)."""
        seq = self.requests.pop(request_id)
        blocks, shared = self.scheduler.detach(seq)
        return seq, blocks, shared

    def adopt(self, seq: Sequence, block_ids: list[int], shared_ids: list[int], num_computed_tokens: int,
              num_cached_tokens: int = 0) -> None:
        """Continues a sequence whose first num_computed_tokens are already in block_ids (shared_ids:
        those the engine it comes from keeps in its prefix cache). Its grammar, if any, is rebuilt
        from its output tokens at its first step; its prompt logprobs went out from where it was prefilled."""
        seq.prompt_logprobs = None
        self._propose_prediction(seq.params)
        self.kv_cache_manager.adopt(seq, block_ids, shared_ids, num_computed_tokens, num_cached_tokens)
        self.requests[seq.request_id] = seq
        self.scheduler.adopt(seq)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def set_swapper(self, swapper) -> None:
        """Where preempted sequences' KV goes when swapped (swap.py's interface; None: recompute only)."""
        self.scheduler.swapper = swapper

    def _swap(self, batch: ScheduledBatch) -> ScheduledBatch:
        """Runs the batch's KV copies (out first: those blocks may be reused in this step). A copy
        out that fails makes that sequence recompute; a copy in that finds fewer blocks resumes
        the sequence from there, and it sits this step out (its chunk began past them)."""
        sched, sw = self.scheduler, self.scheduler.swapper
        for seq, blocks, keys, _ in batch.swap_out:
            t0 = time.perf_counter()
            if sw.swap_out(blocks, keys):
                sched.costs.observe_copy(len(blocks) * sw.block_bytes, time.perf_counter() - t0)
            else:
                sched.swap_failed(seq)
        short = set()
        for seq, blocks, keys, start in batch.swap_in:
            t0 = time.perf_counter()
            restored = sw.swap_in(blocks, keys)
            sched.costs.observe_copy(restored * sw.block_bytes, time.perf_counter() - t0)
            if restored < len(blocks):
                seq.num_computed_tokens = start + restored * self.config.block_size
                short.add(id(seq))
        if not short:
            return batch
        keep = [(s, n) for s, n in zip(batch.seqs, batch.num_tokens) if id(s) not in short]
        return ScheduledBatch([s for s, _ in keep], [n for _, n in keep], sum(1 for _, n in keep if n == 1))

    def _fused_rows(self) -> int | None:
        """The rows a decode-only step of the running sequences may grow to with proposals and keep
        the model's fused step and its tiles (None: the model has no fused step)."""
        rows = getattr(self.model, "fused_decode_rows", None)
        return rows(len(self.scheduler.running)) if rows is not None else None

    def step(self, run: Callable[[int, Callable[[], list]], list] | None = None) -> list[RequestOutput]:
        """run(num_tokens, compute): how the batch's model pass is run once it is scheduled (the
        worker's thread tuner picks the thread count by the step's size); by default, directly."""
        t0 = time.perf_counter()
        proposed = (self.speculator.propose(self.scheduler.running, self.requests, self._fused_rows())
                    if self.speculator else [])
        try:
            outputs = self._step(run)
            if self.speculator is not None and self.last_step_decode_only:  # what proposing costs and gives
                self.speculator.observe_step(time.perf_counter() - t0, sum(len(o.new_token_ids) for o in outputs),
                                             verified=bool(proposed))
            return outputs
        finally:
            for seq in proposed:  # a proposal lives for one step
                seq.draft = None

    def _interruptible(self, batch: ScheduledBatch) -> bool:
        """Only on the CPU (a GPU pass is queued at once), and for steps with no interactive
        sequence and no proposal (a grammar or a draft may hold state for the step's tokens)."""
        return (self.urgent is not None and self.model.device.type == "cpu"
                and not any(s.priority == INTERACTIVE or s.draft is not None for s in batch.seqs))

    def _stop(self, batch: ScheduledBatch) -> Callable[[int], bool] | None:
        """The model's stop(layer) for this step: while what is left of the pass (the layers to come
        at the pace of those done) takes longer than MIN_LEFT_S, and not right after an interrupted
        step (under a stream of interactive arrivals, at most every other step of the other classes
        is lost, never all of them). A time, not a share of the layers: a step of a second's last
        quarter was a 0.3 s wait (measured, a 512-token chunk beside a busy decode worker)."""
        if self.owes_step or not self._interruptible(batch):
            return None
        urgent, layers, t0 = self.urgent, self.model.cfg.num_hidden_layers, time.perf_counter()

        def stop(layer: int) -> bool:
            if not urgent.is_set():
                return False
            return layer == 0 or (time.perf_counter() - t0) / layer * (layers - layer) > MIN_LEFT_S
        return stop

    def _step(self, run) -> list[RequestOutput]:
        self.last_step_decode_only = False
        batch: ScheduledBatch = self.scheduler.schedule()
        if batch.swap_out or batch.swap_in:
            batch = self._swap(batch)
        if not batch.seqs:
            return []
        self.last_step_tokens = sum(batch.num_tokens)
        t0 = time.perf_counter()
        stop = self._stop(batch)
        try:
            results = self.runner.run(batch, stop) if run is None else \
                run(sum(batch.num_tokens), lambda: self.runner.run(batch, stop))
        except Interrupted:
            self.interrupted_steps += 1  # nothing advanced: the next schedule() plans it again
            self.owes_step = True
            self.scheduler.step_ended_early()
            return []
        if self.owes_step and self._interruptible(batch):
            self.owes_step = False  # the step owed ran
        prompt = sum(n for s, n in zip(batch.seqs, batch.num_tokens) if n > 1 and s.draft is None)
        self.last_step_decode_only = prompt == 0
        rates, took = self.scheduler.costs.rates, time.perf_counter() - t0
        if 2 * prompt >= sum(batch.num_tokens):  # mostly prefill: what recomputing costs
            rates.observe_prefill(sum(batch.num_tokens), took)
        elif prompt == 0 and all(s.draft is None for s in batch.seqs):  # plain decodes, one token each
            rates.observe_decode(len(batch.seqs), took)
        now = time.monotonic()
        outputs = []
        for seq, n, res in zip(batch.seqs, batch.num_tokens, results):
            if seq.draft is not None:
                outputs += self._verified(seq, res, now)
                continue
            if res.prompt_logprobs:  # a recompute (preemption) may cover positions it has already
                have = len(seq.prompt_logprobs) - (seq.num_computed_tokens + 1)
                seq.prompt_logprobs += res.prompt_logprobs[have:] if have >= 0 else []
            seq.num_computed_tokens += n
            self.kv_cache_manager.cache_computed_blocks(seq)
            if not res.tokens:
                continue
            prompt_lps, seq.prompt_logprobs = seq.prompt_logprobs, None
            if seq.params.max_tokens == 0:  # echo only: the prompt is computed, nothing generated
                self.scheduler.finish(seq, "length")
                del self.requests[seq.request_id]
                outputs.append(RequestOutput(seq.request_id, [], [], True, "length", seq.num_prompt_tokens, 0,
                                             seq.num_cached_tokens, prompt_lps))
                continue
            token = res.tokens[0]
            if token == NO_TOKEN:
                outputs.append(self._no_token(seq, [], []))
                continue
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                del self.requests[seq.request_id]
            outputs.append(RequestOutput(seq.request_id, [token], res.logprobs, reason is not None, reason,
                                         seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens,
                                         prompt_lps))
        return outputs

    def _no_token(self, seq: Sequence, tokens: list[int], logprobs: list) -> RequestOutput:
        """Ends a sequence whose masks allow no next token (after `tokens`, this step's that stand)."""
        p = seq.params
        named = [n for n, on in (("allowed_token_ids", p.allowed_token_ids), ("bad_words", p.bad_words),
                                 ("min_tokens", seq.num_output_tokens < p.min_tokens),
                                 ("the response format", p.constraint)) if on] or ["the request's masks"]
        self.scheduler.finish(seq, "error")
        del self.requests[seq.request_id]
        return RequestOutput(seq.request_id, tokens, logprobs, True, "error", seq.num_prompt_tokens,
                             seq.num_output_tokens, seq.num_cached_tokens,
                             error=f"no token can follow output token {seq.num_output_tokens}: "
                                   f"{', '.join(named[:-1])}{' and ' if len(named) > 1 else ''}{named[-1]} "
                                   f"together allow none")

    def _verified(self, seq: Sequence, res, now: float) -> list[RequestOutput]:
        """A decode that verified its proposal: its accepted tokens and the next one are appended
        up to a stop (eos, stop token, grammar end, max_tokens: the rest are dropped); its KV is kept
        for the positions whose tokens stand, and the blocks past its tokens are freed."""
        c = seq.num_computed_tokens
        self.speculator.record(len(seq.draft.tokens), len(res.tokens) - 1)
        reason, kept = None, 0
        for token in res.tokens:
            if token == NO_TOKEN:
                reason = "error"
                break
            seq.token_ids.append(token)
            kept += 1
            reason = self._stop_reason(seq, token)
            if reason:
                break
        seq.num_computed_tokens = c + kept  # positions c .. c + kept - 1 hold tokens that stand
        self.kv_cache_manager.cache_computed_blocks(seq)
        self.kv_cache_manager.trim(seq)
        if reason == "error":
            return [self._no_token(seq, res.tokens[:kept], res.logprobs[:kept])]
        if reason:
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
        return [RequestOutput(seq.request_id, res.tokens[:kept], res.logprobs[:kept], reason is not None, reason,
                              seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens)]

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_token_ids and (not p.ignore_eos or p.constraint)) or token in p.stop_token_ids:
            return "stop"
        if p.constraint is not None:
            g = self.grammars.advance(seq)
            if g is not None and (g.is_stopped() or g.is_error()):  # complete: nothing but EOS could follow
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Runs prompts to completion; returns each one's output token ids (for tests and tools)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        seqs = [self.add_request(r, p, sp) for r, p, sp in zip(ids, prompts, plist)]
        while self.has_unfinished():
            self.step()
        return [s.output_token_ids for s in seqs]

    @property
    def stats(self) -> dict:
        kv, sched = self.kv_cache_manager, self.scheduler
        running = [sum(s.priority == p for s in sched.running) for p in range(len(PRIORITIES))]
        return {"num_running": sched.num_running, "num_waiting": sched.num_waiting,
                "kv_usage": self.block_pool.usage, "num_blocks": self.block_pool.num_blocks,
                "prefix_queries": kv.prefix_queries, "prefix_hits": kv.prefix_hits,
                "num_preemptions": sched.num_preemptions, "interrupted_steps": self.interrupted_steps,
                "num_priority_preemptions": sched.num_priority_preemptions,
                "preemptions_by_mode": dict(sched.preemptions_by_mode),
                "running_by_priority": dict(zip(PRIORITIES, running)),
                "waiting_by_priority": dict(zip(PRIORITIES, sched.waiting.counts())),
                "spec_decode": self.speculator.stats.as_dict() if self.speculator else {}}


__all__ = ["EngineConfig", "LLMEngine", "RequestError", "RequestOutput", "SamplingParams", "SequenceStatus"]

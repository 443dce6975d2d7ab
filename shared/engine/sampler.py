"""Turns one step's logits into tokens, each row under its own request's sampling parameters.

A seeded request draws its noise from its own generator, one draw per step, so its tokens do not
depend on what else is in the batch. Sampling uses the exponential-race form of the categorical
draw (argmax of p / Exp(1) noise), which needs no cumulative sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import SamplingParams


@dataclass
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: list[tuple[int, float]]  # the most likely alternatives, best first


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row of logits, temperature applied and top-k / top-p / min-p masked out."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1:
        sorted_logits, idx = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
        logits = logits.scatter(0, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [rows, vocab] float32."""
    tokens = logits.argmax(-1).tolist()  # greedy rows are done
    for i, p in enumerate(params):
        if p.greedy:
            continue
        g = generators[i]
        # A seeded request's generator lives on the CPU (Sequence): its row is sampled there, so its
        # noise stream is the same on every backend and in every batch.
        row = logits[i] if g is None else logits[i].to(g.device)
        probs = _filter(row, p).softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=g)
        tokens[i] = int((probs / noise).argmax())
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        k = max(params[i].logprobs for i in want)
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
        for r, i in enumerate(want):
            n = params[i].logprobs
            top = list(zip(top_i[r, :n].tolist(), top_v[r, :n].tolist())) if n else []
            out[i] = TokenLogprobs(float(lp[r, tokens[i]]), top)
    return tokens, out

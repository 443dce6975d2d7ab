"""Turns one step's logits into tokens, each row under its own request's sampling parameters.

Logits processors first, each vectorized over the rows that use it (a row that uses none costs
nothing), in Transformers' order: logit bias, repetition penalty, then OpenAI's presence and
frequency penalties, min_tokens (EOS and stop tokens masked), vLLM's allowed_token_ids and
bad_words (masks), and last the structured-output mask. Then greedy rows take the argmax; the
others get temperature, top-k, top-p, min-p and an exponential race (argmax of p / Exp(1) noise,
no cumulative sums). A seeded request draws its noise from its own generator, one draw per step,
so its tokens do not depend on the batch.
Logprobs are those of the raw distribution (before any processor, as vLLM reports them).
A row whose masks together leave no token (allowed_token_ids against the grammar, say) gets
NO_TOKEN: the engine fails that request saying so, rather than emit an arbitrary token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .sequence import SamplingParams

if TYPE_CHECKING:
    from .sequence import Sequence


NO_TOKEN = -1  # a row's masks allow no token at all


@dataclass
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: list[tuple[int, float]]  # the most likely alternatives, best first
    rank: int | None = None  # of the token in its distribution (1: the most likely); prompt logprobs only


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


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _token_table(rows: list[list[int]], vocab: int, device, counts: bool) -> torch.Tensor:
    """[len(rows), vocab]: how often each token occurs in each row (counts) or whether it does."""
    ids = _padded(rows, vocab, device)  # the pad id lands in an extra column, dropped below
    out = torch.zeros(len(rows), vocab + 1, device=device)
    if counts:
        out.scatter_add_(1, ids, torch.ones_like(ids, dtype=out.dtype))
    else:
        out.scatter_(1, ids, 1.0)
    return out[:, :vocab]


def banned_by_bad_words(output: list[int], bad_words: list[list[int]]) -> list[int]:
    """The tokens that would complete a bad word after `output` (vLLM's rule: a word's last token,
    where the output ends with the tokens before it)."""
    return [w[-1] for w in bad_words if len(w) == 1 or output[len(output) - len(w) + 1:] == w[:-1]]


def process_logits(logits: torch.Tensor, seqs: list["Sequence"], eos_token_ids: list[int],
                   masks: tuple[list[int], torch.Tensor] | None = None) -> tuple[torch.Tensor, list[int]]:
    """The logits every row samples from (a copy with the processors applied, or `logits` itself
    when no row uses any), and the rows whose masks leave no token. masks: (rows, their
    constraints' allowed tokens, bool [len(rows), >= vocab])."""
    vocab, dev = logits.shape[-1], logits.device
    params = [s.params for s in seqs]
    bias = [i for i, p in enumerate(params) if p.logit_bias]
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    pf = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    short = [i for i, (s, p) in enumerate(zip(seqs, params))
             if s.num_output_tokens < p.min_tokens and not (s.grammar is not None and s.grammar.is_stopped())]
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
    bad = [(i, t) for i, (s, p) in enumerate(zip(seqs, params)) if p.bad_words
           for t in banned_by_bad_words(s.output_token_ids, p.bad_words)]
    if not (bias or rep or pf or short or allowed or bad or masks):
        return logits, []
    logits = logits.clone()
    if bias:
        r = [i for i in bias for _ in params[i].logit_bias]
        t = [tok for i in bias for tok in params[i].logit_bias]
        v = [b for i in bias for b in params[i].logit_bias.values()]
        logits.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                          torch.tensor(v, dtype=logits.dtype, device=dev), accumulate=True)
    if rep:  # Transformers' RepetitionPenaltyLogitsProcessor, over prompt and output
        seen = _token_table([seqs[i].token_ids for i in rep], vocab, dev, counts=False).bool()
        pen = torch.tensor([params[i].repetition_penalty for i in rep], device=dev).unsqueeze(1)
        sub = logits[rep]
        logits[rep] = torch.where(seen, torch.where(sub < 0, sub * pen, sub / pen), sub)
    if pf:  # OpenAI's: logit - frequency * count - presence * (count > 0), over the output
        outs = [seqs[i].output_token_ids for i in pf]
        if any(outs):
            count = _token_table(outs, vocab, dev, counts=True)
            freq = torch.tensor([params[i].frequency_penalty for i in pf], device=dev).unsqueeze(1)
            pres = torch.tensor([params[i].presence_penalty for i in pf], device=dev).unsqueeze(1)
            logits[pf] -= freq * count + pres * (count > 0)
    if short:
        r = [i for i in short for _ in range(len(eos_token_ids) + len(params[i].stop_token_ids))]
        t = [tok for i in short for tok in [*eos_token_ids, *params[i].stop_token_ids]]
        if t:
            logits[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = float("-inf")
    if allowed:
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=dev)
        for row, i in enumerate(allowed):
            keep[row, params[i].allowed_token_ids] = True
        logits[allowed] = logits[allowed].masked_fill_(~keep, float("-inf"))
    if bad:
        r, t = zip(*bad)
        logits[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = float("-inf")
    if masks:
        rows, grammar_allows = masks
        banned = ~grammar_allows[:, :vocab].to(dev)
        if rows == list(range(len(seqs))):  # every row constrained: in place, no gather
            logits.masked_fill_(banned, float("-inf"))
        else:
            logits[rows] = logits[rows].masked_fill_(banned, float("-inf"))
    # Only masks remove every token: check just the rows they touched (a row's max: 0.1 ms for 64
    # rows of 49,152, where isneginf(...).all() took 1.7).
    masked = {*short, *allowed, *(i for i, _ in bad), *(masks[0] if masks else ())}
    top = logits.amax(-1).tolist() if masked else []
    return logits, sorted(i for i in masked if top[i] == float("-inf"))


def argmax_rows(x: torch.Tensor) -> list[int] | int:
    """Each row's argmax (the first on ties, NaN counting as the largest, as torch's). On the CPU
    numpy's: torch's CPU argmax over one 49152-entry row took 240 us against numpy's 15, about 2%
    of a batch-1 token of the default model."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return x.numpy().argmax(-1).tolist()
    return x.argmax(-1).tolist()


def sample(logits: torch.Tensor, seqs: list["Sequence"], eos_token_ids: list[int] = (),
           masks: tuple[list[int], torch.Tensor] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [rows, vocab] float32, a row per sequence."""
    params = [s.params for s in seqs]
    processed, dead = process_logits(logits, seqs, list(eos_token_ids), masks)
    tokens = argmax_rows(processed)  # greedy rows are done
    for i in dead:
        tokens[i] = NO_TOKEN
    for i, p in enumerate(params):
        if p.greedy or i in dead:
            continue
        g = seqs[i].generator
        # A seeded request's generator lives on the CPU (Sequence): its row is sampled there, so its
        # noise stream is the same on every backend and in every batch.
        row = processed[i] if g is None else processed[i].to(g.device)
        probs = _filter(row, p).softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=g)
        tokens[i] = argmax_rows(probs / noise)
    return tokens, logprobs_of(logits, tokens, [None if i in dead else p.logprobs for i, p in enumerate(params)])


def logprobs_of(logits: torch.Tensor, tokens: list[int], top: list[int | None],
                ranks: bool = False) -> list[TokenLogprobs | None]:
    """Each row's logprob of its token and its `top[row]` best alternatives (None: not wanted);
    ranks: each token's rank too (a pass over the vocabulary, so only where it is shown: vLLM's
    prompt_logprobs)."""
    want = [i for i, k in enumerate(top) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    if want:
        lp = torch.log_softmax(logits[want].float(), dim=-1)
        k = max(top[i] for i in want)
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
        picked = lp[torch.arange(len(want)), torch.tensor([tokens[i] for i in want])]
        rank = ((lp > picked.unsqueeze(1)).sum(-1) + 1).tolist() if ranks else [None] * len(want)
        picked = picked.tolist()
        for r, i in enumerate(want):
            n = top[i]
            alts = list(zip(top_i[r, :n].tolist(), top_v[r, :n].tolist())) if n else []
            out[i] = TokenLogprobs(picked[r], alts, rank[r])
    return out

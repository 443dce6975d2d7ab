"""Verifying a proposal: which of the proposed tokens the target model keeps, and the token after.

The target computed logits at each of the k + 1 positions of the proposal (the sequence's last
token, then the k proposed ones), so row i is its distribution p_i after the first i proposed
tokens. Each row gets the request's logits processors and filters as the sampler applies them,
over the tokens it would follow (penalties and min_tokens see the proposed tokens before it; a
structured-output mask is the grammar's after them), so p_i is exactly what sampling one token at
a time would draw from.

- Greedy: the proposed tokens are kept while each equals its row's argmax; then the argmax of the
  first row that disagrees (or of the last row). The output equals greedy decoding's.
- Sampled, the standard rule (Leviathan et al. 2023; Chen et al. 2023): proposed token d_i drawn
  from q_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token
  comes from norm(max(0, p_i - q_i)), and when all are kept one more from p_k. Every output token
  then has the target's distribution. A prompt-lookup proposal is a point mass (q_i(d_i) = 1):
  d_i is kept with probability p_i(d_i), else the token comes from p_i without d_i.

Random numbers come from the request's generator when it is seeded. Logprobs are those of the raw
distributions, as the sampler reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .sampler import NO_TOKEN, TokenLogprobs, _filter, argmax_rows, logprobs_of, process_logits

if TYPE_CHECKING:
    from .sequence import SamplingParams, Sequence


@dataclass
class _Ahead:
    """A sequence as it would be after its first i proposed tokens: what the logits processors read."""

    params: "SamplingParams"
    token_ids: list[int]
    num_prompt_tokens: int
    grammar: object = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def _race(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn in proportion to `weights` (need not sum to 1): the sampler's exponential race."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())


def verify(logits: torch.Tensor, seq: "Sequence", eos_token_ids: list[int] = (),
           masks: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [k + 1, vocab], the target's rows at the positions of seq's proposal (seq.draft);
    masks: the grammar's allowed tokens at each position (bool [k + 1, >= vocab]) when constrained.
    Returns the new tokens (the accepted proposed ones, then one more) and their logprobs."""
    draft, p = seq.draft, seq.params
    views = [_Ahead(p, seq.token_ids + draft.tokens[:i], seq.num_prompt_tokens) for i in range(len(draft.tokens) + 1)]
    processed, dead = process_logits(logits, views, list(eos_token_ids),
                                     None if masks is None else (list(range(len(views))), masks))
    # A position whose masks leave no token cuts the proposal there; reached, its token is NO_TOKEN.
    proposed = draft.tokens[:dead[0]] if dead else draft.tokens
    k = len(proposed)
    if p.greedy:
        best = argmax_rows(processed)
        a = 0
        while a < k and best[a] == proposed[a]:
            a += 1
        tokens = proposed[:a] + [best[a]]
    else:
        g = seq.generator
        rows = processed if g is None else processed.to(g.device)
        probs = torch.stack([_filter(r, p).softmax(-1) for r in rows])
        u = torch.rand(k, generator=g, device=probs.device).tolist()
        tokens = []
        for i, d in enumerate(proposed):
            q = None if draft.probs is None else draft.probs[i].to(probs.device)
            qd = 1.0 if q is None else float(q[d])
            if u[i] * qd < float(probs[i, d]):  # accepted with probability min(1, p/q)
                tokens.append(d)
                continue
            if q is None:  # a point mass at d: the residual is p without d
                residual = probs[i].clone()
                residual[d] = 0
            else:
                residual = (probs[i] - q).clamp_min_(0)
            if float(residual.sum()) <= 0:  # only by rounding (a rejection means p > q somewhere)
                residual = probs[i]
            tokens.append(_race(residual, g))
            break
        else:
            tokens.append(_race(probs[k], g))
    top = [p.logprobs] * len(tokens)
    if dead and len(tokens) == k + 1:
        tokens[-1], top[-1] = NO_TOKEN, None
    return tokens, logprobs_of(logits[:len(tokens)], tokens, top)

"""The engine's door to the mesh: wire messages (shared/schemas.py, which know nothing of the
engine) to the engine's own types and back. A worker converts here, and only here."""

from __future__ import annotations

from meshserve.shared.schemas import Logprob, Sampling

from .sampler import TokenLogprobs
from .sequence import SamplingParams


def sampling_params(s: Sampling, stop: list[str] | None = None, skip_special_tokens: bool = True,
                    include_stop_str_in_output: bool = False) -> SamplingParams:
    """The engine's parameters for a request's wire Sampling. `stop` and the text options never
    travel (the gateway, or the in-process OutputProcessor, detokenizes and matches them on the text)."""
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          min_p=s.min_p, seed=s.seed, stop=list(stop or []), skip_special_tokens=skip_special_tokens,
                          include_stop_str_in_output=include_stop_str_in_output, stop_token_ids=list(s.stop_token_ids),
                          ignore_eos=s.ignore_eos, logprobs=s.logprobs, logit_bias=s.logit_bias,
                          repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty, min_tokens=s.min_tokens,
                          allowed_token_ids=s.allowed_token_ids, bad_words=[list(w) for w in s.bad_words],
                          constraint=None if s.constraint is None else tuple(s.constraint),
                          reasoning_end=s.reasoning_end, reasoning_start=s.reasoning_start, prediction=s.prediction,
                          prompt_logprobs=s.prompt_logprobs)


def logprob(lp: TokenLogprobs | None) -> Logprob | None:
    return None if lp is None else Logprob(logprob=lp.logprob, top=lp.top, rank=lp.rank)

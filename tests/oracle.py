"""The correctness oracle: Hugging Face Transformers' greedy decoding, one prompt at a time (no
padding, so nothing but the weights can differ from what the engine computes)."""

from __future__ import annotations

import torch


def hf_greedy(hf, prompts: list[list[int]], max_new_tokens: int, eos_token_ids: list[int],
              cache=None) -> list[list[int]]:
    """cache: makes each prompt's KV cache (a transformers Cache), e.g. one that rounds K/V as ours does."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            extra = {} if cache is None else {"past_key_values": cache()}
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_ids,
                              pad_token_id=0, **extra)
            out.append(ids[0, len(p):].tolist())
    return out

"""Prompt lookup (n-gram) proposals: no second model. When a sequence's last n tokens appeared
before in its prompt or output, the tokens that followed them then are proposed to follow now.
It pays where outputs copy from the prompt (editing, extraction, code, quoting) and costs nearly
nothing where they do not (no match, no proposal).

The longest n-gram first (prompt_lookup_max down to prompt_lookup_min), at its most recent earlier
occurrence that has k tokens after it (recent text is the likeliest to repeat), else at its first.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .sequence import Draft, Sequence


class NgramProposer:
    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, not "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft | None]:
        return [self.lookup(s.token_ids, k) for s, k in zip(seqs, ks)]

    def lookup(self, token_ids: list[int], k: int) -> Draft | None:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram."""
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(ids[:-1], n)  # every n-gram that has a token after it
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                full = hits[hits + n + k <= len(ids)]
                start = int(full[-1] if len(full) else hits[0]) + n
                return Draft(ids[start:start + k].tolist())
        return None

    def retain(self, request_ids) -> None:
        """Nothing is kept per sequence."""

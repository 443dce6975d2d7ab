"""Proposals with no second model: prompt lookup (n-gram), and a request's predicted output.

Prompt lookup: when a sequence's last n tokens appeared before in its prompt or output, the tokens
that followed them then are proposed to follow now.
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
            hits = _hits(ids[:-1], ids[-n:])
            if len(hits):
                full = hits[hits + n + k <= len(ids)]
                start = int(full[-1] if len(full) else hits[0]) + n
                return Draft(ids[start:start + k].tolist())
        return None

    def retain(self, request_ids) -> None:
        """Nothing is kept per sequence."""


def _hits(corpus: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Where `pattern` occurs in `corpus` (start indexes, in order)."""
    if len(pattern) > len(corpus):
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero((sliding_window_view(corpus, len(pattern)) == pattern).all(axis=1))


class PredictionProposer:
    """Proposals from a request's predicted output (OpenAI's Predicted Outputs: `prediction`, say the
    code being edited): the tokens that follow the output's longest suffix n-gram (MIN_N to MAX_N
    tokens; the first output token alone while it is the only one) in the
    prediction, at the occurrence nearest the place the last proposal was taken from (code repeats
    short n-grams). Where the output leaves the prediction (an edit), no proposal until it rejoins:
    one common token in both is no sign of that (a wrong prediction then proposes all the time,
    and every proposal is rejected)."""

    MIN_N, MAX_N = 2, 8

    def __init__(self):
        self.cursor: dict[str, int] = {}  # request id -> where in its prediction the last proposal began
        self.arrays: dict[str, np.ndarray] = {}  # request id -> its prediction, made an array once

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft | None]:
        return [self.lookup(s, k) for s, k in zip(seqs, ks)]

    def lookup(self, seq: Sequence, k: int) -> Draft | None:
        """seq has an output (its first token comes from its prompt's step, which verifies nothing)."""
        pred, out = seq.params.prediction, seq.output_token_ids
        p = self.arrays.get(seq.request_id)
        if p is None:
            p = self.arrays[seq.request_id] = np.asarray(pred, dtype=np.int64)
        o = np.asarray(out[-self.MAX_N:], dtype=np.int64)
        cursor = self.cursor.get(seq.request_id, 0)
        for n in range(len(o), min(self.MIN_N, len(o)) - 1, -1):
            ends = _hits(p[:-1], o[-n:]) + n  # where each occurrence's next token is
            if len(ends):
                ahead = ends[ends >= cursor]
                start = self.cursor[seq.request_id] = int(ahead[0] if len(ahead) else ends[-1])
                return Draft(list(pred[start:start + k]))
        return None

    def retain(self, request_ids) -> None:
        for kept in (self.cursor, self.arrays):
            for rid in [r for r in kept if r not in request_ids]:
                del kept[rid]

"""Speculative decoding: who proposes, for which sequences, and how many tokens; the counters.

Before each step the engine asks the Speculator for proposals (seq.draft) for its decoding
sequences; the scheduler gives each one that fits its budget and free blocks a chunk of 1 + k
tokens (scheduler.py), the target verifies them in that one step (model_runner.py,
rejection_sampler.py), and the engine keeps the accepted tokens and rolls the rest back
(num_computed_tokens, and the blocks past the tokens freed). Proposals live for one step only.

- Proposers: prompt lookup (`method="ngram"`, ngram_proposer.py) or a draft model with the same
  vocabulary (`method="draft"`, draft_proposer.py); and, for a request that brings a predicted
  output (OpenAI's `prediction`), that prediction first, in every class and on every model (the
  engine makes a Speculator for it on the first such request when the model has none).
- Per request class: only the classes in `classes` speculate (default interactive and normal:
  a background batch runs where throughput, not latency, matters).
- Turned down when the batch is large: above `disable_by_batch_size` running sequences nobody
  speculates. A step of B decodes then costs B rows; verifying k tokens each makes it B(k + 1),
  which on a CPU stops being nearly free once the step's matrix products leave the memory-bound
  regime (docs/speculative.md: how the default was chosen and how to measure it).
- Turned down when it does not pay: `Payoff` measures decode-only steps' output tokens per second
  with proposals and without, on this machine and model, and proposes only while verifying is
  the faster (a fused decode step can be faster than any verification on a CPU).
- Cut to the model's fast path: where the model runs decode-only steps of up to N rows in one
  fused call (int8 or blocked bf16 weights on a CPU), proposals are cut so a verification step fits
  the N rows of the fused plan its plain step runs (the same tiles, so the same bits per row).
- A structured-output request's proposal is cut where its grammar rejects a token.

Torch-free at import (the launcher reads the flags here); the proposers load on use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshserve.shared.limits import PRIORITIES, priority_level

if TYPE_CHECKING:
    from .sequence import Sequence

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) or "draft" (a draft model)
    num_speculative_tokens: int = 4  # k: most tokens proposed per step
    prompt_lookup_min: int = 1  # n-gram sizes prompt lookup matches, longest first
    prompt_lookup_max: int = 3
    model: str | None = None  # the draft model (a path or name the model loaders know), for "draft"
    classes: tuple[str, ...] = ("interactive", "normal")  # request classes that speculate
    disable_by_batch_size: int = 4  # nobody speculates while more sequences run
    draft_kv_blocks: int = 1024  # the draft model's own KV cache, in blocks

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        bad = [c for c in self.classes if c not in PRIORITIES]
        if bad:
            raise ValueError(f"unknown request class {bad[0]!r} in speculative classes; one of {', '.join(PRIORITIES)}")


@dataclass
class SpecStats:
    """Counters: tokens proposed and verified, of those accepted, and verifications (one per
    sequence per step). Tokens per verification = (accepted + verifications) / verifications."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verification_steps: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "num_verification_steps": self.num_verification_steps}


class Payoff:
    """Whether proposing pays, measured: the output tokens per second of decode-only steps with
    proposals and without (exponential means). It proposes until it has SAMPLES of each kind (one
    step in WARMUP_EVERY goes without, so plain steps get measured even when every decode has a
    proposal), then only while verifying makes tokens faster; one step in PROBE_EVERY tries the
    other way, so a change of acceptance, batch or load is seen."""

    SAMPLES = 8
    WARMUP_EVERY = 4
    PROBE_EVERY = 32

    def __init__(self):
        self.rate = {True: 0.0, False: 0.0}  # tokens per second, by whether the step verified
        self.samples = {True: 0, False: 0}
        self.steps = 0

    def observe(self, seconds: float, tokens: int, verified: bool) -> None:
        r = tokens / max(seconds, 1e-9)
        n = self.samples[verified]
        self.rate[verified] = r if n == 0 else 0.8 * self.rate[verified] + 0.2 * r
        self.samples[verified] = n + 1

    @property
    def measured(self) -> bool:
        return min(self.samples.values()) >= self.SAMPLES

    def pays(self) -> bool:
        return not self.measured or self.rate[True] >= self.rate[False]

    def proposes(self) -> bool:
        """Whether this step proposes."""
        self.steps += 1
        probe = self.steps % (self.PROBE_EVERY if self.measured else self.WARMUP_EVERY) == 0
        return self.pays() != probe


class Speculator:
    def __init__(self, config: SpeculativeConfig | None, max_model_len: int, block_size: int, draft_model=None,
                 grammars=None):
        """config None: only requests with a predicted output propose (the model speculates not)."""
        from .ngram_proposer import NgramProposer, PredictionProposer

        self.prediction = PredictionProposer()
        self.config = config or SpeculativeConfig(classes=())
        self.config.validate()
        self.max_model_len, self.grammars = max_model_len, grammars
        self.levels = {priority_level(c) for c in self.config.classes}
        if config is None:
            self.proposer = None
        elif config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            if draft_model is None:
                raise ValueError("speculative method 'draft' needs a draft model")
            from .draft_proposer import DraftModelProposer

            self.proposer = DraftModelProposer(draft_model, config.draft_kv_blocks, block_size)
        self.stats = SpecStats()
        self.payoff = Payoff()

    def _room(self, seq: "Sequence") -> int:
        """Tokens seq may propose: k, less what would pass max_tokens or the context."""
        p = seq.params
        return min(self.config.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1)

    def propose(self, running: list["Sequence"], live_ids, max_rows: int | None = None) -> list["Sequence"]:
        """Sets seq.draft on the running sequences that decode and speculate this step; returns them.
        max_rows: the most rows a decode-only step of these sequences may have and stay on the
        model's fast path (the fused step, on the tiles a plain step runs, so every row keeps its
        bits); proposals are cut to fit it, since a verification off that path costs more than
        its tokens give and could change a greedy token (None: no such path)."""
        for proposer in (self.proposer, self.prediction):
            if proposer is not None:
                proposer.retain(live_ids)
        if len(running) > self.config.disable_by_batch_size or not self.payoff.proposes():
            return []
        seqs = [s for s in running if (s.params.prediction or s.priority in self.levels) and s.num_output_tokens
                and s.num_tokens - s.num_computed_tokens == 1 and self._room(s) > 0]
        ks = [self._room(s) for s in seqs]
        if max_rows is not None and seqs:
            per = (max_rows - len(running)) // len(seqs)
            seqs, ks = [s for s in seqs if per > 0], [min(k, per) for k in ks if per > 0]
        out = []
        for s, d in zip(seqs, self._proposals(seqs, ks)):
            if d is not None and s.params.constraint is not None:
                d = d.truncate(self.grammars.valid_prefix(s, d.tokens))
            if d is not None and d.tokens:
                s.draft = d
                out.append(s)
        return out

    def _proposals(self, seqs: list["Sequence"], ks: list[int]) -> list:
        """Each sequence's proposal: from its predicted output when it has one and it proposes, else
        from the model's proposer (for the classes that speculate)."""
        out = [None] * len(seqs)
        for proposer, rows in ((self.prediction, [i for i, s in enumerate(seqs) if s.params.prediction]),
                               (self.proposer, None)):
            if rows is None:  # what the prediction left
                rows = [i for i, s in enumerate(seqs) if out[i] is None and s.priority in self.levels]
            if proposer is not None and rows:
                for i, d in zip(rows, proposer.propose([seqs[i] for i in rows], [ks[i] for i in rows])):
                    out[i] = d
        return out

    def observe_step(self, seconds: float, tokens: int, verified: bool) -> None:
        """A decode-only step's wall time (its proposals' included) and the tokens it produced."""
        self.payoff.observe(seconds, tokens, verified)

    def record(self, num_draft: int, num_accepted: int) -> None:
        st = self.stats
        st.num_draft_tokens += num_draft
        st.num_accepted_tokens += num_accepted
        st.num_verification_steps += 1


def add_speculative_arguments(p) -> None:
    """The workers' (and `meshserve up`'s) speculative decoding flags."""
    p.add_argument("--speculative", choices=["ngram"], default=None,
                   help="speculative decoding by prompt lookup (n-gram, no second model); see docs/speculative.md")
    p.add_argument("--speculative-model", default=None,
                   help="speculative decoding with this draft model (same tokenizer as --model)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens proposed per step (k)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="smallest n-gram prompt lookup matches")
    p.add_argument("--prompt-lookup-max", type=int, default=3, help="largest n-gram prompt lookup matches")
    p.add_argument("--speculative-classes", default="interactive,normal",
                   help="request classes that speculate (comma-separated; default: %(default)s)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=SpeculativeConfig.disable_by_batch_size,
                   help="no speculation while more sequences than this run (default: %(default)s)")


def speculative_options(a) -> list[str]:
    """The flags again, for a command line (the launcher passes them to the workers)."""
    if not (getattr(a, "speculative", None) or getattr(a, "speculative_model", None)):
        return []
    out = ["--speculative", a.speculative] if a.speculative else ["--speculative-model", a.speculative_model]
    return out + ["--num-speculative-tokens", str(a.num_speculative_tokens),
                  "--prompt-lookup-min", str(a.prompt_lookup_min), "--prompt-lookup-max", str(a.prompt_lookup_max),
                  "--speculative-classes", a.speculative_classes,
                  "--speculative-disable-by-batch-size", str(a.speculative_disable_by_batch_size)]


def config_from_args(a) -> SpeculativeConfig | None:
    """The flags as a config (None: no speculation); raises ValueError for a bad combination."""
    if a.speculative and a.speculative_model:
        raise ValueError("--speculative ngram and --speculative-model are alternatives: give one")
    if not (a.speculative or a.speculative_model):
        return None
    cfg = SpeculativeConfig(method="ngram" if a.speculative else "draft", model=a.speculative_model,
                            num_speculative_tokens=a.num_speculative_tokens, prompt_lookup_min=a.prompt_lookup_min,
                            prompt_lookup_max=a.prompt_lookup_max,
                            classes=tuple(c.strip() for c in a.speculative_classes.split(",") if c.strip()),
                            disable_by_batch_size=a.speculative_disable_by_batch_size)
    cfg.validate()
    return cfg

"""Speculation that adapts to load: which program decodes the slot engine's next chunk.

A round of the server's speculative method costs more than a plain AR round and adds
more tokens per row; how much more it costs depends on how many rows the chunk runs (a
CPU or an accelerator at a small batch is bound by reading the weights, so verifying 5
positions costs little more than 1; a full batch is bound by compute, and every drafted
position is paid for). So per row bucket R the engine keeps the round cost of each
program, measured when it warms (`measure`), and picks the one with more expected
tokens a second (Lemma 3.1 with the costs at R):

    speculate at R  iff  tokens_per_round / cost_spec(R) > MARGIN / cost_ar(R)

with a margin for what the round costs leave out: the costs are measured on short
contexts, and speculation has costs outside the round (the draft's prefill of each
prompt, its catch-up after AR chunks).

tokens_per_round is what the traffic actually gets: a decaying count of the tokens and
rounds of the speculative chunks run so far (acceptance is a property of the requests,
not of R, so a run at one bucket informs the others). Before any is run it is the
optimistic prior of a fully accepted block, so speculation is tried first; a bucket
that stays on AR keeps the estimate other buckets measure, and one chunk in about
PROBE_EVERY (more where a speculative round costs more) speculates anyway where a fully
accepted block would pay, so traffic that starts to
pay is noticed (cf. SmartSpec, Liu et al.
2024: speculation length chosen by goodput from a batch cost model).
"""

from __future__ import annotations

import dataclasses


# The count is halved when it holds this many rounds: the estimate follows the traffic
# of the last few hundred rounds.
MEMORY_ROUNDS = 512
# Weight of the prior (a fully accepted block), in rounds.
PRIOR_ROUNDS = 2
# How much more a speculative chunk must be expected to deliver than an AR one: on the
# 2-core CPU, where a long prompt's prefill dominates, the draft's share of the prefill
# alone was ~5% of a load's time (docs/results.md, serving under load).
MARGIN = 1.1
# After this many AR chunks in a row (times the cost ratio of the two programs at the
# bucket: a probe costs about that ratio less one AR chunk, so probing stays ~1-2% of
# the time wherever it happens), one speculative chunk refreshes the estimate.
PROBE_EVERY = 64


@dataclasses.dataclass
class OccupancyPolicy:
    """Round costs (seconds) per row bucket of the speculative and the AR program, and the
    running tokens per speculative round."""

    spec_cost: dict[int, float]
    ar_cost: dict[int, float]
    round_span: int  # most tokens a speculative round adds (the prior)
    tokens: float = 0.0
    rounds: float = 0.0
    ar_chunks: int = 0  # AR chunks since the last speculative one

    def __post_init__(self):
        if set(self.spec_cost) != set(self.ar_cost):
            raise ValueError("round costs must cover the same row buckets for both programs")
        if not self.rounds:
            self.tokens, self.rounds = self.round_span * PRIOR_ROUNDS, PRIOR_ROUNDS

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds

    def speculate(self, rows: int) -> bool:
        """Whether the chunk at row bucket `rows` should run the speculative program
        (also: whether a request admitted at that bucket gets the draft's prefill)."""
        return self.tokens_per_round / self.spec_cost[rows] > MARGIN / self.ar_cost[rows]

    def can_pay(self, rows: int) -> bool:
        """Whether a fully accepted block would beat AR at `rows` rows."""
        return self.round_span / self.spec_cost[rows] > MARGIN / self.ar_cost[rows]

    def choose(self, rows: int) -> bool:
        """`speculate`, except that after PROBE_EVERY x (cost ratio) AR chunks in a row
        one speculates where speculation can pay at all (a probe where it cannot would
        cost a chunk and tell nothing the choice could use)."""
        due = self.ar_chunks + 1 >= PROBE_EVERY * self.spec_cost[rows] / self.ar_cost[rows]
        if self.speculate(rows) or (self.can_pay(rows) and due):
            self.ar_chunks = 0
            return True
        self.ar_chunks += 1
        return False

    def observe(self, tokens: int, rounds: int) -> None:
        """A speculative chunk's row-rounds and the tokens they added."""
        self.tokens += tokens
        self.rounds += rounds
        if self.rounds > MEMORY_ROUNDS:
            self.tokens, self.rounds = self.tokens / 2, self.rounds / 2

    def table(self) -> list[dict]:
        """Per bucket: both round costs and the tokens per round speculation needs
        (MARGIN * cost_spec / cost_ar), for the server's start-up line."""
        return [{"rows": r, "spec_round_s": self.spec_cost[r], "ar_round_s": self.ar_cost[r],
                 "break_even_tokens_per_round": MARGIN * self.spec_cost[r] / self.ar_cost[r],
                 "speculate": self.speculate(r)} for r in sorted(self.spec_cost)]

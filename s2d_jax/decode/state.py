"""Static decode settings, traced decode settings, and the donated generation state.

Static (a change recompiles): method, exits, gamma, chain levels and their mu, buffer
sizes, confidence kind, K/V scheme. Traced (a change never recompiles): thresholds, temperature, top-k, top-p,
max_new_tokens, EOS id, the dynamic-draft-length stop threshold.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from s2d_jax.errors import S2DError
from s2d_jax.model.exits import exits_problem
from s2d_jax.model.kvcache import KVCache
from s2d_jax.decode.checks import check_lookup, check_thresholds
from s2d_jax.decode.methods import DEFAULT_GAMMA, DEFAULT_NGRAM, Proposer, proposer
from s2d_jax.decode.sampling import CONFIDENCE_KINDS, SamplingParams

KV_FILL = ("calm", "full")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static shape of a generation.

    method: a row of decode/methods.py's table (ar: the target alone, sd: one fixed draft
      exit, self: the target's own first `exits[0]` layers as draft, s2d: the sorted draft
      escalating over `exits`, lookup / ladder below).
    exits: draft exit depths e_1 < ... < e_m (layer counts); one exit for sd/self.
    gamma: draft tokens per round (0 for ar).
    max_len: cache / token buffer length per row; a row stops when it is full.
    kv_fill: how layers skipped by an early exit get keys/values, see drafting.py.
    mus: one accumulation length mu_k >= 1 per intermediate level of a polybasic chain
      (draft -> intermediate_1 -> ... -> target, round.py); () = two-level S2D.
    lookup (the lowest rung copies from the context, decode/lookup.py) and ladder (the
      lookup's tokens, then the sorted draft's `exits` after them): ngram = (n_min, n_max)
      the suffix lengths matched; lookup_len the most tokens the lookup proposes (0 =
      gamma; ladder: the draft drafts the rest of the gamma slots after them).
    """

    method: str = "s2d"
    exits: tuple[int, ...] = ()
    gamma: int = DEFAULT_GAMMA
    max_len: int = 256
    confidence: str = "max_prob"
    kv_fill: str = "calm"
    mus: tuple[int, ...] = ()
    ngram: tuple[int, int] = DEFAULT_NGRAM
    lookup_len: int = 0

    def __post_init__(self):
        row = proposer(self.method)  # an unknown method fails here
        if self.confidence not in CONFIDENCE_KINDS:
            raise S2DError(f"unknown confidence {self.confidence!r}; use one of "
                           f"{', '.join(CONFIDENCE_KINDS)}")
        if self.kv_fill not in KV_FILL:
            raise S2DError(f"unknown kv_fill {self.kv_fill!r}; use one of {', '.join(KV_FILL)}")
        mus = tuple(int(m) for m in self.mus)
        object.__setattr__(self, "mus", mus)
        if any(m < 1 for m in mus):
            raise S2DError(f"chain accumulation lengths mu must be >= 1, got {list(mus)}")
        if not row.proposes:
            if mus:
                raise S2DError(f"method {self.method} has no draft to chain; drop the "
                               f"intermediate levels")
            if self.gamma != 0 or self.exits:
                object.__setattr__(self, "gamma", 0)
                object.__setattr__(self, "exits", ())
            return
        if self.gamma < 1:
            raise S2DError(f"gamma must be >= 1 for method {self.method}, got {self.gamma}")
        self._check_lookup()
        if not row.exits:  # lookup: no exits to draft with
            object.__setattr__(self, "exits", ())
            return
        problem = exits_problem(self.exits)
        if problem:
            raise S2DError(f"exits must be increasing positive layer counts, got "
                           f"{self.exits!r}: {problem}")
        exits = tuple(int(e) for e in self.exits)
        object.__setattr__(self, "exits", exits)
        if row.single_exit and len(exits) != 1:
            raise S2DError(f"method {self.method} uses exactly one exit (--exit), got {exits}")

    def _check_lookup(self):
        ngram, lookup_len = check_lookup(self.ngram, self.lookup_len, self.gamma)
        object.__setattr__(self, "ngram", ngram)
        object.__setattr__(self, "lookup_len", lookup_len)

    @property
    def proposer(self) -> Proposer:
        """The method's row of the table (decode/methods.py)."""
        return proposer(self.method)

    @property
    def lookup(self) -> bool:
        """The lowest rung is the lookup (decode/lookup.py)."""
        return self.proposer.lookup

    @property
    def lookup_tokens(self) -> int:
        """Most tokens the lookup rung proposes in a block."""
        return self.lookup_len or self.gamma

    @property
    def num_exits(self) -> int:
        return len(self.exits)

    @property
    def num_levels(self) -> int:
        """Levels of the chain: draft, intermediates, target (ar: an empty draft level)."""
        return 2 + len(self.mus)

    def block_len(self, level: int) -> int:
        """Static size of the block level `level` passes up: M_0 = gamma, M_k = mu_k + M_{k-1}."""
        return self.gamma + sum(self.mus[:level])

    @property
    def round_span(self) -> int:
        """Most tokens one round can add (and the positions the target scores)."""
        return self.block_len(self.num_levels - 2) + 1


@struct.dataclass
class DecodeParams:
    """Traced decode settings."""

    sampling: SamplingParams
    thresholds: jnp.ndarray  # f32 [num_exits]: keep exit i's token if confidence >= it (1 = never)
    max_new_tokens: jnp.ndarray  # i32 scalar
    eos_id: jnp.ndarray  # i32 scalar, -1 = none
    stop_threshold: jnp.ndarray  # f32 scalar: stop drafting a row below it (0 = off)

    @classmethod
    def make(cls, spec: SpecConfig, thresholds=None, temperature=0.0, top_k=0, top_p=1.0,
             max_new_tokens=32, eos_id=-1, stop_threshold=0.0) -> "DecodeParams":
        thresholds = check_thresholds(thresholds, spec.exits)
        if temperature < 0:
            raise S2DError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise S2DError(f"top-p must lie in (0, 1], got {top_p}")
        if top_k < 0:
            raise S2DError(f"top-k must be >= 0 (0 = off), got {top_k}")
        if max_new_tokens < 1:
            raise S2DError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
        return cls(SamplingParams.make(temperature, top_k, top_p),
                   jnp.asarray(thresholds, jnp.float32).reshape(spec.num_exits), jnp.int32(max_new_tokens),
                   jnp.int32(eos_id), jnp.float32(stop_threshold))


@struct.dataclass
class RoundStats:
    """The per-row counters of a generation, updated by every round (serving.summarize
    turns them into MAT, acceptance per position, exit usage, per-level acceptance).

    Verifier level k = 1 .. n-1 of the chain checks level k-1's tokens (n = 2: the target
    checks the draft's); column k-1 of the level_* counters is level k.
    """

    rounds: jnp.ndarray  # i32 [B] rounds in which the row was active
    round_tokens: jnp.ndarray  # i32 [B] tokens added by rounds (accepted + target's own)
    accepted_at: jnp.ndarray  # i32 [B, gamma] draft position g accepted by level 1
    proposed_at: jnp.ndarray  # i32 [B, gamma] draft position g proposed to level 1
    exit_counts: jnp.ndarray  # i32 [B, num_exits] drafted tokens kept at each exit
    level_accepted: jnp.ndarray  # i32 [B, n-1] tokens level k accepted from level k-1
    level_proposed: jnp.ndarray  # i32 [B, n-1] tokens level k-1 proposed to level k
    level_calls: jnp.ndarray  # i32 [B, n-1] forwards of level k the row took part in
    # the rung of each token level 1 accepted (the ladder's report): exit i, or the lookup
    exit_accepted: jnp.ndarray  # i32 [B, num_exits] drafted tokens of exit i accepted
    lookup_proposed: jnp.ndarray  # i32 [B] tokens the lookup rung proposed to level 1
    lookup_accepted: jnp.ndarray  # i32 [B] of them accepted

    @classmethod
    def zeros(cls, batch: int, spec: SpecConfig) -> "RoundStats":
        z = lambda *shape: jnp.zeros((batch,) + shape, jnp.int32)  # noqa: E731
        n = spec.num_levels
        return cls(rounds=z(), round_tokens=z(), accepted_at=z(spec.gamma),
                   proposed_at=z(spec.gamma), exit_counts=z(spec.num_exits),
                   level_accepted=z(n - 1), level_proposed=z(n - 1), level_calls=z(n - 1),
                   exit_accepted=z(spec.num_exits), lookup_proposed=z(), lookup_accepted=z())

    def add_verification(self, level: int, accepted, proposed, rows) -> "RoundStats":
        """Level `level` (>= 1) took part for `rows` and accepted `accepted` [B] of the
        `proposed` [B] tokens below it."""
        live = rows.astype(jnp.int32)
        hot = jax.nn.one_hot(level - 1, self.level_calls.shape[1], dtype=jnp.int32)[None, :]
        return self.replace(level_accepted=self.level_accepted + hot * (accepted * live)[:, None],
                            level_proposed=self.level_proposed + hot * (proposed * live)[:, None],
                            level_calls=self.level_calls + hot * live[:, None])

    def add_draft_block(self, accepted, proposed, exit_idx, rows,
                        lookup_count=None) -> "RoundStats":
        """The draft's block as its verifier saw it: per position proposed / accepted, and
        the exit each proposed token was kept at (exit_idx [B, gamma]; -1: a lookup
        token, the first lookup_count [B] of the block)."""
        g = jnp.arange(exit_idx.shape[1])[None, :]
        was_proposed = rows[:, None] & (g < proposed[:, None])
        was_accepted = was_proposed & (g < accepted[:, None])
        exit_hot = jax.nn.one_hot(exit_idx, self.exit_counts.shape[1], dtype=jnp.int32)
        out = self.replace(
            accepted_at=self.accepted_at + was_accepted.astype(jnp.int32),
            proposed_at=self.proposed_at + was_proposed.astype(jnp.int32),
            exit_counts=self.exit_counts + jnp.sum(exit_hot * was_proposed[..., None], axis=1),
            exit_accepted=self.exit_accepted + jnp.sum(exit_hot * was_accepted[..., None],
                                                       axis=1))
        if lookup_count is None:
            return out
        live = rows.astype(jnp.int32)
        return out.replace(
            lookup_proposed=self.lookup_proposed + lookup_count * live,
            lookup_accepted=self.lookup_accepted + jnp.minimum(accepted, lookup_count) * live)

    def add_round(self, active, added) -> "RoundStats":
        """One round ended: `added` [B] tokens committed by the `active` [B] rows."""
        return self.replace(rounds=self.rounds + active.astype(jnp.int32),
                            round_tokens=self.round_tokens + added)


@struct.dataclass
class GenState:
    """Everything the round loop carries; fixed shapes, donated between jitted chunks.

    Invariant between rounds: tokens[b, :length[b]] is the sequence so far (zeros after),
    and the cache of chain level k (0 = draft, n-1 = target) holds keys/values for at least
    the positions < length[b] - (n - k) (the target: all but the last token, fed next round;
    the lower levels re-feed their catch-up window, round.py).
    """

    tokens: jnp.ndarray  # i32 [B, S]
    length: jnp.ndarray  # i32 [B]
    prompt_len: jnp.ndarray  # i32 [B]
    done: jnp.ndarray  # bool [B]
    target_cache: KVCache
    draft_cache: KVCache | None
    key: jnp.ndarray  # PRNG key
    round: jnp.ndarray  # i32 scalar, rounds run so far (any row)
    stats: RoundStats
    mid_caches: tuple = ()  # KVCache per intermediate level

    @property
    def new_tokens(self) -> jnp.ndarray:
        return self.length - self.prompt_len

    @property
    def caches(self) -> tuple:
        """The chain's caches bottom-up: (draft, intermediates..., target)."""
        return (self.draft_cache,) + tuple(self.mid_caches) + (self.target_cache,)

    def with_caches(self, caches) -> "GenState":
        return self.replace(draft_cache=caches[0], mid_caches=tuple(caches[1:-1]),
                            target_cache=caches[-1])

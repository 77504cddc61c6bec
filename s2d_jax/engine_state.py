"""Static decode settings, traced decode settings, and the donated generation state.

Static (a change recompiles): method, exits, gamma, buffer sizes, confidence kind, K/V
scheme. Traced (a change never recompiles): thresholds, temperature, top-k, top-p,
max_new_tokens, EOS id, the dynamic-draft-length stop threshold.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct

from s2d_jax.errors import S2DError
from s2d_jax.kvcache import KVCache
from s2d_jax.sampling import CONFIDENCE_KINDS, SamplingParams

METHODS = ("ar", "sd", "self", "s2d")
KV_FILL = ("calm", "full")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static shape of a generation.

    method: ar (target alone), sd (one fixed draft exit), self (the target's own first
      `exits[0]` layers as draft), s2d (sorted draft with escalation over `exits`).
    exits: draft exit depths e_1 < ... < e_m (layer counts); one exit for sd/self.
    gamma: draft tokens per round (0 for ar).
    max_len: cache / token buffer length per row (prompt + generated + gamma + 1 slack).
    kv_fill: how layers skipped by an early exit get keys/values, see drafting.py.
    """

    method: str = "s2d"
    exits: tuple[int, ...] = ()
    gamma: int = 4
    max_len: int = 256
    confidence: str = "max_prob"
    kv_fill: str = "calm"

    def __post_init__(self):
        if self.method not in METHODS:
            raise S2DError(f"unknown method {self.method!r}; use one of {', '.join(METHODS)}")
        if self.confidence not in CONFIDENCE_KINDS:
            raise S2DError(f"unknown confidence {self.confidence!r}; use one of "
                           f"{', '.join(CONFIDENCE_KINDS)}")
        if self.kv_fill not in KV_FILL:
            raise S2DError(f"unknown kv_fill {self.kv_fill!r}; use one of {', '.join(KV_FILL)}")
        if self.method == "ar":
            if self.gamma != 0 or self.exits:
                object.__setattr__(self, "gamma", 0)
                object.__setattr__(self, "exits", ())
            return
        if self.gamma < 1:
            raise S2DError(f"gamma must be >= 1 for method {self.method}, got {self.gamma}")
        exits = tuple(int(e) for e in self.exits)
        object.__setattr__(self, "exits", exits)
        if not exits or any(e < 1 for e in exits) or list(exits) != sorted(set(exits)):
            raise S2DError(f"exits must be increasing positive layer counts, got {exits}")
        if self.method in ("sd", "self") and len(exits) != 1:
            raise S2DError(f"method {self.method} uses exactly one exit (--exit), got {exits}")

    @property
    def num_exits(self) -> int:
        return len(self.exits)


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
        m = spec.num_exits
        if thresholds is None:
            thresholds = [0.0] * m
        thresholds = [float(t) for t in thresholds]
        if len(thresholds) != m:
            raise S2DError(f"got {len(thresholds)} threshold(s) for {m} exit(s) {spec.exits}; "
                           f"pass one threshold per exit")
        if any(not 0.0 <= t <= 1.0 for t in thresholds):
            raise S2DError(f"thresholds must lie in [0, 1], got {thresholds}")
        if temperature < 0:
            raise S2DError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise S2DError(f"top-p must lie in (0, 1], got {top_p}")
        if max_new_tokens < 1:
            raise S2DError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
        return cls(SamplingParams.make(temperature, top_k, top_p),
                   jnp.asarray(thresholds, jnp.float32).reshape(m), jnp.int32(max_new_tokens),
                   jnp.int32(eos_id), jnp.float32(stop_threshold))


@struct.dataclass
class GenState:
    """Everything the round loop carries; fixed shapes, donated between jitted chunks.

    Invariant between rounds: tokens[b, :length[b]] is the sequence so far, and both caches
    hold keys/values for positions < length[b] - 1 (the last token is fed next round).
    """

    tokens: jnp.ndarray  # i32 [B, S]
    length: jnp.ndarray  # i32 [B]
    prompt_len: jnp.ndarray  # i32 [B]
    done: jnp.ndarray  # bool [B]
    target_cache: KVCache
    draft_cache: KVCache | None
    key: jnp.ndarray  # PRNG key
    round: jnp.ndarray  # i32 scalar, rounds run so far (any row)
    # Statistics, per row.
    rounds: jnp.ndarray  # i32 [B] rounds in which the row was active
    round_tokens: jnp.ndarray  # i32 [B] tokens added by rounds (accepted + target's own)
    accepted_at: jnp.ndarray  # i32 [B, gamma] draft position g accepted
    proposed_at: jnp.ndarray  # i32 [B, gamma] draft position g proposed
    exit_counts: jnp.ndarray  # i32 [B, num_exits] drafted tokens kept at each exit

    @property
    def new_tokens(self) -> jnp.ndarray:
        return self.length - self.prompt_len

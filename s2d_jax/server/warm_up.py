"""The slot engine's warm-up (SlotEngine.warm): compile every program a request can need,
so a running server never compiles on the request path, and measure the round costs the
occupancy policy (server/occupancy.py) compares, per row bucket, for the method's chunk
and the plain-AR chunk.
"""

from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.decode import engine
from s2d_jax.server import programs
from s2d_jax.server.occupancy import OccupancyPolicy
from s2d_jax.server.request import Job, Request


def warm(eng) -> dict:
    """Compile, measure and install the policy on SlotEngine `eng` -> {program: count}
    of what was compiled. The engine starts empty afterwards."""
    counts = collections.Counter()
    lazy = eng.ar is not None and eng.draft_params is not None
    one_ar = compile_prefills(eng, lazy, counts)
    # a row that decodes to the end of its buffer: every round of a measured chunk runs
    long = Request((1,), max_new_tokens=eng.max_len - 2)
    one = start(eng, eng._prefill_caches((1,)), long, draft=True)
    costs = {True: {}, False: {}}
    for rows in eng.row_buckets:
        for other in eng.row_buckets:
            if other != rows:
                programs.resize(eng._empty(rows), rows=other, chain=eng.chain)
                counts["resize"] += 1
        for speculate in (True, False) if eng.ar is not None else (True,):
            costs[speculate][rows] = time_chunks(eng, one, rows, speculate, counts)
        state = programs.release(filled(eng, one, rows), jax.device_put(np.zeros(rows, bool)),
                                 chain=eng.chain)
        eng.state = programs.move(state, jnp.int32(0), jnp.int32(0), chain=eng.chain)
        counts.update(insert=1, release=1, move=1)
        if lazy:  # a slot written from a prefill without the draft
            programs.insert(eng._empty(rows), one_ar, jnp.int32(0), chain=eng.chain)
            counts["insert"] += 1
    if eng.ar is not None:
        eng.policy = OccupancyPolicy(costs[True], costs[False], eng.spec.round_span)
    eng.rows, eng.draft_stale = eng.row_buckets[0], False
    eng.state = jax.block_until_ready(eng._empty(eng.rows))
    eng.seen[:] = 0
    return dict(counts)


def compile_prefills(eng, lazy: bool, counts):
    """The prefill of every prompt width and its first token, with the draft and (lazy)
    without it -> a one-row state prefilled without the draft (None unless lazy)."""
    request = Request((1,), max_new_tokens=1)
    one_ar = None
    for draft in (True, False) if lazy else (True,):
        for width in eng.buckets:
            caches = eng._prefill_caches((1,), draft, width)
            counts["prefill" if draft else "prefill_target_only"] += 1
        one = start(eng, caches, request, draft)
        counts["first_token" if draft else "first_token_target_only"] += 1
        one_ar = one_ar if draft else one
    return one_ar


def start(eng, caches, request: Request, draft: bool):
    """engine.start of `request` (prompt length 1) from engine.prefill_caches' output."""
    return engine.start(*caches, jax.device_put(np.array([1], np.int32)),
                        eng._request_dp(request), jax.random.key(0),
                        chain=eng.chain if draft else eng.ar)


def filled(eng, one, rows: int):
    """A batch of `rows` rows, each the prefilled request `one`."""
    state = eng._empty(rows)
    for b in range(rows):
        state = programs.insert(state, one, jnp.int32(b), chain=eng.chain)
    return state


def time_chunks(eng, one, rows: int, speculate: bool, counts) -> float:
    """Compile the sampling and the greedy chunk of one program at `rows` rows (and,
    after AR, the draft's catch-up) -> the greedy program's seconds per round, the best
    of three timed chunks on a batch of `one`s (constant prompts: a draft's escalations
    and a lookup's matches differ from real text; the costs are what the policy
    compares, both programs measured alike)."""
    eng.rows = rows
    per_round = []
    try:
        for temperature in (1.0, 0.0, 0.0, 0.0, 0.0):  # compile both, then time greedy
            eng.jobs[:rows] = [Job(Request((1,), temperature=temperature), None)] * rows
            eng.state = jax.block_until_ready(filled(eng, one, rows))
            start, t0 = int(eng.state.round), time.perf_counter()
            eng._chunk(speculate)
            ran = int(jax.block_until_ready(eng.state).round) - start
            per_round.append((time.perf_counter() - t0) / max(ran, 1))
        counts["decode_chunk"] += 2
        if eng.draft_stale:
            eng.state = programs.catch_up_draft(eng.state, eng.draft_params, chain=eng.chain)
            eng.draft_stale = False
            counts["catch_up_draft"] += 1
        return min(per_round[2:])
    finally:
        eng.jobs = [None] * eng.slots

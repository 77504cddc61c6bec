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

from s2d_jax import compile_cache
from s2d_jax.server import programs
from s2d_jax.server.occupancy import OccupancyPolicy
from s2d_jax.server.request import Job, Request


# Prompt widths the first requests need (a chat turn, a short completion): compiled
# before the server says it is ready; the longer ones follow in the background.
FIRST_WIDTHS = 512


def warm(eng) -> dict:
    """Compile, measure and install the policy on SlotEngine `eng` -> {program: count}
    of what was compiled. The engine starts empty afterwards."""
    counts = collections.Counter()
    for _ in stages(eng, counts):
        pass
    return dict(counts)


def stages(eng, counts):
    """warm() a piece at a time: a generator yielding (label, ready) after each piece,
    the engine empty and usable in between (a caller may serve requests there, as the
    server's worker does while it warms the rest in the background). `ready` turns True
    once what the first requests need is compiled (the short prompt widths and one row)
    and the occupancy policy exists (the costs of row buckets not yet measured are the
    one-row costs until measured)."""
    lazy = eng.ar is not None and eng.draft_params is not None
    short = [w for w in eng.buckets if w <= FIRST_WIDTHS] or [eng.buckets[0]]
    long_ = [w for w in eng.buckets if w not in short]
    request = Request((1,), max_new_tokens=1)
    for width in short:
        eng._prefill_caches((1,), True, width)
        counts["prefill"] += 1
        yield f"prefill of {width}-token prompts", False
    start(eng, eng._prefill_caches((1,), True, short[0]), request, draft=True)
    counts["first_token"] += 1
    # a row that decodes to the end of its buffer: every round of a measured chunk runs
    long = Request((1,), max_new_tokens=eng.max_len - 2)
    one = start(eng, eng._prefill_caches((1,), True, short[0]), long, draft=True)
    one_ar = None
    if lazy:  # a request admitted while the batch decodes AR: prefilled without the draft
        one_ar = start(eng, eng._prefill_caches((1,), False, short[0]), request, draft=False)
        counts.update(prefill_target_only=1, first_token_target_only=1)
    costs = {True: {}, False: {}}
    for rows in eng.row_buckets:
        for label in _rows(eng, rows, one, one_ar, costs, counts):
            if rows != eng.row_buckets[0]:  # pieces of a few programs: a request that
                _idle(eng)                  # comes waits for one piece at most
                yield f"{label} at {rows} rows", True
        if eng.ar is not None:
            if eng.policy is None:
                eng.policy = OccupancyPolicy({}, {}, eng.spec.round_span)
            for r in eng.row_buckets:  # measured, else the nearest smaller bucket's
                known = max(k for k in costs[True] if k <= r)
                eng.policy.spec_cost[r] = costs[True][known]
                eng.policy.ar_cost[r] = costs[False][known]
        _idle(eng)
        yield f"decode programs at {rows} row(s)", True
    for width in long_:
        eng._prefill_caches((1,), True, width)
        counts["prefill"] += 1
        _idle(eng)
        yield f"prefill of {width}-token prompts", True
    for width in (eng.buckets if lazy else ()):
        if width != short[0]:
            eng._prefill_caches((1,), False, width)
            counts["prefill_target_only"] += 1
            _idle(eng)
            yield f"target-only prefill of {width}-token prompts", True


def _rows(eng, rows: int, one, one_ar, costs, counts):
    """Every program at `rows` rows, a generator yielding a label after each piece: the
    resizes to the other buckets, both chunks (timed), insert, release and move."""
    for other in eng.row_buckets:
        if other != rows:
            programs.resize(eng._empty(rows), rows=other, chain=eng.chain)
            counts["resize"] += 1
    yield "resizes"
    for speculate in (True, False) if eng.ar is not None else (True,):
        costs[speculate][rows] = time_chunks(eng, one, rows, speculate, counts)
        yield "speculative chunks" if speculate else "AR chunks"
    state = programs.release(filled(eng, one, rows), jax.device_put(np.zeros(rows, bool)),
                             chain=eng.chain)
    programs.move(state, jnp.int32(0), jnp.int32(0), chain=eng.chain)
    counts.update(insert=1, release=1, move=1)
    if one_ar is not None:  # a slot written from a prefill without the draft
        programs.insert(eng._empty(rows), one_ar, jnp.int32(0), chain=eng.chain)
        counts["insert"] += 1
    yield "slot writes"


def _idle(eng) -> None:
    """The engine empty at its smallest row bucket (between warm-up pieces)."""
    eng.rows, eng.draft_stale = eng.row_buckets[0], False
    eng.state = jax.block_until_ready(eng._empty(eng.rows))
    eng.seen[:] = 0


def start(eng, caches, request: Request, draft: bool):
    """engine.start of `request` (prompt length 1) from engine.prefill_caches' output."""
    return programs.start(*caches, jax.device_put(np.array([1], np.int32)),
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
    compares, both programs measured alike). Kept for later starts (compile_cache.
    remember), which run each program once untimed; `s2d cache --clear` measures again."""
    eng.rows = rows
    per_round = []
    # measured at an earlier start (same code, machine, settings): both programs are
    # still run once (read from the cache), not timed again
    key = compile_cache.executable_key(time_chunks, (), dict(
        chain=eng.chain, ar=eng.ar, rows=rows, speculate=speculate, slots=eng.slots,
        chunk_rounds=eng.chunk_rounds))
    known = compile_cache.recall("chunk_seconds", key)
    try:
        for temperature in (1.0, 0.0) if known is not None else (1.0, 0.0, 0.0, 0.0, 0.0):
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
        if known is not None:
            return known
        compile_cache.remember("chunk_seconds", key, min(per_round[2:]))
        return min(per_round[2:])
    finally:
        eng.jobs = [None] * eng.slots

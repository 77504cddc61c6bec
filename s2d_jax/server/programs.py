"""The slot engine's own jitted programs, beside engine.prefill and engine.decode_chunk:
an empty batch of slots, writing one prefilled request into a slot, and freeing slots.

Each takes the chain as its one static argument (engine._jit_per_chain), so a server
compiles each once for its slot count and buffer; the batch state is donated, so a slot
is written in place (no copy of the other slots' caches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.decode.state import GenState


def _row(big, small, slot, axis: int = 0):
    """big with its row `slot` (along `axis`) replaced by small's only row."""
    return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis)


def _insert(state: GenState, one: GenState, slot, *, chain: Chain) -> GenState:
    """The batch state with slot `slot` holding the one-row state `one` (a request just
    prefilled with the same chain): its tokens, lengths, statistics and every level's
    K/V (cache batch axis 1). The batch's key and round counter stay the batch's."""
    del chain  # static: one program per chain
    caches = [None if c is None else c.replace(k=_row(c.k, o.k, slot, 1),
                                               v=_row(c.v, o.v, slot, 1),
                                               lengths=_row(c.lengths, o.lengths, slot))
              for c, o in zip(state.caches, one.caches)]
    stats = jax.tree.map(lambda a, b: _row(a, b, slot), state.stats, one.stats)
    return state.with_caches(caches).replace(
        tokens=_row(state.tokens, one.tokens, slot), length=_row(state.length, one.length, slot),
        prompt_len=_row(state.prompt_len, one.prompt_len, slot),
        done=_row(state.done, one.done, slot), stats=stats)


def _release(state: GenState, free, *, chain: Chain) -> GenState:
    """Slots where `free` [B] is set stop: a finished or cancelled request's row is
    skipped by every later round (round.py computes rows that are done but keeps nothing)."""
    del chain
    return state.replace(done=state.done | free)


insert = engine._jit_per_chain(_insert, donate_argnames=("state",))
release = engine._jit_per_chain(_release, donate_argnames=("state",))


def empty_state(prefill_args: tuple, *, chain: Chain) -> GenState:
    """A batch of free slots shaped as engine.prefill's output for these (batch-sized)
    arguments, without running it: zeros, every row done."""
    shapes = jax.eval_shape(lambda: engine.prefill(*prefill_args, chain=chain))

    def zeros(s):
        if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jax.random.key(0)
        return jnp.zeros(s.shape, s.dtype)

    state = jax.tree.map(zeros, shapes)
    return state.replace(done=jnp.ones_like(state.done))

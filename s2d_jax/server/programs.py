"""The slot engine's own jitted programs, beside engine.prefill and engine.decode_chunk:
an empty batch of slots, writing one prefilled request into a slot, freeing slots, moving
a row (the busy rows stay at the front), resizing the batch to another row bucket, the
draft's catch-up after chunks of plain AR, and the AR view of a speculative state.

Each takes the chain as its one static argument (engine._jit_per_chain), so a server
compiles each once for its slot count and buffer; the batch state is donated, so a slot
is written in place (no copy of the other slots' caches). The slot engine calls these and
engine's programs through their executables (`Cached`: from the second start read from
the compilation cache's folder, with no trace).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax import compile_cache
from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.decode.state import GenState, RoundStats
from s2d_jax.model import transformer as model
from s2d_jax.model.layers import decode_layers


def _row(big, small, slot, axis: int = 0):
    """big with its row `slot` (along `axis`) replaced by small's only row."""
    return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis)


def _insert(state: GenState, one: GenState, slot, *, chain: Chain) -> GenState:
    """The batch state with slot `slot` holding the one-row state `one` (a request just
    prefilled): its tokens, lengths and every level's K/V (cache batch axis 1), its
    statistics zero. `one` may lack the draft's cache (prefilled by the AR chain while the
    engine decodes plain AR): the slot's draft cache then holds nothing (lengths 0) and
    the draft's catch-up reads the prompt if speculation resumes. The batch's key and
    round counter stay the batch's."""
    del chain  # static: one program per chain (and per kind of `one`)

    def put(c, o):
        if c is None:
            return None
        if o is None:
            return c.replace(lengths=_row(c.lengths, jnp.zeros((1,), jnp.int32), slot))
        return c.replace(k=_row(c.k, o.k, slot, 1), v=_row(c.v, o.v, slot, 1),
                         lengths=_row(c.lengths, o.lengths, slot))

    caches = [put(c, o) for c, o in zip(state.caches, one.caches)]
    stats = jax.tree.map(lambda a: _row(a, jnp.zeros((1,) + a.shape[1:], a.dtype), slot),
                         state.stats)
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


def _move(state: GenState, src, dst, *, chain: Chain) -> GenState:
    """Row `src` copied into row `dst` (every per-row array and every level's K/V), then
    `src` freed: the engine keeps its busy rows at the front (one row's copy per freed
    slot, so a chunk can run on the smallest row bucket that holds them)."""
    del chain
    take = lambda a, axis=0: jax.lax.dynamic_slice_in_dim(a, src, 1, axis)  # noqa: E731
    caches = [None if c is None else c.replace(k=_row(c.k, take(c.k, 1), dst, 1),
                                               v=_row(c.v, take(c.v, 1), dst, 1),
                                               lengths=_row(c.lengths, take(c.lengths), dst))
              for c in state.caches]
    stats = jax.tree.map(lambda a: _row(a, take(a), dst), state.stats)
    moved = state.with_caches(caches).replace(
        tokens=_row(state.tokens, take(state.tokens), dst),
        length=_row(state.length, take(state.length), dst),
        prompt_len=_row(state.prompt_len, take(state.prompt_len), dst),
        done=_row(state.done, take(state.done), dst), stats=stats)
    return moved.replace(done=moved.done.at[src].set(True))


def _resize(state: GenState, *, rows: int, chain: Chain) -> GenState:
    """The first `rows` rows of the batch (fewer: the others must be free), or the batch
    padded with free rows (more). A copy of the kept rows, made only when the busy count
    crosses a row bucket."""
    del chain
    B = state.length.shape[0]

    def fit(a, axis=0, fill=0):
        if rows <= B:
            return jax.lax.slice_in_dim(a, 0, rows, axis=axis)
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, rows - B)
        return jnp.pad(a, pad, constant_values=fill)

    caches = [None if c is None else c.replace(k=fit(c.k, 1), v=fit(c.v, 1),
                                               lengths=fit(c.lengths))
              for c in state.caches]
    return state.with_caches(caches).replace(
        tokens=fit(state.tokens), length=fit(state.length), prompt_len=fit(state.prompt_len),
        done=fit(state.done, fill=True), stats=jax.tree.map(fit, state.stats))


# Positions the draft re-reads per step of its catch-up (below): a multiple of the CPU
# kernels' row blocks, small enough that a short lag costs little.
CATCH_UP_WINDOW = 32


def _catch_up_draft(state: GenState, draft_params, *, chain: Chain) -> GenState:
    """After chunks decoded without the draft (plain AR at a high occupancy), the draft's
    cache lags: it holds exact K/V only below its `lengths`. Feed each busy row's tokens
    from there through every draft layer, CATCH_UP_WINDOW positions per step, until it
    holds all but the newest token again (what a speculative round leaves) -> the state
    a speculative chunk expects.

    Positions past a row's length feed the buffer's zeros: their K/V are junk that no
    query reads (the round writes a position before any query at or after it), and the
    cache's lengths never count them."""
    cache, W = state.draft_cache, CATCH_UP_WINDOW
    cfg, S = chain.draft, state.tokens.shape[1]
    want = jnp.maximum(state.length - 1, 0)

    def behind(c):
        return jnp.any(~state.done & (c.lengths < want))

    def feed(c):
        positions = c.lengths[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]
        tokens = jnp.take_along_axis(state.tokens, jnp.minimum(positions, S - 1), axis=1)
        h = model.embed_tokens(draft_params, cfg, tokens)
        _, c = decode_layers(draft_params, cfg, h, jnp.minimum(positions, S - 1), 0,
                             cfg.num_layers, c)
        return c.with_lengths(jnp.where(c.lengths < want, jnp.minimum(c.lengths + W, want),
                                        c.lengths))

    return state.replace(draft_cache=jax.lax.while_loop(behind, feed, cache))


move = engine._jit_per_chain(_move, donate_argnames=("state",))
# not donated: the output has another shape, so no buffer could be reused
resize = jax.jit(_resize, static_argnames=("rows", "chain"))
catch_up_draft = engine._jit_per_chain(_catch_up_draft, donate_argnames=("state",))


def ar_chain(chain: Chain) -> Chain:
    """The same target and buffer decoding plain AR (no draft level): what the engine
    runs where speculation does not pay."""
    return dataclasses.replace(chain, draft=None,
                               spec=dataclasses.replace(chain.spec, method="ar"))


def without_draft(state: GenState, ar: Chain) -> GenState:
    """The target-only state an AR chunk takes (fresh round statistics; the draft's cache
    stays with the caller, untouched)."""
    return state.replace(draft_cache=None,
                         stats=RoundStats.zeros(state.length.shape[0], ar.spec))


def with_draft(ar_state: GenState, spec_state_stats: RoundStats, draft_cache) -> GenState:
    """An AR chunk's result back in the speculative state: its rounds and tokens added to
    the rows' counters (every AR round is one target call for one token)."""
    s, a = spec_state_stats, ar_state.stats
    stats = s.replace(rounds=s.rounds + a.rounds, round_tokens=s.round_tokens + a.round_tokens,
                      level_calls=s.level_calls + a.level_calls)
    return ar_state.replace(draft_cache=draft_cache, stats=stats)


class Cached:
    """A jitted function called through its executables: the first call per argument
    signature takes compile_cache.compiled's (read from disk where an earlier start
    compiled it: no trace), later calls the same executable. `static`: the keyword
    arguments the function was jitted with as static."""

    def __init__(self, fn, static=("chain",)):
        self.fn, self.static = fn, tuple(static)
        self._runs: dict = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        static = {k: kwargs.pop(k) for k in self.static if k in kwargs}
        leaves, tree = jax.tree.flatten((args, kwargs))
        sig = (tree, tuple(sorted(static.items())), tuple(
            (x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding)
            if isinstance(x, jax.Array)
            else (type(x), np.shape(x), getattr(x, "dtype", None)) for x in leaves))
        run = self._runs.get(sig)
        if run is None:
            run = self._runs[sig] = compile_cache.compiled(self.fn, *args, **kwargs, **static)
        return run(*args, **kwargs)


# every program the slot engine runs, through its executables (Cached)
prefill_caches = Cached(engine.prefill_caches)
start = Cached(engine.start)
decode_chunk = Cached(engine.decode_chunk)
split_draft = Cached(engine.split_draft)
insert = Cached(insert)
release = Cached(release)
move = Cached(move)
resize = Cached(resize, static=("rows", "chain"))
catch_up_draft = Cached(catch_up_draft)
_SHAPES: dict = {}  # empty_state's output shapes, per key


def empty_state(prefill_args: tuple, *, chain: Chain) -> GenState:
    """A batch of free slots shaped as engine.prefill's output for these (batch-sized)
    arguments, without running it: zeros, every row done."""
    return empty_from(empty_shapes(prefill_args, chain=chain))


def empty_shapes(prefill_args: tuple, *, chain: Chain):
    """engine.prefill's output shapes for these arguments: traced once per signature and
    kept (compile_cache.remember) for later starts."""
    key = compile_cache.executable_key(engine.prefill, prefill_args, {"chain": chain})
    shapes = _SHAPES.get(key) if key is not None else None
    if shapes is None:
        shapes = compile_cache.recall("shapes", key)
    if shapes is None:
        shapes = jax.eval_shape(lambda: engine.prefill(*prefill_args, chain=chain))
        compile_cache.remember("shapes", key, jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), shapes))
    if key is not None:
        _SHAPES[key] = shapes
    return shapes


def empty_from(shapes) -> GenState:
    """Free slots of these shapes (empty_shapes): zeros, every row done."""
    leaves, tree = jax.tree.flatten(shapes)
    is_key = [jnp.issubdtype(s.dtype, jax.dtypes.prng_key) for s in leaves]
    zeros = iter(_zeros(specs=tuple((tuple(s.shape), str(s.dtype))  # one program, not an
                                    for s, k in zip(leaves, is_key) if not k)))  # op a leaf
    state = jax.tree.unflatten(tree, [jax.random.key(0) if k else next(zeros)
                                      for k in is_key])
    return state.replace(done=jnp.ones_like(state.done))


def _zeros_of(*, specs):
    return tuple(jnp.zeros(shape, dtype) for shape, dtype in specs)


_zeros = Cached(jax.jit(_zeros_of, static_argnames=("specs",)), static=("specs",))

"""The compiler's own estimate of one decode round: `compiled.cost_analysis()` of a program
that is exactly one round.

XLA's cost analysis counts a while loop's body once, so the whole generation's figure is
one layer of each layer scan, one attention block, one round and the prefill. Here one
round (round.one_round) is compiled alone, with every layer range unrolled and the
attention reading the whole cache as one block (the round at the end of the context, as
the roofline counts it): every op of the round then appears once in the program. On TPU the
cost analysis holds the compiler's `optimal_seconds` (its estimate of the round's time)
beside `bytes accessed` and `flops`; XLA:CPU gives bytes and flops only.
"""

from __future__ import annotations

import contextlib
import time

import jax

from s2d_jax.decode.drafting import with_exit_segments
from s2d_jax.decode.round import one_round
from s2d_jax.decode.state import DecodeParams
from s2d_jax.model import attention, layers


@contextlib.contextmanager
def whole_round_program(max_len: int):
    """Trace with every layer range unrolled and one attention block of `max_len` slots."""
    saved = layers.UNROLL_LAYERS, layers.UNROLL_MAX_LAYER_PARAMS, attention.ATTENTION_BLOCK
    layers.UNROLL_LAYERS, layers.UNROLL_MAX_LAYER_PARAMS = 10**6, float("inf")
    attention.ATTENTION_BLOCK = max_len
    try:
        yield
    finally:
        layers.UNROLL_LAYERS, layers.UNROLL_MAX_LAYER_PARAMS, attention.ATTENTION_BLOCK = saved


def _place_caches(state, mesh):
    """The abstract state with its caches sharded as the decode loop keeps them."""
    if mesh is None:
        return state
    from s2d_jax.model.kvcache import cache_sharding
    sh = cache_sharding(mesh)
    place = lambda c: None if c is None else c.replace(  # noqa: E731
        k=jax.ShapeDtypeStruct(c.k.shape, c.k.dtype, sharding=sh),
        v=jax.ShapeDtypeStruct(c.v.shape, c.v.dtype, sharding=sh))
    return state.replace(target_cache=place(state.target_cache),
                         draft_cache=place(state.draft_cache))


def _segments_like(params, exits):
    """Abstract draft params with their exit segments (decode loop's with_exit_segments,
    done outside the round), each segment sharded as the stack it is sliced from."""
    shapes = jax.eval_shape(lambda p: with_exit_segments(p, exits), params)
    layer_sh = jax.tree.map(lambda a: a.sharding, params["layers"])
    segs = tuple(jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                              seg, layer_sh) for seg in shapes["exit_segments"])
    out = dict(params)
    out["exit_segments"] = segs
    if "head_rows" in shapes:
        out["head_rows"] = shapes["head_rows"]
    return out


def compile_round(setup, mesh=None, compiler_options=None):
    """(compiled one round, compile seconds) of the generation `setup` (aot.GenerateSetup)."""
    from s2d_jax.decode import engine
    from s2d_jax.decode.aot import abstract_params
    import jax.numpy as jnp
    s = setup
    chain = s.chain(mesh)
    draft = abstract_params(s.draft_cfg, mesh) if s.draft_cfg is not None else None
    target = abstract_params(s.target_cfg, mesh)
    dp = jax.eval_shape(lambda: DecodeParams.make(s.spec))
    state = jax.eval_shape(
        lambda d, t: engine._prefill(d, t, jnp.zeros((s.batch, s.prompt_len), jnp.int32),
                                     jnp.full((s.batch,), s.prompt_len, jnp.int32),
                                     DecodeParams.make(s.spec), jax.random.key(0), chain=chain),
        draft, target)
    state = _place_caches(state, mesh)
    if s.spec.proposer.needs_draft:  # its exits' segments, as the engine slices them
        draft = _segments_like(draft, s.spec.exits)
    with whole_round_program(s.spec.max_len), chain.kernel_scope():
        fn = jax.jit(lambda st, d, t, p: one_round(st, params=(d, t), dp=p, chain=chain))
        lowered = fn.lower(state, draft, target, dp)
    t0 = time.perf_counter()
    compiled = lowered.compile(compiler_options or {})
    return compiled, time.perf_counter() - t0


def round_cost(compiled) -> dict:
    """The compiler's cost analysis of a one-round program: seconds (TPU only; None
    elsewhere), bytes accessed and flops. The TPU cost model counted custom calls outside
    conditionals (its ConcatBitcast relayouts, no work) as -1 s each in decode rounds: an AR
    round with 7 gave -6.9996 s (compiler_seconds adds them back)."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return {"seconds": compiler_seconds(compiled, ca), "bytes": ca.get("bytes accessed"),
            "flops": ca.get("flops")}


def compiler_seconds(compiled, ca=None) -> float | None:
    """The TPU compiler's `optimal_seconds`; where negative, with the custom calls it
    counted as -1 s each added back (None if that does not give a positive time under
    100 s). A positive figure is taken as is: adding the custom calls back to the SoFT
    step's positive estimate (train/aot.py) gave 5.03 s a micro-batch, nonsense."""
    if ca is None:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    seconds = ca.get("optimal_seconds")
    if seconds is not None and seconds < 0:
        seconds += _unknown_cost_calls(compiled.as_text())
    return seconds if seconds is not None and 0 < seconds < 100 else None


def _unknown_cost_calls(hlo: str) -> int:
    """Custom calls outside fusions and outside conditional branches: the ones the TPU
    cost model counted as -1 s each in the rounds measured (AR: 7 of 7)."""
    from s2d_jax.decode.hlo_copies import _callees, parse_computations, reachable
    comps = parse_computations(hlo)
    fused, branches = set(), set()
    for lines in comps.values():
        for line in lines:
            if " fusion(" in line:
                fused.update(_callees(line))
            if " conditional(" in line:
                for c in _callees(line):
                    branches |= reachable(comps, c)
    return sum(1 for name, lines in comps.items()
               if name != "__entry__" and name not in fused | branches
               for line in lines if " custom-call(" in line)

"""The compiler's own estimate of one decode round: `compiled.cost_analysis()` of a program
that is exactly one round.

XLA's cost analysis counts a while loop's body once, so the whole generation's figure is
one layer of each layer scan, one attention block, one round and the prefill. Here one
round (round.one_round) is compiled alone, with every layer range unrolled and the
attention reading the whole cache as one block (the round at the end of the context, as
the roofline counts it): every op of the round then appears once in the program. On TPU the
cost analysis holds the compiler's `optimal_seconds` (its estimate of the round's time)
beside `bytes accessed` and `flops`; XLA:CPU gives bytes and flops only.

The program copies nothing the loop's round does not: the state is donated (the loop's
while body carries it, so its caches are updated in place; undonated, the program's
outputs were new buffers and it copied both caches whole), the weights come in the layouts
the compiler picks for them (the loop lays a weight out anew once, before it: the TPU's
`wq` for the heads-major order its matmuls read; in a program of its own that was a copy
of the whole stack per call), and on TPU multi-output fusion is off (TPU_ROUND_OPTIONS: it
merged the unrolled layers' slices of `wo` into copies of the stack). At batch 8 the 70B's
AR one-round program on v5p:2x2x2 walked 24.7 GiB with all three (2.5 GiB of cache
copies, 2.5 of `wq`, 2.2 of `wo`) for the loop's round's 17.6. The program is the round at its
dearest (drafting's conditionals traced as their dearest branch: every step drafted, S2D's
escalating), and on TPU its unrolled layers index their weights at an index the compiler
cannot see, so it reads a layer's `wo` slice into VMEM as the loop does instead of copying
static slices into HBM (inside the draft's conditionals it did: the 70B's SD one-round
program at batch 1 walked 1.08x the loop's round, now 1.004x). `one_round_bytes` walks the
program as hlo_traffic walks the loop's round; `infer.aot --roofline` prints it beside the
loop's dearest round (tests/test_tpu_aot.py keeps them within 5%).
"""

from __future__ import annotations

import contextlib
import time

import jax

from s2d_jax.decode.drafting import dearest_branches, with_exit_segments
from s2d_jax.decode.round import one_round
from s2d_jax.decode.state import DecodeParams
from s2d_jax.model import attention, layers


# The TPU compiler's multi-output fusion merges sibling fusions of one operand. Unrolled,
# each layer's static slice of a weight stack is such a sibling: it merged the 70B's 80
# slices of `wo` into 5 fusions that copy the whole stack out, mostly into HBM (2.2 GiB a
# round: the one-round program walked 1.13x the loop's round at batch 1), where the loop
# slices one layer at a time into VMEM. Without it the slices are async slices into VMEM
# as in the loop (1.00x); its estimate moved by 0.3% (AR, batch 1: 9.157 -> 9.130 ms).
TPU_ROUND_OPTIONS = {"xla_jf_enable_multi_output_fusion": False}


@contextlib.contextmanager
def whole_round_program(max_len: int, opaque_layer_index: bool = False):
    """Trace with every layer range unrolled, one attention block of `max_len` slots and
    drafting's conditionals at their dearest branch (every step drafted, S2D's escalating)."""
    saved = (layers.UNROLL_LAYERS, layers.UNROLL_MAX_LAYER_PARAMS, attention.ATTENTION_BLOCK,
             layers.OPAQUE_LAYER_INDEX)
    layers.UNROLL_LAYERS, layers.UNROLL_MAX_LAYER_PARAMS = 10**6, float("inf")
    attention.ATTENTION_BLOCK = max_len
    layers.OPAQUE_LAYER_INDEX = opaque_layer_index
    try:
        with dearest_branches():
            yield
    finally:
        (layers.UNROLL_LAYERS, layers.UNROLL_MAX_LAYER_PARAMS, attention.ATTENTION_BLOCK,
         layers.OPAQUE_LAYER_INDEX) = saved


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


def _in_shardings(mesh, params, *rest):
    """The one-round program's in-shardings: `params` (draft, target) as placed, in the
    layouts the compiler picks (AUTO: the loop lays a weight out for its body once, before
    it, e.g. the TPU's wq in the heads-major order its matmul reads); `rest` (state, decode
    params) as placed, replicated where not placed."""
    from jax.experimental.layout import Format, Layout
    from jax.sharding import NamedSharding, PartitionSpec
    replicated = NamedSharding(mesh, PartitionSpec())
    return (jax.tree.map(lambda a: Format(Layout.AUTO, a.sharding), params),
            *(jax.tree.map(lambda a: a.sharding or replicated, r) for r in rest))


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
    on_tpu = mesh is not None and mesh.devices.flat[0].platform == "tpu"
    with whole_round_program(s.spec.max_len, on_tpu), chain.kernel_scope():
        fn = jax.jit(lambda params, st, p: one_round(st, params=params, dp=p, chain=chain),
                     in_shardings=None if mesh is None else _in_shardings(
                         mesh, (draft, target), state, dp),
                     donate_argnums=1)  # the state, as the loop's while body carries it
        lowered = fn.lower((draft, target), state, dp)
    options = {**(TPU_ROUND_OPTIONS if on_tpu else {}), **(compiler_options or {})}
    t0 = time.perf_counter()
    compiled = lowered.compile(options)
    return compiled, time.perf_counter() - t0


def one_round_bytes(compiled, setup, mesh=None):
    """hlo_traffic.program_traffic of a compiled one-round program (`compile_round`): the
    HBM bytes it moves per device, to set beside the loop's round (aot.round_bytes)."""
    from s2d_jax.decode.aot import device_cache_shapes
    from s2d_jax.decode.hlo_traffic import program_traffic
    shapes = device_cache_shapes([setup.target_cfg, setup.draft_cfg], setup.batch,
                                 setup.spec.max_len, mesh)
    return program_traffic(compiled.as_text(), shapes)


def walk_ratio(one, loop) -> float:
    """The one-round program's walk (`one_round_bytes`) over the loop's dearest round
    (aot.round_bytes' hi: the program takes every branch at its dearest,
    drafting.dearest_branches), what the loop keeps in VMEM from round to round counted on
    its side (the one-round program reads it from HBM)."""
    return one.hi / (loop.hi + loop.on_chip)


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

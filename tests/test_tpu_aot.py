"""The TPU compiler's program, compiled deviceless for a TPU topology (libtpu, no TPU):
a small bf16 S2D generation (head dim 128, as the real models) updates its caches in
place on TPU, every copy of a round is classified, and the check finds a planted cache
copy (a loop that keeps the last version of its cache beside the new one). Skipped where
libtpu is not installed (`pip install -e '.[tpu]'`, or as CI does: libtpu in a folder of its
own named by S2D_LIBTPU_PATH, the library file, given to the child as TPU_LIBRARY_PATH; an
environment with libtpu installed prints its warnings in every CPU process)."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBTPU = os.environ.get("S2D_LIBTPU_PATH", "")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None
                                and not os.path.isfile(LIBTPU),
                                reason="libtpu (the TPU compiler) is not installed and "
                                       "S2D_LIBTPU_PATH names no libtpu.so")

# Run in a child: the topology path sets TPU_SKIP_MDS_QUERY / JAX_PLATFORMS before JAX
# starts, and this test process's JAX already runs on 8 fake CPU devices.
SCRIPT = r'''
import dataclasses, sys
from s2d_jax.parallel import topology
devs = topology.devices("v5e:2x2")
import jax, jax.numpy as jnp
from s2d_jax.config import ModelConfig
from s2d_jax.decode.aot import GenerateSetup, compile_generate, round_copy_list
from s2d_jax.decode.round_copies import round_copies, summary
from s2d_jax.parallel.mesh import MeshConfig
from s2d_jax.parallel.multihost import build_mesh
method, _, heads = sys.argv[1].partition(":")  # "ar:40": 40 kv heads, 10 a device
heads = int(heads or 16)
cfg = ModelConfig(vocab_size=1024, hidden_size=128 * heads, intermediate_size=1024,
                  num_layers=4, num_heads=heads, num_kv_heads=heads,
                  max_position_embeddings=4096, dtype="bfloat16", param_dtype="bfloat16")
# the one-round program beside the loop: the 70B's attention (64 heads, 8 kv heads: 16 and
# 2 a device, wo slices of 32 MiB a layer), batch 8 and caches too large for VMEM (each
# round reads them from HBM, as the 70B's do: at 4096 slots, 64 MiB a cache, the one-round
# program kept the updated cache in VMEM, copied it out whole and walked 1.19x the loop)
one_round = sys.argv[2:] == ["one-round"]
if one_round:
    cfg = dataclasses.replace(cfg, hidden_size=8192, num_heads=64, num_kv_heads=8,
                              max_position_embeddings=8192)
mesh = build_mesh(MeshConfig(tensor=4), {"t": cfg}, devices=devs)
if method == "planted":  # a loop that keeps last round's cache beside this round's
    # 96 MiB: too large for on-chip memory (a small one lives in VMEM, and a copy out of it
    # is a memory-space move)
    shape = (12, 1, 8, 4096, 128)
    def body(c):
        cache, last, i = c
        new = cache.at[:, :, :, i].set(jnp.ones((12, 1, 8, 128), jnp.bfloat16))
        return new, cache, i + 1  # two live versions: the update cannot be in place
    loop = jax.jit(lambda x: jax.lax.while_loop(lambda c: c[2] < 8, body, (x, x, 0))[:2],
                   donate_argnums=0, device=devs[0])
    hlo = loop.lower(jax.ShapeDtypeStruct(shape, jnp.bfloat16)).compile().as_text()
    print(summary(round_copies(hlo, [shape])))
else:
    exits = {"ar": (), "sd": (3,), "s2d": (1, 2, 3), "ladder": (1, 3)}[method]
    draft = None if method == "ar" else dataclasses.replace(cfg, num_layers=3)
    batch, context = (8, 8192) if one_round else (1, 1024)
    setup = GenerateSetup.make(cfg, draft, exits, batch, context, 64, 4, method)
    compiled = compile_generate(setup, mesh)[0]
    assert devs[0].platform == "tpu" and "TPU" in devs[0].device_kind
    assert jax.devices()[0].platform == "cpu"  # ordinary arrays stay on the CPU
    cfgs = [setup.target_cfg, setup.draft_cfg]
    if one_round:  # the one-round program's walk over the loop's round (lo, hi)
        from s2d_jax.decode.aot import round_bytes
        from s2d_jax.decode.round_cost import compile_round, one_round_bytes, walk_ratio
        loop = round_bytes(compiled, setup, mesh)
        del compiled
        one = one_round_bytes(compile_round(setup, mesh)[0], setup, mesh)
        print(walk_ratio(one, loop))
    elif sys.argv[2:] == ["kernel"]:  # cached attention calls: the Mosaic kernel, XLA ops
        hlo = compiled.as_text()
        print(hlo.count('custom_call_target="tpu_custom_call"'))
    elif len(sys.argv) > 2:  # the round's HBM traffic beside the minimum any round moves
        from s2d_jax.decode.aot import round_bytes
        from s2d_jax.decode.roofline import minimum_round_bytes
        t = round_bytes(compiled, setup, mesh)
        print((t.lo, t.hi, t.on_chip, t.guessed_loops, *minimum_round_bytes(setup, mesh)))
    else:
        print(summary(round_copy_list(compiled.as_text(), cfgs, 1, 1024, mesh)))
'''


# the child's environment: no fake CPU devices, libtpu from S2D_LIBTPU_PATH where given
ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
       **({"TPU_LIBRARY_PATH": LIBTPU} if LIBTPU else {})}


def _run(*args):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])  # the summary dict: kind -> (n, bytes)


@pytest.mark.parametrize("method", ["ar", pytest.param("s2d", marks=pytest.mark.slow),
                                    pytest.param("ladder", marks=pytest.mark.slow)])
def test_tpu_round_copies_no_cache(method):
    """No cache copy per round in the TPU program. (Before the scatter in
    kvcache.write_layers took H as its only window, S2D copied both draft caches at each
    draft step: 8 copies a round here, 12 on the 70B's 12-layer draft.)"""
    found = _run(method)
    assert found["cache"] == (0, 0), found


@pytest.mark.parametrize("method", ["ar:40", pytest.param("s2d:40", marks=pytest.mark.slow)])
def test_tpu_no_cache_copy_with_heads_off_the_tiles(method):
    """10 kv heads a device (Vicuna-13B's 40 at tensor=4), no multiple of the TPU's 8-row
    tiles: with the target's cache write scattering [K, H] windows
    (kvcache._write_rows) the compiler laid the cache out heads-minor for the write and
    slots-minor for the attention and copied it whole twice per layer (8 copies a round
    here; 62.5 GiB of the 13B AR round's 69.3 on v5e:2x2)."""
    found = _run(method)
    assert found["cache"] == (0, 0), found


@pytest.mark.parametrize("method", ["ar", pytest.param("sd", marks=pytest.mark.slow)])
def test_tpu_round_traffic_is_the_minimum(method):
    """hlo_traffic's walk of the TPU program: the HBM bytes of a round plus what the loop
    keeps in VMEM (this small model's caches and some weights stay on chip) is the minimum
    (weights and caches once per call) within a few percent (activations, prefetches). The
    walk built on XLA:CPU's HLO read 410 MiB for this SD round, whose minimum is 213 MiB:
    every matmul counted its whole weight stack (the TPU slices a layer in a nested fusion),
    and VMEM operands as HBM traffic (~100 s a method on 2 loaded cores; tests/test_roofline.py
    has a fast check on a hand-written TPU round)."""
    lo, hi, on_chip, guessed, min_lo, min_hi = _run(method, "walk")
    assert guessed == 0 and lo == hi  # every loop's trips known; no conditional to span
    assert min_hi == min_lo > 0
    assert 0.97 * min_hi <= hi + on_chip <= 1.1 * min_hi, (hi, on_chip, min_hi)
    assert on_chip < min_hi / 2  # most of the round comes from HBM


@pytest.mark.parametrize("method", ["ar", pytest.param("sd", marks=pytest.mark.slow)])
def test_tpu_one_round_program_moves_what_the_loops_round_does(method):
    """The one-round program whose cost analysis `infer.aot --roofline` prints as the TPU
    compiler's estimate (round_cost.compile_round) moves the bytes of the loop's round
    within 5% (hlo_traffic's walks of both, batch 8; AR 1.03x). Before, it copied both
    caches whole (not donated, its outputs were new buffers), relaid `wq` out for its
    matmuls (the loop does that once, before it) and its multi-output fusion copied `wo`
    out layer by layer (the loop slices one layer into VMEM at a time): AR here 2.50x the
    loop's round, SD 2.43x; the 70B's AR round at batch 8 on v5p:2x2x2 24.7 GiB for the
    loop's 17.6 (~30 s a method on 2 cores). SD's draft steps, unrolled inside their
    conditionals, copied their static `wo` slices into HBM (1.37x here, 1.08x on the 70B);
    the program now takes drafting's dearest branches and indexes the draft's layers where
    the compiler cannot see (round_cost.py): 70B SD 1.004x at batch 1."""
    ratio = _run(method, "one-round")
    assert 0.95 <= ratio <= 1.05, ratio


def test_tpu_cached_attention_is_the_mosaic_kernel():
    """The TPU program's cached attention of decode steps and verify windows runs as one
    Mosaic kernel per layer (model/tpu_attention.py): in XLA ops the 70B SD round at batch 8
    wrote and read its f32 scores in HBM, 1.095x its floor on v5p:2x2x2 against 1.044x with
    the kernel (~60 s). Here 5 call sites (0 with the kernel refused: tpu_attention.usable)."""
    kernels = _run("sd", "kernel")
    assert kernels >= 2, kernels  # the target's verify and the draft's steps


def test_tpu_copy_check_finds_a_planted_cache_copy():
    found = _run("planted")
    assert found["cache"][0] >= 1, found  # the loop body's copy of the whole cache


# The head's greedy argmax and its draw over a vocabulary sharded 4 ways (32000: 8000 a
# chip, no multiple of sampling.SAMPLE_BLOCK): the bytes the TPU program all-gathers.
HEAD = r'''
import re, sys
from s2d_jax.parallel import topology
devs = topology.devices("v5e:2x2")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from s2d_jax.decode import sampling
if sys.argv[1] == "blockwise":  # the CPU's blockwise forms planted on the TPU
    sampling.vocab_argmax = sampling._blockwise_argmax
    sampling.jax.lax.platform_dependent = lambda *a, cpu, default: cpu(*a)
mesh = Mesh(np.array(devs).reshape(4), ("tensor",))
V, D = 32000, 2048
SIZE = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1}
out = {}
for kind in ("argmax", "sample"):
    def head(h, w, key):
        logits = (h @ w).astype(jnp.float32)
        if kind == "argmax":
            return sampling.vocab_argmax(logits)
        return sampling.sample(key, jax.nn.softmax(logits))
    f = jax.jit(head, in_shardings=(NamedSharding(mesh, P()),
                                    NamedSharding(mesh, P(None, "tensor")), None))
    hlo = f.lower(jax.ShapeDtypeStruct((4, D), jnp.bfloat16),
                  jax.ShapeDtypeStruct((D, V), jnp.bfloat16),
                  jax.random.key(0)).compile().as_text()
    assert devs[0].platform == "tpu"
    out[kind] = sum(int(np.prod([int(d) for d in m.group(2).split(",") if d] or [1]))
                    * SIZE.get(m.group(1), 4) for m in re.finditer(
                        r"= \(?(\w+)\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", hlo))
print(out)
'''


def _run_head(variant):
    proc = subprocess.run([sys.executable, "-c", HEAD, variant], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])


def test_tpu_vocabulary_argmax_and_draw_gather_no_logits():
    """Off the CPU the head's argmax and draw reduce within each chip's vocabulary shard:
    the blockwise forms (sampling.SAMPLE_BLOCK, CPU-only) split a 32000 vocabulary over 4
    chips across shard boundaries, and the TPU compiler all-gathered the logits for them
    (a v5e:2x2 SD round of that vocabulary: 18.5 GiB of HBM traffic for a 0.36 GiB
    minimum). The planted blockwise forms show the check can fail."""
    plain, planted = _run_head("plain"), _run_head("blockwise")
    assert max(plain.values()) <= 1024, plain          # a few scalars per row at most
    assert min(planted.values()) >= 4 * 32000 * 2, planted   # the [4, V] logits, gathered


# Every method and drafting shape of tests/test_loop_copies.py, bf16 on TPU, the layer
# ranges looped (as large layers run) and unrolled (as small ones do).
SWEEP = r'''
import dataclasses, sys
from s2d_jax.parallel import topology
devs = topology.devices("v5e:2x2")
import jax, jax.numpy as jnp
from s2d_jax.config import ModelConfig
from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.decode.aot import abstract_params, round_copy_list
from s2d_jax.decode.round_copies import summary
from s2d_jax.decode.state import DecodeParams, SpecConfig
from s2d_jax.model import layers
from s2d_jax.parallel.mesh import MeshConfig
from s2d_jax.parallel.multihost import build_mesh
C = 1024
def cfg(n):
    return ModelConfig(vocab_size=1024, hidden_size=2048, intermediate_size=1024,
                       num_layers=n, num_heads=16, num_kv_heads=16,
                       max_position_embeddings=4096, dtype="bfloat16", param_dtype="bfloat16")
target = cfg(4)
mesh = build_mesh(MeshConfig(tensor=4), {"t": target}, devices=devs)
CASES = {
    "sd-gamma1": (SpecConfig(method="sd", exits=(3,), gamma=1, max_len=C), ()),
    "sd-gamma4": (SpecConfig(method="sd", exits=(3,), gamma=4, max_len=C), ()),
    "s2d-2-exits": (SpecConfig(method="s2d", exits=(1, 3), gamma=4, max_len=C), ()),
    "s2d-3-exits": (SpecConfig(method="s2d", exits=(1, 2, 3), gamma=4, max_len=C), ()),
    "chain-3-levels": (SpecConfig(method="s2d", exits=(1, 3), gamma=2, max_len=C, mus=(2,)),
                       (2,)),
    "lookup": (SpecConfig(method="lookup", gamma=4, max_len=C), ()),
    "ladder-2-exits": (SpecConfig(method="ladder", exits=(1, 3), gamma=4, max_len=C,
                                  lookup_len=2), ()),
}
for loop in sys.argv[1].split(","):
    unrolled = loop == "unrolled"
    layers.UNROLL_LAYERS, layers.UNROLL_MAX_LAYER_PARAMS = \
        (10**6, float("inf")) if unrolled else (0, 0)
    for name, (spec, mid) in CASES.items():
        draft = cfg(3); mids = tuple(cfg(n) for n in mid)
        chain = Chain(draft, mids, target, spec, mesh)
        S = jax.ShapeDtypeStruct
        lowered = engine.generate.lower(
            None if chain.draft is None else abstract_params(chain.draft, mesh),
            abstract_params(target, mesh),
            S((1, 64), jnp.int32), S((1,), jnp.int32),
            jax.eval_shape(lambda: DecodeParams.make(spec)),
            jax.eval_shape(lambda: jax.random.key(0)),
            tuple(abstract_params(m, mesh) for m in chain.mids), chain=chain)
        hlo = lowered.compile().as_text()
        s = summary(round_copy_list(hlo, [target, chain.draft, *chain.mids], 1, C, mesh))
        print(loop, name, s["cache"][0], flush=True)
        jax.clear_caches()
'''


@pytest.mark.slow
def test_tpu_every_method_copies_no_cache():
    """SD gamma 1 and 4, S2D with 2 and 3 exits, a 3-level chain, the lookup rung alone and
    the ladder (lookup, then 2 exits), looped and unrolled: no cache copy per round
    (measured ~2 minutes on 2 cores before the lookup rows)."""
    proc = subprocess.run([sys.executable, "-c", SWEEP, "looped,unrolled"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.startswith(("looped", "unrolled"))]
    assert len(rows) == 14, proc.stdout
    assert all(r[2] == "0" for r in rows), proc.stdout

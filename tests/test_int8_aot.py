"""Int8 weights as an AOT compile plans them (`infer.aot --weights int8`): the target's
decoder matrices and head int8 with per-output-channel scales (quantize.QuantizedConfig).
Here: the abstract quantized params are placed like the weights they replace, the floor
counts their int8 bytes and scales, and (libtpu, no TPU) the TPU compiler's round reads
them as int8: its HLO walk is the int8 floor within 10%, no dequantized bf16 weight lands
in HBM (the compiler converts each layer's int8 slice in VMEM, inside the matmul's fusion)
and no cache is copied."""

import dataclasses
import importlib.util
import math
import os
import subprocess
import sys

import jax
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.decode.aot import GenerateSetup, abstract_params
from s2d_jax.decode.roofline import minimum_round_bytes
from s2d_jax.errors import S2DError
from s2d_jax.model.kvcache import cache_bytes
from s2d_jax.model.quantize import QuantizedWeight, with_weights
from s2d_jax.parallel.mesh import MeshConfig
from s2d_jax.parallel.memory import tree_bytes_per_device
from s2d_jax.parallel.multihost import build_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                  dtype="bfloat16", param_dtype="bfloat16")


def test_quantized_params_are_placed_like_their_weights_and_the_floor_counts_int8():
    cfg = with_weights(CFG, "int8")
    mesh = build_mesh(MeshConfig(tensor=2), {"t": cfg}, devices=jax.devices()[:2])
    params = abstract_params(cfg, mesh)
    wq, wo, head = params["layers"]["wq"], params["layers"]["wo"], params["lm_head"]
    assert isinstance(wq, QuantizedWeight) and wq.q.dtype == "int8" and wq.bits == 8
    # heads split over tensor: wq's flattened out axis (N*H), wo's flattened in axis
    assert wq.q.sharding.shard_shape(wq.q.shape) == (2, 256, 128)
    assert wq.scale.sharding.shard_shape(wq.scale.shape) == (2, 1, 1, 128)
    assert wo.q.sharding.shard_shape(wo.q.shape) == (2, 128, 256)
    assert head.q.sharding.shard_shape(head.q.shape) == (256, 256)  # vocab split
    # the floor: every matrix's int8 bytes and f32 scales once, norms, the cache
    leaves = [a for k, v in params.items() if k != "embed" for a in jax.tree.leaves(v)]
    assert sum(a.dtype == "int8" for a in leaves) == 8  # 7 matrices and the head
    per_dev = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                  for a in leaves)
    setup = GenerateSetup.make(cfg, None, (), 1, 256, 64, None, "ar")
    floor = minimum_round_bytes(setup, mesh)
    assert floor[0] == floor[1] == per_dev + cache_bytes(cfg, 1, 256, mesh)[1]
    bf16 = minimum_round_bytes(GenerateSetup.make(CFG, None, (), 1, 256, 64, None, "ar"), mesh)
    assert floor[1] < 0.6 * bf16[1]
    assert tree_bytes_per_device(params) < 0.6 * tree_bytes_per_device(
        abstract_params(CFG, mesh))


def test_bad_weights_are_one_line_errors():
    with pytest.raises(S2DError, match="unknown weights"):
        with_weights(CFG, "int3")
    from infer.aot import main
    with pytest.raises(SystemExit):  # argparse's choices: one line on stderr
        main(["--target-config", "configs/models/vicuna-7b-v1.5.yaml", "--weights", "int3"])


LIBTPU = os.environ.get("S2D_LIBTPU_PATH", "")
needs_tpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None
                               and not os.path.isfile(LIBTPU),
                               reason="libtpu (the TPU compiler) is not installed and "
                                      "S2D_LIBTPU_PATH names no libtpu.so")

# a child: the topology path sets its environment before JAX starts. A 7B-wide 16-layer
# target over v5e:2x4 (tensor=8): 21 MiB of int8 a layer a chip, more than the loop can keep
# in VMEM, so each round reads most of them from HBM as the 70B's does. (Its vocabulary
# keeps the bf16 embedding's shard from the size of a matrix's layer.)
TPU_CHILD = r'''
import dataclasses, sys
from s2d_jax.parallel import topology
devs = topology.devices("v5e:2x4")
from s2d_jax.config import ModelConfig
from s2d_jax.decode.aot import (GenerateSetup, compile_generate, device_param_shapes,
                                round_bytes, round_copy_list)
from s2d_jax.decode.hlo_copies import _callees, decode_loop_body
from s2d_jax.decode.hlo_module import Module, arrays_of
from s2d_jax.decode.roofline import minimum_round_bytes
from s2d_jax.decode.round_copies import summary
from s2d_jax.model.quantize import with_weights
from s2d_jax.parallel.mesh import MeshConfig
from s2d_jax.parallel.multihost import build_mesh
import math
cfg = ModelConfig(vocab_size=6144, hidden_size=4096, intermediate_size=11008, num_layers=16,
                  num_heads=32, num_kv_heads=8, max_position_embeddings=2048,
                  dtype="bfloat16", param_dtype="bfloat16")
q = with_weights(cfg, "int8")
mesh = build_mesh(MeshConfig(tensor=8), {"t": cfg}, devices=devs)
setup = GenerateSetup.make(q, None, (), int(sys.argv[1]), 2048, 256, None, "ar")
compiled = compile_generate(setup, mesh)[0]
text = compiled.as_text()
walk = round_bytes(compiled, setup, mesh)
# the elements of one layer of each matrix a device holds: a bf16 array of that size in
# HBM inside the round loop would be a dequantized weight
sizes = {math.prod(s[1:]) for s in device_param_shapes([cfg], mesh) if len(s) >= 3}
mod = Module(text)
todo, seen, bf16_weights = [decode_loop_body(mod.comps)], set(), 0
while todo:
    comp = todo.pop()
    seen.add(comp)
    for ins in mod.instrs[comp]:
        todo += [c for c in _callees(ins.line) if c not in seen and ins.opcode != "fusion"]
        bf16_weights += sum(dt == "bf16" and space == 0 and math.prod(dims) in sizes
                            for dt, dims, space in arrays_of(ins.type))
copies = summary(round_copy_list(text, [q], setup.batch, 2048, mesh))
from s2d_jax.model.kvcache import cache_bytes
cache = cache_bytes(cfg, setup.batch, 2048, mesh)[1]
print((walk.hi, walk.on_chip, minimum_round_bytes(setup, mesh)[1] - cache,
       minimum_round_bytes(dataclasses.replace(setup, target_cfg=cfg), mesh)[1] - cache,
       cache, bf16_weights, copies["cache"][0]))
'''


@needs_tpu
# slow: a TPU compile of a 16-layer model (~1 min each; CI's 20-minute budget)
@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8])
def test_tpu_round_reads_int8_weights_at_the_int8_floor(batch):
    """The 70B at int8 on v5e-8 (docs/distributed.md "int8 on v5e-8") in small: batch 1's
    matrix-vector products and batch 8's matmuls both read the int8 bytes (~15 s each on 2
    cores). Before hlo_traffic read the compiler's nested re-tiling copy of an int8 stack
    as the layer slice it is, the walk counted every layer reading the whole stack."""
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
           **({"TPU_LIBRARY_PATH": LIBTPU} if LIBTPU else {})}
    proc = subprocess.run([sys.executable, "-c", TPU_CHILD, str(batch)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    walk, on_chip, weights, bf16, cache, bf16_weights, cache_copies = eval(
        proc.stdout.strip().splitlines()[-1])
    assert weights < 0.52 * bf16  # the floor's weights: int8 bytes + scales, not bf16's
    floor = weights + cache
    assert 0.97 * floor <= walk + on_chip <= 1.10 * floor, (walk, on_chip, floor)
    assert on_chip < floor / 2  # most of the round comes from HBM
    assert bf16_weights == 0 and cache_copies == 0

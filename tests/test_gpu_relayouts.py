"""Layout changes of a cache count as copies of it (round_copies.relayout), read off XLA:GPU
programs: the H100's compile of 16 AR steps of a Vicuna-7B-shaped target (bf16, 2048 slots;
`.devscript`-style probe run on the lent H100, 2026-11-28, jax 0.11.2) transposed its whole K
and V caches in every layer before model/attention.py ran a single query row twice (64
relayouts, 32 GiB a step: 42.6 ms a step against 18.7 for two tokens), none after (18.4 ms).
With the CUDA plugin installed (no GPU needed) a deviceless compile of a small model
without grouped queries checks the same on today's code."""

import lzma
import os

import cuda_child
from s2d_jax.decode.round_copies import round_copies, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
VICUNA_7B_CACHE = (32, 1, 32, 2048, 128)  # [L, B, K, S, H] per device


def _hlo(name):
    with lzma.open(os.path.join(DATA, f"h100_vicuna7b_ar_steps_{name}.hlo.xz"), "rt") as f:
        return f.read()


def test_the_h100_step_transposed_its_caches_in_every_layer_before_the_fix():
    s = summary(round_copies(_hlo("transposed"), [VICUNA_7B_CACHE]))
    n, nbytes = s["cache"]
    assert n == 2 * 32 and nbytes == 64 * 32 * 32 * 2048 * 128 * 2, s  # K and V, 32 layers


def test_the_h100_step_keeps_its_caches_in_place_after_the_fix():
    assert summary(round_copies(_hlo("fixed"), [VICUNA_7B_CACHE]))["cache"] == (0, 0)


CHILD = r'''
import dataclasses
from s2d_jax.parallel import topology
devs = topology.devices("h100:1")
import jax
from s2d_jax.config import ModelConfig
from s2d_jax.decode.aot import GenerateSetup, compile_generate, round_copy_list
from s2d_jax.decode.round_copies import summary
from s2d_jax.parallel.mesh import MeshConfig
from s2d_jax.parallel.multihost import build_mesh
cfg = ModelConfig(vocab_size=1024, hidden_size=1024, intermediate_size=1024, num_layers=4,
                  num_heads=8, num_kv_heads=8, max_position_embeddings=4096,
                  dtype="bfloat16", param_dtype="bfloat16")  # no grouped queries: G = 1
mesh = build_mesh(MeshConfig(), {"t": cfg}, devices=devs)
setup = GenerateSetup.make(cfg, None, (), 1, 2048, 64, 1, "ar")
compiled = compile_generate(setup, mesh)[0]
print(summary(round_copy_list(compiled.as_text(), [setup.target_cfg], 1, 2048, mesh)))
'''


@cuda_child.needs_plugin
def test_a_deviceless_h100_compile_of_an_ar_round_relayouts_no_cache():
    proc = cuda_child.run(CHILD)
    found = eval(proc.stdout.strip().splitlines()[-1])
    assert found["cache"] == (0, 0), found

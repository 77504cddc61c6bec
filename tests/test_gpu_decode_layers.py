"""Decode layer ranges over static weight slices, the GPU programs' form (layers.py
`decode_unrolled`): in a layer loop XLA:GPU copies each layer's matrices out of their stack
before the GEMM reads them (2.7x a 7B AR step's weight bytes); unrolled over static slices
the GEMM reads the stack in place. Checked here on the CPU compiler: the scope follows the
chain's devices, removes every traced slice of a weight stack from the decode program, and
keeps greedy decoding exact. (The H100 compiler's own walk: tests/test_gpu_walk.py.)"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.model import decode_scope, layers
from s2d_jax.model import transformer as model
from s2d_jax.model.kvcache import init_cache
from test_engine import CFG, PROMPTS, make_decoder, reference, target_params

NEW = 12


def _mesh_of(platform: str):
    """A stand-in for a Mesh: for_platform reads its first device's platform and the
    tensor axis's size."""
    device = types.SimpleNamespace(platform=platform)
    return types.SimpleNamespace(devices=np.array([device], dtype=object).reshape(1, 1, 1),
                                 axis_names=("data", "fsdp", "tensor"))


def test_the_scope_follows_the_chains_devices():
    assert not layers.static_decode_slices()  # the CPU backend keeps its loops
    for platform, on in (("gpu", True), ("cuda", True), ("tpu", False), ("cpu", False)):
        with layers.for_platform(_mesh_of(platform)):
            assert layers.static_decode_slices() is on, platform
    with layers.decode_unrolled(True), layers.for_platform(None):
        assert layers.static_decode_slices()  # no mesh: the scope around the call decides
    assert not layers.static_decode_slices()


def test_few_rows_are_padded_only_for_matrices_small_on_each_device():
    """decode_scope.few_rows: a 7B MLP matrix (45M elements) stays a plain GEMM on one GPU
    and is padded where 8 GPUs split it (5.6M each, under XLA:GPU's 10M strength-reduction
    bound); a prefill's many rows never are; the CPU never pads."""
    x1, x_many = jnp.zeros((1, 1, 4096)), jnp.zeros((1, 512, 4096))
    w = jax.ShapeDtypeStruct((4096, 11008), jnp.bfloat16)
    assert not decode_scope.few_rows(x1, w)
    one, eight = _mesh_of("gpu"), _mesh_of("gpu")
    eight.devices = np.array([eight.devices.flat[0]] * 8, dtype=object).reshape(1, 1, 8)
    with layers.for_platform(one):
        assert not decode_scope.few_rows(x1, w)
    with layers.for_platform(eight):
        assert decode_scope.few_rows(x1, w) and not decode_scope.few_rows(x_many, w)
    out = decode_scope.gemm_rows("BTD,DF->BTF", jnp.arange(8.0).reshape(1, 1, 8),
                                 jnp.eye(8)[:, :3], 2)
    np.testing.assert_array_equal(out, np.arange(3.0).reshape(1, 1, 3))


def _decode_step_hlo(params, cache, h, pos):
    fn = jax.jit(lambda p, c, h, pos: layers.decode_layers(p, CFG, h, pos, 0, CFG.num_layers, c))
    return fn.lower(params, cache, h, pos).compile().as_text(), fn(params, cache, h, pos)


def _weight_dynamic_slices(hlo: str, params) -> list[str]:
    """dynamic-slice instructions whose result is one layer of a weight stack."""
    shapes = {",".join(map(str, (1,) + w.shape[1:])) for w in jax.tree.leaves(params["layers"])}
    shapes |= {",".join(map(str, w.shape[1:])) for w in jax.tree.leaves(params["layers"])}
    found = []
    for line in hlo.splitlines():
        if " dynamic-slice(" in line:
            dims = line.split("=", 1)[1].split("[", 1)[1].split("]", 1)[0]
            if dims in shapes:
                found.append(line.strip()[:120])
    return found


def test_static_slices_leave_no_traced_weight_slice_and_the_same_result(monkeypatch):
    monkeypatch.setattr(layers, "UNROLL_LAYERS", 0)  # every range a loop, as large layers run
    params = jax.tree.map(jnp.asarray, target_params())
    cache = init_cache(CFG, 2, 32)
    h = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, CFG.hidden_size)),
                    jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(5, 8, dtype=jnp.int32), (2, 3))
    looped_hlo, (looped, _) = _decode_step_hlo(params, cache, h, pos)
    with layers.decode_unrolled(True):
        static_hlo, (static, _) = _decode_step_hlo(params, cache, h, pos)
    assert _weight_dynamic_slices(looped_hlo, params), "the loop should slice at a traced index"
    assert _weight_dynamic_slices(static_hlo, params) == []
    assert " while(" in looped_hlo and " while(" not in static_hlo
    np.testing.assert_allclose(np.asarray(static), np.asarray(looped), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method,exits,gamma", [("s2d", (1, 2, 3), 3), ("ar", (), 0)])
def test_greedy_stays_exact_over_static_slices(method, exits, gamma, monkeypatch):
    monkeypatch.setattr(layers, "UNROLL_LAYERS", 0)
    jax.clear_caches()  # the scope is read when a program is traced
    dec = make_decoder(method, exits, gamma)
    with layers.decode_unrolled(True):
        out = dec.generate(PROMPTS[:2], max_new_tokens=NEW, thresholds=[0.3] * len(exits)
                           if exits else None, eos_id=-1)
    jax.clear_caches()
    for p, o in zip(PROMPTS[:2], out):
        assert o["token_ids"] == reference(tuple(p))[:NEW], (method, p)


def test_prefill_keeps_its_loop_in_the_scope(monkeypatch):
    """Only decode ranges unroll: a prefill reads each weight once a call anyway, and
    unrolling it too took a 7B program's compile from 8 s to 29 s."""
    monkeypatch.setattr(layers, "UNROLL_LAYERS", 0)
    params = jax.tree.map(jnp.asarray, target_params())
    tokens = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), tokens.shape)
    fn = jax.jit(lambda p, t, c: layers.run_layers(p, CFG, model.embed_tokens(p, CFG, t),
                                                   positions, cache=c))
    with layers.decode_unrolled(True):
        hlo = fn.lower(params, tokens, init_cache(CFG, 1, 16)).compile().as_text()
    assert " while(" in hlo and _weight_dynamic_slices(hlo, params)

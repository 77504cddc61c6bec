"""The sliced transformer: layer ranges compose, a prefix is a smaller model, 70B shapes."""

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.config import ModelConfig, RopeScaling, load_model_config
from s2d_jax.model.kvcache import init_cache, write_layers
from s2d_jax.model.transformer import (abstract_params, decode_layers, embed_tokens, forward,
                                      lm_logits, param_shapes, run_layers)
from tiny_models import numpy_params

MODELS = os.path.join(os.path.dirname(__file__), "..", "configs", "models")
CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=6,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=32,
                  rope_scaling=RopeScaling("linear", 2.0))


# norms around 1 (not ones), so a norm weight that is dropped or misapplied shows
random_params = functools.partial(numpy_params, std=0.2, norm_jitter=0.5)


@functools.partial(jax.jit, static_argnums=(1, 4, 5))
def _run(params, cfg, h, positions, start, end, cache=None):
    if cache is None:
        return run_layers(params, cfg, h, positions, start, end)
    return decode_layers(params, cfg, h, positions, start, end, cache)


@pytest.fixture(scope="module")
def setup():
    params = random_params(CFG)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, CFG.vocab_size)
    h = embed_tokens(params, CFG, tokens)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    return params, tokens, h, positions


@pytest.mark.parametrize("a,b", [(2, 6), (0, 4)])
def test_layer_ranges_compose_without_cache(setup, a, b):
    params, _, h, positions = setup
    whole, _ = _run(params, CFG, h, positions, 0, b)
    first, _ = _run(params, CFG, h, positions, 0, a)
    split, _ = _run(params, CFG, first, positions, a, b)
    assert float(jnp.abs(whole - h).max()) > 0.1  # the layers do something
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), atol=1e-5, rtol=1e-5)


def test_layer_ranges_compose_with_cache(setup, a=2, b=5):
    """Prefill 6 tokens then decode 3, in two ranges or one: same hidden states and caches."""
    params, _, h, positions = setup
    results = []
    for ranges in ([(0, b)], [(0, a), (a, b)]):
        cache = init_cache(CFG, 2, 12)
        outs = []
        for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 9)):
            x = h[:, lo:hi]
            for start, end in ranges:
                x, cache = _run(params, CFG, x, positions[:, lo:hi], start, end, cache)
            cache = cache.with_lengths(cache.lengths + (hi - lo))
            outs.append(x)
        results.append((jnp.concatenate(outs, axis=1), cache))
    (h_one, c_one), (h_two, c_two) = results
    np.testing.assert_allclose(np.asarray(h_two), np.asarray(h_one), atol=1e-5, rtol=1e-5)
    for name in ("k", "v"):
        one, two = np.asarray(getattr(c_one, name)), np.asarray(getattr(c_two, name))
        assert np.all(np.abs(one[:b, :, :9]).max(axis=(3, 4)) > 0)  # every slot written ...
        assert np.all(one[b:] == 0) and np.all(one[:, :, 9:] == 0)  # ... and only those
        np.testing.assert_allclose(two, one, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(c_two.lengths), [9, 9])
    # the cached pass equals the uncached one over the same range
    ref, _ = _run(params, CFG, h, positions, 0, b)
    np.testing.assert_allclose(np.asarray(h_one), np.asarray(ref), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_prefill_equals_the_cached_one(setup, cache_dtype):
    """A prefill (run_layers with a cache: attend within the call, causally) = decode_layers
    attending over every cache slot: same hidden states, same stored keys/values, and the
    next decode step agrees."""
    params, _, h, positions = setup
    fresh_run = jax.jit(functools.partial(run_layers, cfg=CFG, start=0, end=6))
    outs = []
    for prefill in (lambda c: _run(params, CFG, h[:, :7], positions[:, :7], 0, 6, c),
                    lambda c: fresh_run(params, h=h[:, :7], positions=positions[:, :7],
                                        cache=c)):
        x, cache = prefill(init_cache(CFG, 2, 12, dtype=cache_dtype))
        cache = cache.with_lengths(cache.lengths + 7)
        nxt, cache = _run(params, CFG, h[:, 7:8], positions[:, 7:8], 0, 6, cache)
        outs.append((x, nxt, cache))
    (x1, n1, c1), (x2, n2, c2) = outs
    assert float(jnp.abs(x1 - h[:, :7]).max()) > 0.1
    # float32 sums in another order (T keys, not max_len slots): ~1e-5 on values up to ~15
    np.testing.assert_allclose(np.asarray(x2), np.asarray(x1), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(n2), np.asarray(n1), atol=1e-4, rtol=1e-4)
    tol = 1e-4 if cache_dtype == "float32" else 2e-2
    for name in ("k", "v"):
        one, two = (np.asarray(getattr(c, name), np.float32) for c in (c1, c2))
        assert np.all(np.abs(one[:, :, :8]).max(axis=(3, 4)) > 0) and np.all(one[:, :, 8:] == 0)
        np.testing.assert_allclose(two, one, atol=tol, rtol=tol)


def test_layer_prefix_is_the_truncated_model(setup):
    """Exit e of a sorted draft == the model cut to e layers (what --num-layers produces)."""
    params, tokens, h, positions = setup
    e = 4
    small_cfg = dataclasses.replace(CFG, num_layers=e)
    small = dict(params, layers=jax.tree.map(lambda x: x[:e], params["layers"]))
    want, _ = jax.jit(forward, static_argnums=1)(small, small_cfg, tokens)
    x, _ = _run(params, CFG, h, positions, 0, e)
    got = lm_logits(params, CFG, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_llama2_70b_shapes_without_allocation():
    cfg = load_model_config(os.path.join(MODELS, "llama2-70b-chat.yaml"))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 8, 128)
    shapes = abstract_params(cfg)
    leaves = jax.tree.leaves(shapes)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert shapes["layers"]["wq"].shape == (80, 8192, 64, 128)
    assert shapes["layers"]["wk"].shape == (80, 8192, 8, 128)
    assert shapes["layers"]["w_down"].shape == (80, 28672, 8192)
    assert shapes["lm_head"].shape == (8192, 32000)
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    total = sum(math.prod(x.shape) for x in leaves)
    assert 68.5e9 <= total <= 69.5e9
    assert total == cfg.num_params()


@pytest.mark.parametrize("name,billions", [("vicuna-7b-v1.5", 6.74), ("vicuna-13b-v1.5", 13.02)])
def test_vicuna_param_counts(name, billions):
    cfg = load_model_config(os.path.join(MODELS, f"{name}.yaml"))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg)))
    assert total == cfg.num_params()
    assert abs(total / 1e9 - billions) < 0.01


@pytest.mark.parametrize("tied", [False, True])
def test_init_follows_the_param_table(tied):
    """The init: exactly the table's tree and shapes, normal(std) matrices drawn
    independently per layer, unit norms, the logical axes of each row (plus "layers")."""
    from s2d_jax.model.params import active_params, stored_shape
    from s2d_jax.model.transformer import init_params, logical_param_specs

    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied, param_dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0), std=0.05)
    assert jax.tree.map(lambda x: tuple(x.shape), params) == param_shapes(cfg)
    assert ("lm_head" in params) == (not tied)
    specs = logical_param_specs(cfg)
    for row in active_params(cfg):
        x = params["layers"][row.name] if row.stacked else params[row.path]
        spec = specs["layers"][row.name] if row.stacked else specs[row.path]
        assert x.dtype == jnp.bfloat16 and x.shape == stored_shape(row, cfg)
        assert tuple(spec) == (("layers",) if row.stacked else ()) + row.axes
        x = np.asarray(x, np.float32)
        if row.init == "ones":
            assert (x == 1).all()
        else:
            assert abs(x.std() - 0.05) < 0.01 and abs(x.mean()) < 0.01
            if row.stacked:
                assert not np.allclose(x[0], x[1])


def test_init_draws_what_the_linen_modules_drew():
    """A seed gives the weights it gave when the model was Flax Linen modules, bit for bit
    (values read off that init, seed 0): the demo family is trained from a seeded init,
    so a changed key derivation would silently change every model built from scratch."""
    from s2d_jax.model.transformer import init_params

    cfg = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=4, dtype="float32",
                      param_dtype="float32", tie_word_embeddings=False)
    params = init_params(cfg, jax.random.key(0))
    want = {  # (first two values, the last layer's last value)
        "embed": ([0.0015228500124067068, -0.03231491893529892], -0.0006722758407704532),
        "lm_head": ([0.02603146992623806, 0.018222035840153694], -0.005474050063639879),
        "wq": ([-0.018258681520819664, -0.004337095655500889], 0.014007273130118847),
        "w_down": ([0.0025520711205899715, -0.034244388341903687], -0.018970942124724388)}
    for name, (first, last) in want.items():
        x = np.asarray(params["layers"][name] if name[0] == "w" else params[name])
        assert x.reshape(-1)[:2].tolist() == first and x.reshape(len(x), -1)[-1, -1] == last, name


def test_param_shardings_follow_the_rules():
    from jax.sharding import Mesh, PartitionSpec as P
    from s2d_jax.model.transformer import param_shardings

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    sh = param_shardings(CFG, mesh)
    assert sh["layers"]["wq"].spec == P(None, "fsdp", "tensor", None)
    assert sh["layers"]["wo"].spec == P(None, "tensor", None, "fsdp")
    assert sh["embed"].spec == P("tensor", "fsdp")
    assert sh["lm_head"].spec == P("fsdp", "tensor")
    assert sh["final_norm"].spec == P(None)


@pytest.mark.parametrize("block", [4, 5, 16])
@pytest.mark.parametrize("positions", [[[5, 6, 7], [2, 3, 4]], [[12, 13, 14], [9, 10, 11]]])
def test_block_attention_equals_whole_buffer_attention(block, positions):
    """A decode step reads the cache block by block up to the batch's last position (a
    running softmax): the same as one softmax over all slots <= position, for blocks that
    divide the buffer or not (the last block then overlaps the one before: block 4 of a
    15-slot buffer at position 14), rows at different positions, several query tokens, and
    written slots past a row's position that must not be read."""
    params = random_params(CFG)
    S, B = 15, 2
    hist = jax.random.normal(jax.random.key(3), (B, 11, CFG.hidden_size))
    cache = init_cache(CFG, B, S)
    _, cache = decode_layers(params, CFG, hist, jnp.broadcast_to(jnp.arange(11), (B, 11)), 0, 6,
                             cache)  # slots 0-10 of both rows hold keys/values
    h = jax.random.normal(jax.random.key(4), (B, 3, CFG.hidden_size))
    positions = jnp.asarray(positions, jnp.int32)
    step = jax.jit(decode_layers, static_argnames=("cfg", "start", "end", "attention_block"))
    outs = {b: step(params, CFG, h, positions, 0, 6, cache, attention_block=b)
            for b in (block, S)}
    (got, got_cache), (want, want_cache) = outs[block], outs[S]
    # float32 sums in another order: ~2e-5 on values up to ~10
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(got_cache.k[0]), np.asarray(want_cache.k[0]))
    np.testing.assert_allclose(np.asarray(got_cache.v), np.asarray(want_cache.v), atol=1e-4,
                               rtol=1e-4)  # deeper layers' inputs carry that rounding
    # the slots past row 1's positions hold keys (row 0's positions reach them): reading
    # them would change row 1's result
    later, _ = step(params, CFG, h, positions.at[1].set(positions[0]), 0, 6, cache,
                    attention_block=block)
    assert float(jnp.abs(later[1] - got[1]).max()) > 1e-2


@pytest.mark.parametrize("block", [4, 15])
def test_deferred_writes_attend_as_if_written(block):
    """A draft step's layers that only read the cache (defer_writes: the new keys/values
    are returned, for a write after a lax.cond) attend as the step that writes them first:
    the new tokens read as one more block after the cache's (not patched into each block
    read, which made XLA copy every block), their slots in the cache masked, keys past the
    cache's end dropped (row 1 runs past slot 14)."""
    params = random_params(CFG)
    S, B = 15, 2
    hist = jax.random.normal(jax.random.key(3), (B, 14, CFG.hidden_size))
    cache = init_cache(CFG, B, S)
    _, cache = decode_layers(params, CFG, hist, jnp.broadcast_to(jnp.arange(14), (B, 14)), 0, 6,
                             cache)  # stale keys at the slots the new tokens take
    h = jax.random.normal(jax.random.key(4), (B, 3, CFG.hidden_size))
    positions = jnp.asarray([[5, 6, 7], [13, 14, 15]], jnp.int32)
    want, want_cache = decode_layers(params, CFG, h, positions, 0, 6, cache, attention_block=block)
    got, (k, v) = decode_layers(params, CFG, h, positions, 0, 6, cache, attention_block=block,
                                defer_writes=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    written = write_layers(cache, 0, k, v, jnp.broadcast_to(positions, k.shape[:3]))
    np.testing.assert_allclose(np.asarray(written.k), np.asarray(want_cache.k), atol=1e-4)

"""Sorted draft: exit validation, one-pass multi-exit hidden states, and the SoFT loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.model import transformer as model
from s2d_jax.config import ModelConfig
from s2d_jax.errors import S2DError
from s2d_jax.model.sorted_draft import (DraftConfig, draft_prefix, multi_exit_hidden,
                                        multi_exit_logits, soft_loss, validate_exits)

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4,
                  num_heads=4, num_kv_heads=2)
EXITS = (1, 3, 4)


def _batch(seed, B=2, T=12):
    """Two packed segments per row (lengths 7 and T-7), random tokens and mask."""
    rng = np.random.default_rng(seed)
    seg = np.where(np.arange(T) < 7, 1, 2)[None].repeat(B, 0).astype(np.int32)
    pos = np.where(seg == 1, np.arange(T), np.arange(T) - 7).astype(np.int32)
    return {"inputs": rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
            "targets": rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
            "loss_mask": (rng.random((B, T)) < 0.6).astype(np.float32),
            "segment_ids": seg, "positions": pos}


def _params(seed, std=0.02):
    return jax.jit(model.init_params, static_argnums=(0, 2))(CFG, jax.random.key(seed), std)


@pytest.mark.parametrize("exits,n", [((3, 2, 4), 4), ((2, 2, 4), 4), ((0, 4), 4), ((2, 3), 4),
                                     ((2, 5), 4), ((), 4)])
def test_bad_exits_raise_one_clear_error(exits, n):
    with pytest.raises(S2DError, match=r"draft exits .* invalid for a 4-layer draft"):
        validate_exits(exits, n)


def test_good_exits_and_defaults():
    validate_exits((1, 3, 4), 4)
    assert DraftConfig().resolved_exits(4) == (4,)
    assert DraftConfig(exits=(2, 4)).resolved_weights(2) == (1.0, 1.0)
    with pytest.raises(S2DError, match="one weight per exit"):
        DraftConfig(exits=(2, 4), exit_weights=(1.0,)).resolved_weights(2)


def test_multi_exit_hidden_matches_separate_runs_and_full_forward():
    params = _params(0, 0.2)
    b = _batch(1)
    hidden = jax.jit(multi_exit_hidden, static_argnums=(1, 2))(
        params, CFG, EXITS, b["inputs"], b["positions"], b["segment_ids"])
    h0 = model.embed_tokens(params, CFG, b["inputs"])
    run = jax.jit(model.run_layers, static_argnums=(1, 4, 5))
    for e, h in zip(EXITS, hidden):
        ref, _ = run(params, CFG, h0, b["positions"], 0, e, None, b["segment_ids"])
        np.testing.assert_allclose(h, ref, atol=1e-5, rtol=1e-5)
    full, _ = jax.jit(model.forward, static_argnums=(1,))(
        params, CFG, b["inputs"], b["positions"], segment_ids=b["segment_ids"])
    last = _logits(params, b)[-1]
    np.testing.assert_allclose(last, full, atol=1e-5, rtol=1e-5)
    # The exits really differ (a test of the slicing, not of identical outputs).
    assert float(jnp.max(jnp.abs(hidden[0] - hidden[1]))) > 1e-2


def _logits(params, b):
    return jax.jit(multi_exit_logits, static_argnums=(1, 2))(
        params, CFG, EXITS, b["inputs"], b["positions"], b["segment_ids"])


def _manual_exit_losses(params, b):
    logits = _logits(params, b)
    mask = np.asarray(b["loss_mask"])
    t = np.asarray(b["targets"])
    losses, accs = [], []
    for lg in logits:
        lg = np.asarray(lg, np.float64)
        lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
        ce = lse - np.take_along_axis(lg, t[..., None], -1)[..., 0]
        losses.append((ce * mask).sum() / mask.sum())
        accs.append(((lg.argmax(-1) == t) * mask).sum() / mask.sum())
    return np.array(losses), np.array(accs)


def test_soft_loss_is_weighted_mean_of_masked_exit_losses():
    params = _params(2, 0.2)
    b = _batch(3)
    want, want_acc = _manual_exit_losses(params, b)
    loss_fn = jax.jit(soft_loss, static_argnums=(1, 2, 4))
    loss, m = loss_fn(params, CFG, EXITS, b)
    np.testing.assert_allclose(m["exit_loss"], want, rtol=1e-5)
    np.testing.assert_allclose(m["exit_acc"], want_acc, rtol=1e-6)
    np.testing.assert_allclose(loss, want.mean(), rtol=1e-5)
    loss_w, _ = loss_fn(params, CFG, EXITS, b, (1.0, 0.0, 3.0))
    np.testing.assert_allclose(loss_w, (want[0] + 3 * want[2]) / 4, rtol=1e-5)
    # Masked-out tokens do not count: changing their targets leaves the loss unchanged.
    b2 = dict(b, targets=np.where(b["loss_mask"] > 0, b["targets"], 0).astype(np.int32))
    np.testing.assert_allclose(loss_fn(params, CFG, EXITS, b2)[0], loss, rtol=1e-6)


def _sub_jaxprs(params):
    for v in params.values():
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):  # ClosedJaxpr
                yield x.jaxpr
            elif hasattr(x, "eqns"):  # Jaxpr
                yield x


def _out_shapes(jaxpr, recurse: bool):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        if recurse:
            for sub in _sub_jaxprs(eqn.params):
                yield from _out_shapes(sub, True)


def test_gradient_holds_one_exit_logits_at_a_time():
    """Exit logits [B, T, V] exist only inside the per-exit loop, never stacked [E, B, T, V]."""
    params = _params(4)
    b = _batch(5, B=2, T=12)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: soft_loss(p, CFG, EXITS, b)[0]))(params).jaxpr
    one, stacked = (2, 12, CFG.vocab_size), (len(EXITS), 2, 12, CFG.vocab_size)
    everywhere = set(_out_shapes(jaxpr, recurse=True))
    top_level = set(_out_shapes(jaxpr, recurse=False))
    assert one in everywhere  # the logits are computed (inside the exit loop)...
    assert one not in top_level and stacked not in everywhere  # ...one exit at a time


def test_a_prefix_of_a_sorted_draft_predicts_as_the_whole_at_its_exits():
    params = _params(2, 0.2)
    extra = {"s2d_exits": list(EXITS), "s2d_head_vocab": [1, 2, 3]}
    cfg3, p3, extra3 = draft_prefix(CFG, params, extra, [1, 3])
    assert cfg3.num_layers == 3 and extra3 == {"s2d_exits": [1, 3], "s2d_head_vocab": [1, 2, 3]}
    assert all(v.shape[0] == 3 for v in p3["layers"].values())
    tokens = _batch(3)["inputs"]
    whole = multi_exit_logits(params, CFG, EXITS, tokens)
    part = multi_exit_logits(p3, cfg3, (1, 3), tokens)
    for a, b in zip(part, (whole[0], whole[1])):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert extra["s2d_exits"] == list(EXITS)  # the input is left as it was
    for bad in ([2], [3, 1], [], [1, 1]):
        with pytest.raises(S2DError, match="not ascending exits of the draft"):
            draft_prefix(CFG, params, extra, bad)

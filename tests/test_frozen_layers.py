"""optimizer.frozen_layers: a deeper exit trained onto a draft's frozen first layers. The
frozen layers, the final norm and so the shallower exits keep their values exactly; the
deeper layers get the gradient of the deeper exits' loss alone; the frozen layers' backward
pass is not computed (fewer flops); a freeze that leaves nothing to train is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from s2d_jax.errors import S2DError
from s2d_jax.model import layers
from s2d_jax.model.sorted_draft import soft_objective
from s2d_jax.train.config import OptimizerConfig
from s2d_jax.train.loop import initial_params, train
from s2d_jax.train.step import frozen_paths, make_optimizer, stop_frozen_gradients
import test_engine_distribution as dist
from test_trainer import synthetic_config

EXITS = (1, 2, 3)  # dist.CFG has 3 layers


def batch():
    rng = np.random.default_rng(0)
    return {"inputs": jnp.asarray(rng.integers(0, 12, (2, 6)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, 12, (2, 6)), jnp.int32),
            "loss_mask": jnp.ones((2, 6), jnp.float32)}


def loss_fn(frozen_layers, weights=(1.0, 1.0, 1.0)):
    o = OptimizerConfig(frozen=("embed",), frozen_layers=frozen_layers)

    def loss(params, b):
        return soft_objective(stop_frozen_gradients(params, frozen_paths(o)), dist.CFG, EXITS, b,
                              weights, jnp.float32(12), frozen_layers=frozen_layers)[0]
    return loss


def test_deeper_layers_get_the_deeper_exits_gradient_and_frozen_ones_none():
    p, b = dist.params(), batch()
    frozen = jax.grad(loss_fn(1))(p, b)
    # the same objective unfrozen, with the exit at depth 1 weighted 0: the layers past the
    # freeze see the same loss, so the same gradient
    reference = jax.grad(loss_fn(0, (0.0, 1.0, 1.0)))(p, b)
    for name, g in frozen["layers"].items():
        assert float(jnp.abs(g[:1]).max()) == 0.0, name
        np.testing.assert_allclose(g[1:], reference["layers"][name][1:], rtol=2e-5, atol=1e-7)
        assert float(jnp.abs(g[1:]).max()) > 0, name
    assert float(jnp.abs(frozen["final_norm"]).max()) == 0.0
    assert float(jnp.abs(reference["final_norm"]).max()) > 0  # frozen by the freeze alone


def test_loss_is_the_mean_over_the_deeper_exits_and_metrics_cover_every_exit():
    p, b = dist.params(), batch()
    loss, (ce, correct, _) = soft_objective(p, dist.CFG, EXITS, b, (1.0,) * 3, jnp.float32(12),
                                            frozen_layers=1)
    _, (ce0, correct0, _) = soft_objective(p, dist.CFG, EXITS, b, (1.0,) * 3, jnp.float32(12))
    np.testing.assert_allclose(ce, ce0, rtol=1e-6)
    np.testing.assert_array_equal(correct, correct0)
    np.testing.assert_allclose(loss, (ce0[1] + ce0[2]) / 12 / 2, rtol=1e-6)


def test_the_frozen_layers_backward_pass_is_not_computed(monkeypatch):
    """Exits 2 and 3 in the loss either way: freezing layer 1 changes no loss term, only
    whether its backward pass (and its weights' gradient) is computed. The layer scans are
    unrolled: XLA's cost analysis counts a loop body once."""
    monkeypatch.setattr(layers, "TRAIN_UNROLL", True)
    p, b = dist.params(), batch()

    def flops(n):
        def loss(params, b):
            o = OptimizerConfig(frozen=("embed",), frozen_layers=n)
            return soft_objective(stop_frozen_gradients(params, frozen_paths(o)), dist.CFG,
                                  (2, 3), b, (1.0, 1.0), jnp.float32(12), frozen_layers=n)[0]
        return jax.jit(jax.grad(loss)).lower(p, b).compile().cost_analysis()["flops"]

    frozen, full = flops(1), flops(0)
    # a layer's backward pass is about twice its forward: a third of the layer flops go
    assert frozen < full - 0.1 * full, (frozen, full)


def test_optimizer_keeps_frozen_rows_and_final_norm_under_weight_decay():
    p = dist.params()
    o = OptimizerConfig(lr=1e-2, weight_decay=0.1, frozen=("embed",), frozen_layers=2)
    tx, _ = make_optimizer(o, 10)
    grads = jax.tree.map(jnp.ones_like, p)  # even a stray gradient moves nothing frozen
    updates, _ = tx.update(grads, tx.init(p), p)
    new = optax.apply_updates(p, updates)
    for name, w in p["layers"].items():
        np.testing.assert_array_equal(new["layers"][name][:2], w[:2])
        assert float(jnp.abs(new["layers"][name][2:] - w[2:]).max()) > 0, name
    np.testing.assert_array_equal(new["final_norm"], p["final_norm"])
    np.testing.assert_array_equal(new["embed"], p["embed"])


def test_a_run_keeps_its_frozen_prefix_bit_for_bit(tmp_path):
    tc = synthetic_config(tmp_path, "optimizer.frozen_layers=2", "optimizer.total_steps=4",
                          "optimizer.frozen=[embed]")
    out = train(tc, devices=jax.devices()[:1], progress=False)
    start = initial_params(out["cfg"], None, out["state"].params["embed"].sharding.mesh, tc.seed)
    trained = out["state"].params
    for name, w in start["layers"].items():
        np.testing.assert_array_equal(trained["layers"][name][:2], w[:2])
        assert float(jnp.abs(trained["layers"][name][2:] - w[2:]).max()) > 0, name
    np.testing.assert_array_equal(trained["final_norm"], start["final_norm"])
    for r in out["history"]:  # the logged loss is the mean over exits 3 and 4
        np.testing.assert_allclose(r["loss"], (r["exit_loss"]["3"] + r["exit_loss"]["4"]) / 2,
                                   rtol=1e-6)


@pytest.mark.parametrize("value,match", [("4", "freezes every exit"), ("-1", ">= 0")])
def test_a_freeze_that_leaves_nothing_to_train_is_refused(tmp_path, value, match):
    with pytest.raises(S2DError, match=match):
        tc = synthetic_config(tmp_path, f"optimizer.frozen_layers={value}")
        train(tc, devices=jax.devices()[:1], progress=False)

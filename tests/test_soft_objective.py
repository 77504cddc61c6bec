"""One SoFT objective: the jitted training step's loss (and the gradient it applies) is
sorted_draft.soft_loss on the same batch, with and without distillation, with the full and
a sub-vocabulary head, with and without gradient accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.model.sorted_draft import soft_loss
from s2d_jax.parallel.mesh import MeshConfig, make_mesh
from s2d_jax.train.config import OptimizerConfig
from s2d_jax.train.step import make_init_fn, make_optimizer, make_train_step, state_shardings
from tiny_models import numpy_params

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                  num_kv_heads=2, max_position_embeddings=64)
EXITS, WEIGHTS = (1, 2, 3), (1.0, 0.5, 2.0)
HEAD = tuple(range(0, 64, 3))  # a third of the vocabulary: some targets fall outside it


def _batch(kd: bool, B=4, T=12):
    """Random rows; with `kd`, the target's states (as data.teacher gives them)."""
    rng = np.random.default_rng(0)
    b = {"inputs": rng.integers(0, 64, (B, T)), "targets": rng.integers(0, 64, (B, T)),
         "loss_mask": (rng.random((B, T)) > 0.25).astype(np.float32),
         "segment_ids": np.ones((B, T)), "positions": np.tile(np.arange(T), (B, 1)),
         "teacher_hidden": rng.standard_normal((B, T, CFG.hidden_size)).astype(np.float16)}
    return {k: jnp.asarray(v if v.dtype.kind == "f" else v.astype(np.int32))
            for k, v in b.items() if kd or k != "teacher_hidden"}


@pytest.mark.parametrize("kd_weight, head_ids, accum", [
    # ce and sub-vocab-kd-accum cover every term; the two between are slow (CI time)
    (0.0, None, 1), pytest.param(0.3, None, 2, marks=pytest.mark.slow),
    pytest.param(0.0, HEAD, 1, marks=pytest.mark.slow), (0.3, HEAD, 2)],
    ids=["ce", "kd-accum", "sub-vocab", "sub-vocab-kd-accum"])
def test_train_step_loss_and_gradient_are_the_soft_objective(kd_weight, head_ids, accum):
    params, batch = numpy_params(CFG, seed=1, std=0.2), _batch(kd_weight > 0)
    head = None if head_ids is None else jnp.asarray(head_ids, jnp.int32)

    def objective(p):
        return soft_loss(p, CFG, EXITS, batch, WEIGHTS, head_ids=head, kd_weight=kd_weight)

    (want, parts), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    tx, schedule = make_optimizer(OptimizerConfig(lr=1e-3, grad_accum_steps=accum), 10)
    shardings = state_shardings(CFG, mesh, tx)
    step = make_train_step(CFG, EXITS, WEIGHTS, tx, schedule, mesh, shardings, accum,
                           head_ids=head_ids, kd_weight=kd_weight)
    _, got = step(make_init_fn(tx, shardings)(params), batch)
    np.testing.assert_allclose(got["loss"], want, rtol=2e-6)
    np.testing.assert_allclose(got["grad_norm"], optax.global_norm(grads), rtol=1e-5)
    for key in ("exit_loss", "exit_acc", "exit_kd", "tokens"):
        np.testing.assert_allclose(got[key], parts[key], rtol=2e-6, atol=1e-7)
    assert (float(parts["exit_kd"].min()) > 0) == (kd_weight > 0)  # the KD term is there

"""The SoFT loss scored in pieces of the rows (sorted_draft.loss_pieces) and under each remat
policy: the same loss and gradients as the objective written out exit by exit over whole
rows, and the gradient never builds an exit's logits over a whole row."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from s2d_jax.config import ModelConfig
from s2d_jax.model import sorted_draft, transformer as model
from s2d_jax.model.layers import REMAT_POLICIES
from s2d_jax.model.sorted_draft import loss_pieces, multi_exit_logits, soft_objective
from tiny_models import numpy_params

# vocab_size unlike every other width, so a [B, T, V] shape is logits and nothing else
CFG = ModelConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=64)
EXITS, WEIGHTS = (1, 2, 3), (1.0, 0.5, 2.0)
B, T = 2, 12


def _batch():
    rng = np.random.default_rng(3)
    return {"inputs": jnp.asarray(rng.integers(0, 80, (B, T)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, 80, (B, T)), jnp.int32),
            "loss_mask": jnp.asarray(rng.random((B, T)) > 0.25, jnp.float32),
            "teacher_hidden": jnp.asarray(rng.standard_normal((B, T, 32)), jnp.float16)}


def _whole_rows_objective(params, batch, kd_weight):
    """The objective as the loss held it before pieces: each exit's [B, T, V] logits,
    masked CE and KD to the target's softmax, weighted mean over exits."""
    mask = batch["loss_mask"]
    # the target's logits: from its states and the frozen head (no gradient through them)
    t_logits = jnp.einsum("btd,dv->btv", batch["teacher_hidden"].astype(jnp.float32),
                          jax.lax.stop_gradient(params["lm_head"]).astype(jnp.float32))
    per_exit = []
    for logits in multi_exit_logits(params, CFG, EXITS, batch["inputs"]):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        kd = optax.softmax_cross_entropy(logits, jax.nn.softmax(t_logits))
        per_exit.append((1 - kd_weight) * jnp.sum(ce * mask) + kd_weight * jnp.sum(kd * mask))
    w = jnp.asarray(WEIGHTS)
    return jnp.sum(w * jnp.stack(per_exit)) / jnp.sum(mask) / jnp.sum(w)


def _assert_trees_close(got, want, rtol):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def _objective(params, batch, kd_weight, remat="none"):
    return soft_objective(params, CFG, EXITS, batch, WEIGHTS, jnp.sum(batch["loss_mask"]),
                          remat, kd_weight=kd_weight)[0]


@pytest.mark.parametrize("seq_len, chunk, pieces", [(1024, 256, 4), (12, 5, 3), (12, 4, 3),
                                                    (7, 2, 7), (16, 256, 1), (1023, 256, 11)])
def test_rows_split_into_the_fewest_equal_pieces_no_longer_than_the_chunk(seq_len, chunk,
                                                                          pieces):
    assert loss_pieces(seq_len, chunk) == pieces


@pytest.mark.parametrize("chunk", [4, 5, 256])  # 3 pieces of 4, 3 of 4, one whole row
@pytest.mark.parametrize("kd_weight", [0.0, 0.5])
def test_loss_and_gradients_in_pieces_are_the_whole_rows_objective(monkeypatch, chunk,
                                                                   kd_weight):
    monkeypatch.setattr(sorted_draft, "LOSS_CHUNK", chunk)
    params, batch = numpy_params(CFG, seed=1, std=0.2), _batch()
    want, want_g = jax.value_and_grad(_whole_rows_objective)(params, batch, kd_weight)
    got, got_g = jax.jit(jax.value_and_grad(_objective), static_argnums=2)(params, batch,
                                                                          kd_weight)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    _assert_trees_close(got_g, want_g, 2e-5)


def _shapes(jaxpr):
    for eqn in jaxpr.eqns:
        yield from (tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        for p in eqn.params.values():
            for x in p if isinstance(p, (list, tuple)) else [p]:
                sub = getattr(x, "jaxpr", x)
                if hasattr(sub, "eqns"):
                    yield from _shapes(sub)


def test_the_gradient_builds_logits_one_piece_at_a_time(monkeypatch):
    monkeypatch.setattr(sorted_draft, "LOSS_CHUNK", 4)
    params, batch = numpy_params(CFG, seed=1), _batch()
    shapes = set(_shapes(jax.make_jaxpr(jax.grad(_objective), static_argnums=2)(
        params, batch, 0.5).jaxpr))
    assert (B, 4, CFG.vocab_size) in shapes  # a piece's logits...
    assert (B, T, CFG.vocab_size) not in shapes  # ...never a whole row's


@pytest.mark.parametrize("remat", [r for r in REMAT_POLICIES if r != "none"])
def test_every_remat_policy_compiles_to_the_same_loss_and_gradients(remat):
    params, batch = numpy_params(CFG, seed=2, std=0.2), _batch()
    f = jax.jit(jax.value_and_grad(_objective), static_argnums=(2, 3))
    want, want_g = f(params, batch, 0.5, "none")
    got, got_g = f(params, batch, 0.5, remat)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    _assert_trees_close(got_g, want_g, 1e-5)


def test_named_policies_keep_the_named_projections_and_recompute_the_rest():
    """The names block.block puts on its projections reach the policies: each keeps fewer
    of a layer's values for the backward pass than the next (none keeps all)."""
    params, batch = numpy_params(CFG, seed=2), _batch()

    def saved(remat):
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        h = model.embed_tokens(params, CFG, batch["inputs"])
        f = lambda p: model.run_layers(p, CFG, h, pos, remat=remat)[0].sum()  # noqa: E731
        # what the backward pass reads: the leaves of the vjp's closure
        return sum(x.size for x in jax.tree.leaves(jax.vjp(f, params)[1]))

    assert (saved("full") < saved("save_dot_with_context_except_mlp") < saved("minimal")
            < saved("minimal_with_context") < saved("none"))

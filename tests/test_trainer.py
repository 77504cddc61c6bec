"""The SoFT trainer: losses fall, sharding does not change the numbers, accumulation is exact."""

import jax
import numpy as np
import optax
import pytest

from s2d_jax.train.config import load_train_config
from s2d_jax.train.loop import train

TINY_MODEL = """\
vocab_size: 64
hidden_size: 32
intermediate_size: 64
num_layers: 4
num_heads: 4
num_kv_heads: 2
max_position_embeddings: 128
"""


def synthetic_config(tmp_path, *overrides):
    model = tmp_path / "tiny.yaml"
    model.write_text(TINY_MODEL)
    return load_train_config(None, [
        f"model.path={model}", "draft.exits=[2,3,4]", "synthetic_data=true",
        "data.batch_size=8", "data.seq_len=32", "optimizer.lr=0.003",
        "optimizer.warmup_steps=3", "optimizer.total_steps=20", *overrides])


def run(tc, n_devices):
    return train(tc, devices=jax.devices()[:n_devices], progress=False)


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    return run(synthetic_config(tmp_path_factory.mktemp("one")), 1)


def test_short_run_every_exit_loss_falls_and_loss_is_their_mean(one_device_run):
    hist = one_device_run["history"]
    assert [r["step"] for r in hist] == list(range(1, 21))
    first, last = hist[0], hist[-1]
    for e in ("2", "3", "4"):
        assert last["exit_loss"][e] < first["exit_loss"][e] - 0.5, (e, first, last)
        assert last["exit_acc"][e] > first["exit_acc"][e]
    for r in hist:
        np.testing.assert_allclose(r["loss"], np.mean(list(r["exit_loss"].values())), rtol=1e-6)


def test_hooks_run_after_every_step_with_its_metrics_record(tmp_path, one_device_run):
    """train(hooks=...): each hook sees every step, the state after it and, on logged
    steps, the very record of the run's history (the same settings: the step is cached)."""
    seen = []

    def hook(step, state, record):
        seen.append((step, int(state.step), record))

    out = train(synthetic_config(tmp_path), devices=jax.devices()[:1], progress=False,
                hooks=[hook])
    assert [(s, t) for s, t, _ in seen] == [(s, s) for s in range(1, 21)]
    assert [r for _, _, r in seen] == out["history"]
    assert [r["loss"] for r in out["history"]] == [r["loss"] for r in one_device_run["history"]]


def test_one_device_and_2x2x2_mesh_agree(tmp_path, one_device_run):
    tc = synthetic_config(tmp_path, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    sharded = run(tc, 8)
    # The state really is split over the mesh (heads over tensor=2, embed over fsdp=2).
    wq = sharded["state"].params["layers"]["wq"]
    assert len(wq.sharding.device_set) == 8
    assert wq.addressable_shards[0].data.shape == (4, 16, 2, 8)
    # Adam's moments are placed like the params they belong to.
    for moment in ("mu", "nu"):
        m = optax.tree_utils.tree_get(sharded["state"].opt_state, moment)
        assert m["layers"]["wq"].sharding.is_equivalent_to(wq.sharding, wq.ndim)
        assert m["embed"].sharding.is_equivalent_to(sharded["state"].params["embed"].sharding, 2)
    assert len(sharded["history"]) == len(one_device_run["history"]) == 20
    for a, b in zip(one_device_run["history"], sharded["history"]):
        assert a["batch_fingerprint"] == b["batch_fingerprint"]
        np.testing.assert_allclose(b["loss"], a["loss"], atol=1e-5, rtol=0)
        for e in a["exit_loss"]:
            np.testing.assert_allclose(b["exit_loss"][e], a["exit_loss"][e], atol=1e-5, rtol=0)


@pytest.mark.slow  # CI time: two training runs; tests/test_soft_objective.py checks an accumulated
# step's loss and gradient norm against the whole batch's objective in the fast set
def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    a1 = run(synthetic_config(tmp_path, "optimizer.total_steps=4"), 1)
    a4 = run(synthetic_config(tmp_path, "optimizer.total_steps=4",
                              "optimizer.grad_accum_steps=4"), 1)
    for x, y in zip(jax.tree.leaves(a1["state"].params), jax.tree.leaves(a4["state"].params)):
        np.testing.assert_allclose(x, y, atol=2e-6, rtol=1e-5)
    for r1, r4 in zip(a1["history"], a4["history"]):
        np.testing.assert_allclose(r1["loss"], r4["loss"], rtol=1e-5)
        np.testing.assert_allclose(r1["grad_norm"], r4["grad_norm"], rtol=1e-4)

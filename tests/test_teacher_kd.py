"""Distillation on the target's whole distribution: the stored teacher states, their
alignment with packed training tokens, the KD term of the SoFT loss, and a training run."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.data.pipeline import DataConfig, make_iterator
from s2d_jax.data.teacher import (META, STATES, TeacherStates, join_states,
                                  write_teacher_states)
from s2d_jax.readers import sha256_of
from s2d_jax.errors import S2DError
from s2d_jax.io.hf import export_hf
from s2d_jax.io.tokenizer import load_tokenizer
from s2d_jax.model import transformer as model
from s2d_jax.model.sorted_draft import soft_sums
from s2d_jax.train.config import load_train_config
from s2d_jax.train.loop import train
import test_engine_distribution as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "assets", "llama2_tokenizer")
TCFG = model.ModelConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_layers=3,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=256)


def write_rows(path, lengths, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for n in lengths:
            ids = rng.integers(3, 2000, n).tolist()
            f.write(json.dumps({"input_ids": ids, "learn_from": n // 3}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("kd")
    params = jax.device_get(model.init_params(TCFG, jax.random.key(3), std=0.3))
    export_hf(params, TCFG, str(d / "target"))
    return d, params


@pytest.mark.slow
def test_states_are_the_targets_final_normed_states(target):
    d, params = target
    lengths = [2, 5, 64, 65, 70, 130, 9]  # across padding buckets of 64
    rows = write_rows(d / "rows.jsonl", lengths)
    logs = []
    out = write_teacher_states(str(d / "target"), rows, str(d / "teacher"), batch_tokens=128,
                               log=logs.append)
    st = TeacherStates(out, rows)
    assert st.states.shape == (sum(n - 1 for n in lengths), TCFG.hidden_size)
    for i, line in enumerate(open(rows)):
        ids = json.loads(line)["input_ids"][:-1]
        tokens = jnp.asarray([ids])
        h, _ = model.run_layers(params, TCFG, model.embed_tokens(params, TCFG, tokens),
                                jnp.arange(len(ids))[None])
        want = np.asarray(model.rms_norm(h, params["final_norm"], TCFG.rms_norm_eps))[0]
        got = st.gather(st.offsets[i] + np.arange(len(ids)))
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3)
    # idempotent; another version of the rows is refused
    write_teacher_states(str(d / "target"), rows, out, log=logs.append)
    assert logs[-1].endswith("is up to date")
    other = write_rows(d / "other.jsonl", lengths, seed=1)
    with pytest.raises(S2DError, match="another version"):
        TeacherStates(out, other)
    with pytest.raises(S2DError, match="holds no teacher_states.json"):
        TeacherStates(str(d))


def test_a_grown_slice_copies_the_states_of_the_rows_it_shares(target):
    """reuse: the leading rows both files hold keep their stored states (bit for bit); the
    rest, the cut last row of the smaller slice included, are computed as from scratch."""
    d, _ = target
    big = write_rows(d / "big.jsonl", [9, 70, 33, 5, 40], seed=4)
    rows = [json.loads(line) for line in open(big)]
    small = d / "small.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in
                             rows[:2] + [{**rows[2], "input_ids": rows[2]["input_ids"][:20]}]))
    tgt = str(d / "target")
    old = TeacherStates(write_teacher_states(tgt, str(small), str(d / "t-small"),
                                             log=lambda m: None), str(small))
    logs = []
    grown = TeacherStates(write_teacher_states(tgt, big, str(d / "t-big"), log=logs.append,
                                               reuse=(str(small), str(d / "t-small"))), big)
    fresh = TeacherStates(write_teacher_states(tgt, big, str(d / "t-fresh"),
                                               log=lambda m: None), big)
    assert logs[0].startswith("[teacher] 2 of 5 rows (77 states) from")
    np.testing.assert_array_equal(grown.states[:77], old.states[:77])
    np.testing.assert_allclose(grown.states[:].astype(np.float32),
                               fresh.states[:].astype(np.float32), rtol=2e-3, atol=2e-3)
    # the reused file's rows are checked: states of another version are refused
    with pytest.raises(S2DError, match="another version"):
        write_teacher_states(tgt, big, str(d / "t-bad"), reuse=(big, str(d / "t-small")))
    assert not os.path.exists(d / "t-bad")


def fake_teacher(path, rows_path, dim=4):
    """States whose first coordinate is the input token at that position."""
    rows = [json.loads(line)["input_ids"] for line in open(rows_path)]
    states = np.zeros((sum(len(r) - 1 for r in rows), dim), np.float16)
    states[:, 0] = np.concatenate([r[:-1] for r in rows])
    os.makedirs(path, exist_ok=True)
    np.save(os.path.join(path, STATES), states)
    offsets = np.concatenate([[0], np.cumsum([len(r) - 1 for r in rows])]).tolist()
    with open(os.path.join(path, META), "w") as f:
        json.dump({"rows_sha256": sha256_of(rows_path), "offsets": offsets, "dim": dim}, f)
    return str(path)


def test_joined_shards_are_indexed_not_copied(tmp_path):
    """The data engine's join: one dir over the shards' state files, read as one array (the
    pipeline's packed rows get their own states), no second copy on disk; a gone or changed
    shard is refused with the fix."""
    rows = write_rows(tmp_path / "rows.jsonl", [5, 17, 40, 3, 60, 12, 33, 8] * 3)
    whole = TeacherStates(fake_teacher(tmp_path / "whole", rows), rows).states
    cuts = [0, 30, 31, 200, whole.shape[0]]
    parts = []
    for i in range(len(cuts) - 1):
        parts.append(str(tmp_path / "shards" / f"states-{i}.npy"))
        os.makedirs(tmp_path / "shards", exist_ok=True)
        np.save(parts[-1], np.asarray(whole[cuts[i]:cuts[i + 1]]))
    out = tmp_path / "train" / "teacher"
    os.makedirs(out)
    np.save(out / STATES, np.zeros((1, 4), np.float16))  # an earlier version's joined copy
    join_states(parts, rows, str(out), "t", log=lambda *_: None)
    assert sorted(os.listdir(out)) == [META]  # the states live in the shards only
    joined = TeacherStates(str(out), rows)
    index = np.array([[0, 29, 30, 31], [199, 200, whole.shape[0] - 1, 5]])
    np.testing.assert_array_equal(joined.gather(index), np.asarray(whole)[index])
    np.testing.assert_array_equal(joined.states[:250], np.asarray(whole[:250]))
    with pytest.raises(IndexError):
        joined.gather(np.array([whole.shape[0]]))
    cfg = DataConfig(paths=(rows,), format="tokens", teacher=str(out), seq_len=48,
                     batch_size=4, packing=True, tokenizer=LLAMA)
    b = next(make_iterator(cfg, load_tokenizer(LLAMA), 0, 1))
    real = b["segment_ids"] > 0
    np.testing.assert_array_equal(b["teacher_hidden"][..., 0][real], b["inputs"][real])
    np.save(parts[2], np.asarray(whole[31:150]))  # a shard rewritten shorter
    with pytest.raises(S2DError, match="teacher stage"):
        TeacherStates(str(out), rows)
    os.remove(parts[2])
    with pytest.raises(S2DError, match="teacher stage"):
        TeacherStates(str(out), rows)


@pytest.mark.parametrize("packing", [True, False])
def test_every_packed_token_gets_its_own_state(tmp_path, packing):
    rows = write_rows(tmp_path / "rows.jsonl", [5, 17, 40, 3, 60, 12, 33, 8] * 3)
    teacher = fake_teacher(tmp_path / "t", rows)
    cfg = DataConfig(paths=(rows,), format="tokens", teacher=teacher, seq_len=48,
                     batch_size=4, packing=packing, tokenizer=LLAMA)
    it = make_iterator(cfg, load_tokenizer(LLAMA), 0, 1)
    for _ in range(6):
        b = next(it)
        assert "teacher_index" not in b and b["teacher_hidden"].shape == (4, 48, 4)
        real = b["segment_ids"] > 0
        np.testing.assert_array_equal(b["teacher_hidden"][..., 0][real], b["inputs"][real])
    state = it.get_state()
    nxt = next(it)
    it.set_state(state)
    np.testing.assert_array_equal(next(it)["teacher_hidden"], nxt["teacher_hidden"])


def test_bad_teacher_settings_are_refused(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", [5, 6])
    with pytest.raises(S2DError, match="data.teacher needs data.format=tokens"):
        DataConfig(paths=(rows,), teacher="x")
    teacher = fake_teacher(tmp_path / "t", write_rows(tmp_path / "other.jsonl", [5, 6, 7]))
    with pytest.raises(S2DError, match="another version"):
        make_iterator(DataConfig(paths=(rows,), format="tokens", teacher=teacher),
                      load_tokenizer(LLAMA), 0, 1)


def entropy(logits):
    p = jax.nn.softmax(logits, -1)
    return -jnp.sum(p * jax.nn.log_softmax(logits, -1), -1)


@pytest.mark.parametrize("head", [None, np.array([0, 2, 3, 5, 7, 8, 11], np.int32)])
def test_kd_is_the_cross_entropy_to_the_targets_distribution(head):
    cfg, p = dist.CFG, dist.params()
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(0, 12, (2, 6)), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, (2, 6)), jnp.float32)
    h, _ = model.run_layers(p, cfg, model.embed_tokens(p, cfg, inputs),
                            jnp.broadcast_to(jnp.arange(6), (2, 6)))
    x = model.rms_norm(h, p["final_norm"], cfg.rms_norm_eps)
    batch = {"inputs": inputs, "targets": inputs, "loss_mask": mask, "teacher_hidden": x}
    hid = None if head is None else jnp.asarray(head)
    # the student is the teacher: KD = the teacher's entropy (KL 0)
    _, _, kd = soft_sums(p, cfg, (3,), batch, head_ids=hid)
    logits = model.lm_logits(p, cfg, h)
    logits = logits if head is None else logits[..., head]
    np.testing.assert_allclose(float(kd[0]), float(jnp.sum(entropy(logits) * mask)), rtol=1e-5)
    # a shallower exit is another distribution: KD exceeds the entropy
    _, _, kd = soft_sums(p, cfg, (1, 3), batch, head_ids=hid)
    assert float(kd[0]) > float(jnp.sum(entropy(logits) * mask)) + 1e-3
    # without teacher states the term is 0
    del batch["teacher_hidden"]
    assert float(soft_sums(p, cfg, (1, 3), batch, head_ids=hid)[2].sum()) == 0.0


@pytest.mark.slow  # CI time: a training run; the KD loss itself is tested fast above
def test_training_on_the_targets_distribution_lowers_kd(target, tmp_path):
    d, _ = target
    rows = write_rows(tmp_path / "rows.jsonl", [40, 50, 60, 30])
    teacher = write_teacher_states(str(d / "target"), rows, str(tmp_path / "t"), log=print)
    over = [f"model.path={d / 'target'}", "draft.exits=[1,2]", "draft.kd_weight=1.0",
            f"data.paths=[{rows}]", "data.format=tokens", f"data.teacher={teacher}",
            f"data.tokenizer={LLAMA}", "data.seq_len=64", "data.batch_size=4",
            "optimizer.lr=1e-2", "optimizer.total_steps=12", "log_every=1"]
    hist = train(load_train_config(None, over), jax.devices()[:1], progress=False)["history"]
    first, last = hist[0]["exit_kd"], hist[-1]["exit_kd"]
    # (the floor is the teacher's entropy, near log 32000 = 10.4 for this random target)
    assert all(last[e] < first[e] - 0.25 for e in first), (first, last)
    with pytest.raises(S2DError, match="needs data.teacher"):
        train(load_train_config(None, [o for o in over if "teacher" not in o]),
              jax.devices()[:1], progress=False)


def test_pipeline_refuses_a_kd_weight_outside_0_1(tmp_path, capsys):
    from tiny_models import cli_error
    from train import smollm2_draft
    (tmp_path / "target").mkdir()
    err = cli_error(smollm2_draft.main, capsys, ["--target", str(tmp_path / "target"),
                                                 "--kd-weight", "2", "--out",
                                                 str(tmp_path / "pack")])
    assert "--kd-weight must lie in [0, 1]" in err

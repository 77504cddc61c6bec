"""A draft head over a sub-vocabulary (params["head_ids"]): its logits, its SoFT loss, a
frozen embedding in training, greedy exactness, and losslessness of sampling (chi-square
over the joint of 3 tokens, as tests/test_engine_distribution.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.decode.drafting import draft_token, with_exit_segments
from s2d_jax.decode.sampling import SamplingParams
from s2d_jax.decode.state import DecodeParams, SpecConfig
from s2d_jax.model import transformer as model
from s2d_jax.model.kvcache import init_cache
from s2d_jax.model.sorted_draft import soft_sums
from s2d_jax.train.config import OptimizerConfig
from s2d_jax.train.step import make_optimizer, stop_frozen_gradients
import test_engine
import test_engine_distribution as dist

HEAD = np.array([0, 2, 3, 5, 7, 8, 11], np.int32)  # 7 of the 12 ids of dist.CFG


def test_sub_vocab_logits_are_the_full_ones_on_the_head_and_floor_elsewhere():
    p = dist.params()
    h = jax.random.normal(jax.random.key(0), (2, 3, dist.CFG.hidden_size))
    full = model.lm_logits(p, dist.CFG, h)
    sub = model.lm_logits({**p, "head_ids": jnp.asarray(HEAD)}, dist.CFG, h)
    np.testing.assert_allclose(sub[..., HEAD], full[..., HEAD], rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(dist.CFG.vocab_size), HEAD)
    assert (np.asarray(sub[..., rest]) == model.SUB_VOCAB_FLOOR).all()
    pre = with_exit_segments({**p, "head_ids": jnp.asarray(HEAD)}, (3,))
    np.testing.assert_allclose(model.lm_logits(pre, dist.CFG, h), sub, rtol=1e-6)


@pytest.mark.slow
def test_drafted_tokens_stay_in_the_sub_vocabulary():
    cfg = dist.CFG
    p = with_exit_segments({**dist.params(), "head_ids": jnp.asarray(HEAD)}, (1, 3))
    cache = init_cache(cfg, 64, 16, jnp.float32)
    toks = jnp.tile(jnp.asarray([[1, 5, 7]]), (64, 1))
    pos = jnp.tile(jnp.arange(3)[None], (64, 1))
    sp = SamplingParams.make(temperature=1.0)
    d, q, _, _, _ = draft_token(p, cfg, cache, toks, pos, jax.random.key(3), sp,
                                jnp.asarray([0.5, 0.0]), (1, 3))
    assert np.isin(np.asarray(d), HEAD).all()
    assert float(jnp.abs(q[:, np.setdiff1d(np.arange(cfg.vocab_size), HEAD)]).max()) == 0.0
    np.testing.assert_allclose(np.asarray(q.sum(-1)), 1.0, rtol=1e-5)


def test_soft_loss_on_the_sub_vocabulary_skips_tokens_outside_it():
    cfg, p = dist.CFG, dist.params()
    rng = np.random.default_rng(0)
    batch = {"inputs": jnp.asarray(rng.integers(0, 12, (2, 6)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, 12, (2, 6)), jnp.int32),
             "loss_mask": jnp.ones((2, 6), jnp.float32)}
    ce, correct, _ = soft_sums(p, cfg, (3,), batch, head_ids=jnp.asarray(HEAD))
    h = model.run_layers(p, cfg, model.embed_tokens(p, cfg, batch["inputs"]),
                         jnp.broadcast_to(jnp.arange(6), (2, 6)))[0]
    logits = np.asarray(model.lm_logits(p, cfg, h))[..., HEAD]
    t = np.asarray(batch["targets"])
    inside = np.isin(t, HEAD)
    sub_t = np.searchsorted(HEAD, t)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, np.minimum(sub_t, len(HEAD) - 1)[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(ce[0]), want[inside].sum(), rtol=1e-4)
    hits = (logits.argmax(-1) == sub_t) & inside
    assert float(correct[0]) == hits.sum()


@pytest.mark.slow
def test_frozen_embedding_keeps_its_values_and_other_params_train():
    cfg, p = dist.CFG, dist.params()
    tx, _ = make_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, frozen=("embed",)), 10)
    batch = {"inputs": jnp.asarray([[1, 5, 7, 2]]), "targets": jnp.asarray([[5, 7, 2, 3]]),
             "loss_mask": jnp.ones((1, 4))}

    def loss(params):
        return soft_sums(stop_frozen_gradients(params, ("embed",)), cfg, (3,), batch)[0].sum()

    grads = jax.grad(loss)(p)
    assert float(jnp.abs(grads["embed"]).max()) == 0.0
    updates, _ = tx.update(grads, tx.init(p), p)
    new = optax.apply_updates(p, updates)
    np.testing.assert_array_equal(np.asarray(new["embed"]), np.asarray(p["embed"]))
    assert float(jnp.abs(new["layers"]["wq"] - p["layers"]["wq"]).max()) > 0


# sd is slow (CI time); s2d drafts through every exit of the same head in the fast set
@pytest.mark.parametrize("method,exits", [pytest.param("sd", (3,), marks=pytest.mark.slow),
                                          ("s2d", (1, 2, 3))])
def test_greedy_with_a_sub_vocabulary_head_matches_target(method, exits):
    dcfg, dparams = test_engine.draft()
    # the head holds the target's own greedy tokens and more: drafts are often accepted
    ref = {t for pr in test_engine.PROMPTS for t in test_engine.reference(tuple(pr))}
    head = np.array(sorted(ref | set(range(0, 64, 3))), np.int32)
    dec = test_engine.Decoder(test_engine.CFG, test_engine.target_params(), method=method,
                              draft_cfg=dcfg, draft_params={**dparams, "head_ids": head},
                              exits=exits, gamma=3)
    out = dec.generate(test_engine.PROMPTS, max_new_tokens=test_engine.NEW, eos_id=-1,
                       thresholds=[0.3] * len(exits))
    for pr, r in zip(test_engine.PROMPTS, out):
        assert r["token_ids"] == test_engine.reference(tuple(pr))
    assert max(r["stats"]["mean_accepted_tokens"] for r in out) > 1.05  # drafts accepted


@pytest.mark.parametrize("temperature,top_p", [pytest.param(1.0, 1.0, marks=pytest.mark.slow),
                                               (0.7, 0.8)])  # top-p truncation fast
def test_sub_vocabulary_draft_sampling_matches_target_distribution(temperature, top_p):
    spec = SpecConfig(method="s2d", exits=(1, 2), gamma=2, max_len=16)
    dcfg = dataclasses.replace(dist.CFG, num_layers=2)
    dp = DecodeParams.make(spec, [0.6, 0.0], temperature=temperature, top_p=top_p,
                           max_new_tokens=dist.NEW, eos_id=-1)
    prompts = jnp.asarray([dist.PROMPT] * dist.ROWS, jnp.int32)
    lens = jnp.full((dist.ROWS,), len(dist.PROMPT), jnp.int32)
    draft = {**dist.params(), "head_ids": jnp.asarray(HEAD)}
    state = engine.generate(draft, dist.params(), prompts, lens, dp, jax.random.key(11),
                            chain=Chain(dcfg, (), dist.CFG, spec))
    toks = np.asarray(state.tokens[:, len(dist.PROMPT):len(dist.PROMPT) + dist.NEW])
    counts = np.zeros((dist.V,) * 3, np.int64)
    np.add.at(counts, (toks[:, 0], toks[:, 1], toks[:, 2]), 1)
    joint = dist.exact_joint(dp.sampling)
    pval, cells = dist.chi_square_pooled(counts, joint)
    assert cells >= 10, cells
    assert pval > 0.01, (pval, cells)
    # tokens outside the head were produced too (by the target, on rejection)
    assert np.isin(toks, np.setdiff1d(np.arange(dist.V), HEAD)).any()
    assert int(state.stats.accepted_at.sum()) > dist.ROWS // 4
    assert chi_square_pooled_rejects(counts, joint)


def chi_square_pooled_rejects(counts, joint) -> bool:
    """Power check: a slightly wrong distribution is rejected by the same statistic."""
    return dist.chi_square_pooled(counts, 0.85 * joint + 0.15 / joint.size)[0] < 1e-4

"""s2d_jax.bench.agreement's memory-bounded path on the demo family: distributions only at
answer positions and generation in bounded batches give the numbers of the full
computation (every position's distribution, all prompts in one batch)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.bench import agreement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "models", "demo", "target-l")
DRAFT = os.path.join(ROOT, "models", "demo", "draft")
QUESTIONS = os.path.join(ROOT, "data", "demo_calibration.jsonl")


@pytest.fixture(scope="module")
def demo():
    from s2d_jax.data.prompts import encode_questions, read_questions
    from s2d_jax.decode.defaults import draft_exits
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer
    tok = load_tokenizer(TARGET)
    prompts = encode_questions(tok, read_questions(QUESTIONS, None, 4), "none")
    cfg, params, _ = load_model(TARGET, dtype="float32")
    d_cfg, d_params, extra = load_model(DRAFT, dtype="float32")
    draft = agreement.Draft(DRAFT, d_cfg, d_params, draft_exits(extra, d_cfg))
    return cfg, params, draft, prompts, tok.eos_id


def full_distribution_stats(cfg, params, draft, prompts, answers):
    """The reference: the target's and every exit's distributions at every position of
    prompt + answer (all padded to one length: causal, and one compilation), sliced to the
    answer afterwards."""
    from s2d_jax.model import transformer as model
    from s2d_jax.model.sorted_draft import multi_exit_logits

    @jax.jit
    def every_position(tokens):
        p = jax.nn.softmax(model.forward(params, cfg, tokens)[0][0], -1)
        logits = [lg[0] for lg in multi_exit_logits(draft.params, draft.cfg, draft.exits,
                                                    tokens)]
        qs = [jax.nn.softmax(lg, -1) for lg in logits]
        return (jnp.stack([jnp.argmax(lg, -1) for lg in logits], -1),
                jnp.stack([q.max(-1) for q in qs], -1),
                jnp.stack([jnp.minimum(p, q).sum(-1) for q in qs], -1))

    width = max(len(p) + len(a) for p, a in zip(prompts, answers))
    correct, conf, accept = [], [], []
    for prompt, answer in zip(prompts, answers):
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :len(prompt) + len(answer)] = list(prompt) + list(answer)
        ids, cf, ov = jax.device_get(every_position(jnp.asarray(tokens)))
        lo, n = len(prompt), len(answer) - 1
        correct.append(ids[lo:lo + n] == np.asarray(answer[1:])[:, None])
        conf.append(cf[lo:lo + n])
        accept.append(ov[lo:lo + n])
    return correct, conf, np.concatenate(accept).mean(0)


@pytest.mark.slow
def test_answer_rows_give_the_full_distributions_numbers(demo):
    cfg, params, draft, prompts, eos = demo
    answers = agreement.target_answers(cfg, params, prompts, 16, eos)
    assert all(len(a) > 2 for a in answers)
    ((stats, accept),) = agreement.score_drafts(cfg, params, [draft], prompts, answers, 16)
    correct, conf, ref_accept = full_distribution_stats(cfg, params, draft, prompts, answers)
    for mine, ref in zip(stats.correct, correct):
        np.testing.assert_array_equal(mine, ref)
    for mine, ref in zip(stats.conf, conf):
        np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(accept, ref_accept, rtol=1e-5, atol=1e-6)
    rows = agreement.exit_agreement(stats, accept)
    assert [r["agreement"] for r in rows] == [float(np.concatenate(correct)[:, j].mean())
                                              for j in range(len(draft.exits))]


def test_bounded_batches_give_the_one_batch_answers(demo):
    cfg, params, _, prompts, eos = demo
    slots = 300  # room for one demo prompt's buffer at a time
    assert len(agreement.answer_batches(prompts, 16, cfg.max_position_embeddings, slots)) > 1
    assert len(agreement.answer_batches(prompts, 16, cfg.max_position_embeddings, 10 ** 6)) == 1
    assert (agreement.target_answers(cfg, params, prompts, 16, eos, batch_slots=slots)
            == agreement.target_answers(cfg, params, prompts, 16, eos, batch_slots=10 ** 6))


def test_an_exit_pass_holds_no_vocabulary_row_per_prompt_position(demo):
    """Compiled scratch memory of one prompt's exit pass: the answer rows' distributions,
    not a [T, V] one per exit (the vocabulary-wide rows are what grows with the prompt)."""
    from s2d_jax.bench.exit_stats import _exit_predictions
    _, _, draft, _, _ = demo
    T, V = 512, draft.cfg.vocab_size
    tokens = jnp.zeros((1, T), jnp.int32)
    p = jnp.zeros((16, V), jnp.float32)
    bounded = agreement.exit_answer_stats.lower(
        draft.params, tokens, 10, p, cfg=draft.cfg, exits=draft.exits).compile()
    every_position = _exit_predictions.lower(draft.params, tokens, cfg=draft.cfg,
                                             exits=draft.exits).compile()
    saved = (every_position.memory_analysis().temp_size_in_bytes
             - bounded.memory_analysis().temp_size_in_bytes)
    assert saved >= T * V * 4


def test_cached_answers_are_generated_once_per_target_prompts_and_length(demo, tmp_path,
                                                                         monkeypatch):
    cfg, params, _, prompts, eos = demo
    path, calls = str(tmp_path / "answers.json"), []
    real = agreement.target_answers

    def counted(*a, **k):
        calls.append(len(a[2]))
        return real(*a, **k)

    monkeypatch.setattr(agreement, "target_answers", counted)
    first = agreement.cached_target_answers(path, TARGET, cfg, params, prompts, 8, eos)
    again = agreement.cached_target_answers(path, TARGET, cfg, params, prompts, 8, eos)
    assert first == again == real(cfg, params, prompts, 8, eos) and calls == [4]
    agreement.cached_target_answers(path, TARGET, cfg, params, prompts[:3], 8, eos)
    agreement.cached_target_answers(path, TARGET, cfg, params, prompts[:3], 6, eos)
    assert calls == [4, 3, 3]  # other prompts, another length: generated again

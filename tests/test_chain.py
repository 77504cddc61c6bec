"""Polybasic chains (draft -> intermediate(s) -> target) in the one-jit engine: greedy
output equals the target's autoregressive output, every level really accepts and
rejects, statistics add up, and bad chain settings raise clear errors. (n = 2 is the plain
engine, covered by test_engine.py.)"""

import dataclasses
import functools

import numpy as np
import pytest

from s2d_jax.decode.state import SpecConfig
from s2d_jax.errors import S2DError
from s2d_jax.model.quantize import quantize_params
from s2d_jax.decode.serving import Decoder
from test_engine import CFG, NEW, PROMPTS, draft, numpy_init, reference, target_params
from test_generate_cli import models  # noqa: F401  (pytest fixture: tiny exported HF models)

THRESHOLDS = ([0.0] * 3, [1.0] * 3, [0.3] * 3)


@functools.lru_cache(maxsize=None)
def other_model():
    """A different, smaller model with the target's vocab: 2 layers, its own weights."""
    cfg = dataclasses.replace(CFG, num_layers=2, intermediate_size=48, name="other")
    return cfg, numpy_init(cfg, 7, 0.5)


def chain_decoder(intermediates, mus, gamma=2, **kw):
    dcfg, dparams = draft()
    return Decoder(CFG, target_params(), method="s2d", draft_cfg=dcfg, draft_params=dparams,
                   exits=(1, 2, 3), gamma=gamma, intermediates=intermediates, mus=mus, **kw)


def _check(dec, prompts, thresholds=THRESHOLDS, **kw):
    outs = []
    for th in thresholds:
        out = dec.generate(prompts, max_new_tokens=NEW, thresholds=th, eos_id=-1, **kw)
        for p, o in zip(prompts, out):
            assert o["token_ids"] == reference(tuple(p)), (th, p)
        outs.append(out)
    return outs


def test_target_as_its_own_intermediate_accepts_everything_batch4():
    """With intermediate == target, level 2 must accept every token the intermediate passes
    up: any stale cache entry or rollback slip at the intermediate level would show here."""
    dec = chain_decoder([(CFG, target_params())], mus=(3,))
    outs = _check(dec, PROMPTS)
    for out in outs:
        for o in out:
            s = o["stats"]
            draft_rate, mid_rate = s["level_acceptance_rate"]
            assert mid_rate == 1.0 and draft_rate < 1.0, s
            # Each round the target verifies >= mu = 3 tokens and accepts them all, + bonus.
            assert s["mean_accepted_tokens"] >= 3.5, s
            assert s["level_forwards"][1] == s["rounds"]
            assert s["level_forwards"][0] >= s["rounds"]
            assert s["mus"] == [3]
    # Threshold 1 = always the deepest exit, 0 = always the first: exit usage follows.
    assert all(sum(o["stats"]["exit_usage"][:2]) == 0 for o in outs[1])
    assert all(sum(o["stats"]["exit_usage"][1:]) == 0 for o in outs[0])


@pytest.mark.slow  # its own compilation (~35 s); the CLI test also runs an int8 intermediate
def test_int8_target_as_intermediate_is_exact_batch4():
    dec = chain_decoder([(CFG, quantize_params(target_params(), "int8"))], mus=(3,))
    out = _check(dec, PROMPTS, thresholds=([0.3] * 3,))[0]
    for o in out:
        draft_rate, mid_rate = o["stats"]["level_acceptance_rate"]
        assert mid_rate > draft_rate, o["stats"]  # the int8 copy is the better proposer


@pytest.mark.slow  # its own compilation (~35 s); test_chain_distribution covers rejections
def test_different_intermediate_is_exact_batch1_with_rejections_at_both_levels():
    dec = chain_decoder([other_model()], mus=(2,), gamma=3)
    outs = _check(dec, [PROMPTS[0]])
    rates = np.array([o[0]["stats"]["level_acceptance_rate"] for o in outs])
    # A random other model disagrees often: the target rejects some of its tokens, and it
    # rejects some of the draft's, yet the output is the target's.
    assert (rates < 1).all() and (rates > 0).any(), rates


def test_chain_stops_at_eos_and_budget():
    dec = chain_decoder([(CFG, target_params())], mus=(3,))  # compiled by the test above
    ref = reference(tuple(PROMPTS[1]))
    eos = ref[6]
    out = dec.generate(PROMPTS, max_new_tokens=NEW, thresholds=[0.3] * 3, eos_id=eos)
    for p, o in zip(PROMPTS, out):
        r = reference(tuple(p))
        assert o["token_ids"] == (r[:r.index(eos) + 1] if eos in r else r)
    out = dec.generate(PROMPTS, max_new_tokens=7, thresholds=[0.3] * 3, eos_id=-1)
    assert [o["token_ids"] for o in out] == [reference(tuple(p))[:7] for p in PROMPTS]


@pytest.mark.slow  # a 4-level chain is one more nested loop to compile (~40 s)
def test_four_level_chain_is_exact():
    inter = [(CFG, quantize_params(target_params(), "int4", group=8)), other_model()]
    # draft -> int4 target -> other model -> target: a bad ordering still stays exact.
    dec = chain_decoder(inter, mus=(2, 3))
    outs = _check(dec, PROMPTS, thresholds=([0.3] * 3,))
    for o in outs[0]:
        assert len(o["stats"]["level_acceptance_rate"]) == 3


@pytest.mark.slow
def test_streaming_chunks_equal_single_jit_for_a_chain():
    dec = chain_decoder([other_model()], mus=(2,))
    kw = dict(max_new_tokens=NEW, thresholds=[0.4] * 3, temperature=1.0, seed=3, eos_id=-1)
    whole = dec.generate(PROMPTS, **kw)
    chunked = dec.generate(PROMPTS, chunk_rounds=2, **kw)
    assert [o["token_ids"] for o in whole] == [o["token_ids"] for o in chunked]


def test_bad_chain_settings_raise_clear_errors():
    with pytest.raises(S2DError, match="mu"):
        chain_decoder([other_model()], mus=(2, 2))
    with pytest.raises(S2DError, match="vocab_size"):
        cfg, p = other_model()
        chain_decoder([(dataclasses.replace(cfg, vocab_size=65), p)], mus=(2,))
    with pytest.raises(S2DError, match="ar"):
        Decoder(CFG, target_params(), method="ar", intermediates=[other_model()])
    with pytest.raises(S2DError, match="mu"):
        SpecConfig(method="s2d", exits=(1,), gamma=2, mus=(0,))
    spec = SpecConfig(method="s2d", exits=(1,), gamma=2, mus=(3, 4))
    assert spec.num_levels == 4 and spec.block_len(2) == 9 and spec.round_span == 10


@pytest.mark.slow  # exports tiny 32k-vocab HF models and compiles a chain
def test_cli_quantized_target_intermediate_is_lossless(models):
    import json

    from infer.generate import main
    from s2d_jax.data.prompts import prompt_ids, reply_text
    from s2d_jax.io.tokenizer import load_tokenizer
    from test_generate_cli import TOKENIZER, greedy_reference

    root, target = models
    out = root / "chain.jsonl"
    rc = main(["--target", str(root / "target"), "--draft", str(root / "draft"),
               "--method", "s2d", "--thresholds", "0.3,0", "--gamma", "2",
               "--quantize-intermediate", "int8", "--mu", "2", "--max-new-tokens", "6",
               "--questions", str(root / "q.jsonl"), "--batch-size", "2", "--out-file", str(out)])
    assert rc == 0
    tok = load_tokenizer(TOKENIZER)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # every turn is answered (question 7 has two): each against its own conversation so far
    assert [(r["question_id"], r["turn"]) for r in rows] == [(7, 1), (7, 2), (8, 1)]
    first = reply_text(tok, rows[0]["token_ids"])
    prompts = [prompt_ids(tok, "vicuna", ["What is 2+2?"]),
               prompt_ids(tok, "vicuna", ["What is 2+2?", "x"], [first]),
               prompt_ids(tok, "vicuna", ["Say hi."])]
    for row, ids in zip(rows, prompts):
        ref = greedy_reference(target, ids, 6)
        eos_cut = ref.index(tok.eos_id) + 1 if tok.eos_id in ref else len(ref)
        assert row["token_ids"] == ref[:eos_cut]
        assert row["stats"]["mus"] == [2] and len(row["stats"]["level_acceptance_rate"]) == 2


def test_cli_chain_errors(models, capsys):
    from test_generate_cli import _error

    root, _ = models
    base = ["--target", str(root / "target"), "--draft", str(root / "draft"), "--prompt", "hi"]
    assert "needs a chain" in _error(capsys, base + ["--mu", "2"])
    assert "mu" in _error(capsys, base + ["--quantize-intermediate", "int8", "--mu", "2,3"])
    assert "no draft to chain" in _error(capsys, base + ["--method", "ar",
                                                         "--quantize-intermediate", "int8"])
